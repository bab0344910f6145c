"""lm-evaluation-harness against the HTTP door, as a user checks a deployment: its
`local-completions` model (loglikelihood by echo + logprobs, and generate_until) on task data that
ships here (tests/evals/stories_mc: YAML over local JSON, no hub), beside lm-eval's own transformers
backend on the same items and the same checkpoint (the bundled model). fp32 pages: every choice's
loglikelihood within 1e-4 and the same generations; int8 and bf16 pages: the accuracy within the
harness's standard error."""

from __future__ import annotations

from pathlib import Path

import pytest

from pie.engine.config import DEFAULT_MODEL, EngineConfig
from pie.service.server import BackgroundServer, ServerConfig

lm_eval = pytest.importorskip("lm_eval")
pytestmark = pytest.mark.slow  # starts servers

TASKS = Path(__file__).parent / "stories_mc"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """lm-eval's transformers backend (fp32, its defaults: a BOS before each context) on both tasks."""
    return _evaluate("hf", dict(pretrained=DEFAULT_MODEL, dtype="float32", device="cpu"))


def _evaluate(model: str, args: dict) -> dict:
    import os

    from lm_eval.tasks import TaskManager

    cwd = os.getcwd()
    os.chdir(TASKS)  # the task YAMLs name their data files relative to it
    try:
        return lm_eval.simple_evaluate(model=model, model_args=args, tasks=["pie_stories_mc", "pie_stories_gen"],
                                       task_manager=TaskManager(include_path=str(TASKS)), log_samples=True)
    finally:
        os.chdir(cwd)


def _through_pie(kv: str) -> dict:
    config = ServerConfig(port=0, http_port=0, grace_s=2)
    with BackgroundServer(config, EngineConfig(device="cpu", kv_cache_dtype=kv, num_kv_blocks=256)) as server:
        # token ids sent as they are (tokenized_requests), with the BOS the transformers backend adds
        return _evaluate("local-completions", dict(
            model=server.pie.admission.model_name, base_url=f"{server.http_url}/v1/completions",
            tokenizer_backend="huggingface", tokenizer=DEFAULT_MODEL, tokenized_requests=True, add_bos_token=True,
            num_concurrent=2, max_retries=1))


def _choices(result: dict) -> list[list[float]]:
    return [[r[0][0] for r in s["resps"]] for s in result["samples"]["pie_stories_mc"]]


def test_fp32_pages_score_as_transformers(reference):
    ours = _through_pie("fp32")
    got, want = _choices(ours), _choices(reference)
    assert len(got) == len(want) == 24
    assert max(abs(a - b) for g, w in zip(got, want, strict=True) for a, b in zip(g, w, strict=True)) < 1e-4
    assert ours["results"]["pie_stories_mc"]["acc,none"] == reference["results"]["pie_stories_mc"]["acc,none"]
    gen = [s["resps"][0][0] for s in ours["samples"]["pie_stories_gen"]]
    assert gen == [s["resps"][0][0] for s in reference["samples"]["pie_stories_gen"]]
    assert any(g.strip() for g in gen)  # the generations are not all empty (the comparison can fail)


@pytest.mark.parametrize("kv", ["int8", "bf16"])
def test_rounded_pages_keep_the_accuracy(reference, kv):
    ours = _through_pie(kv)["results"]["pie_stories_mc"]
    want = reference["results"]["pie_stories_mc"]
    assert abs(ours["acc,none"] - want["acc,none"]) <= want["acc_stderr,none"]
