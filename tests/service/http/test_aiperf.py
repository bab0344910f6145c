"""aiperf, the serving benchmark users run against OpenAI-compatible servers, load-tests the HTTP
door: streaming chat completions from several concurrent users through benchmarks/aiperf_http.py
(the script the CPU and GPU figures come from), every request answered, aiperf's token count (from
pie's usage fields) equal to the tokens pie's own metrics say it generated over the run, TTFT and
ITL measured. aiperf lives in a venv of its own (its pins clash with the project's), which .ci/run
makes with benchmarks/aiperf_venv.sh; without that venv this test is skipped."""

from __future__ import annotations

import json
import shutil

import pytest

from benchmarks.aiperf_http import BUNDLED, DEFAULT_AIPERF, endpoint_for, first_error, profile
from pie.engine.config import EngineConfig
from pie.service.server import BackgroundServer, ServerConfig

USERS, REQUESTS, ISL, OSL = 4, 8, 32, 12


@pytest.mark.slow  # starts a server and aiperf's processes
def test_aiperf_load_tests_the_http_door(tmp_path):
    if not DEFAULT_AIPERF.is_file():
        pytest.skip(f"{DEFAULT_AIPERF} is missing: `bash benchmarks/aiperf_venv.sh` makes it (.ci/run does)")
    config = ServerConfig(port=0, http_port=0, grace_s=2)
    with BackgroundServer(config, EngineConfig(device="cpu", num_kv_blocks=128)) as server:
        level = profile(DEFAULT_AIPERF, server.http_url, server.pie.admission.model_name, str(BUNDLED),
                        USERS, REQUESTS, ISL, OSL, tmp_path, timeout_s=240)
    assert (level.requests, level.errors) == (REQUESTS, 0)
    # ignore_eos: every answer is OSL tokens long, as pie's usage says and as its engine counted
    assert level.output_tokens == level.server_tokens == REQUESTS * OSL
    assert 0 < level.ttft_ms[0] <= level.ttft_ms[1]
    assert 0 < level.itl_ms[0] <= level.itl_ms[1]
    assert level.tok_per_s > 0 and level.req_per_s > 0


def test_a_model_without_a_chat_template_is_loaded_through_completions(tmp_path):
    """pie refuses chat for a base model without a template (400 no_chat_template), so every request
    of a chat run failed (the GPU suite's random Llama-1B: all 64 of them); such a model gets aiperf's
    completions endpoint, unless the server is given a template."""
    assert endpoint_for(str(BUNDLED), []) == "chat"
    base = tmp_path / "base"
    shutil.copytree(BUNDLED, base)
    (base / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((base / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (base / "tokenizer_config.json").write_text(json.dumps(config))
    assert endpoint_for(str(base), []) == "completions"
    assert endpoint_for(str(base), ["--chat-template", "t.jinja"]) == "chat"


def test_a_failed_run_names_the_servers_answer(tmp_path):
    """aiperf's last lines say only that every request failed; the first record with an error says why."""
    records = tmp_path / "profile_export.jsonl"
    assert first_error(records) == ""
    ok = {"metadata": {}, "metrics": {"ttft": 1}}
    bad = {"metadata": {}, "error": {"code": 400, "message": "no chat template"}}
    records.write_text("\n".join(json.dumps(r) for r in (ok, bad, bad)) + "\n")
    assert first_error(records) == "\nthe first failed request: 400 no chat template"
