"""pie_client and `pie-client` against a real pie server (a tiny random model on the CPU): the
server's errors said once, and --logprobs and --json carrying what the server computed."""

from __future__ import annotations

import dataclasses
import io
import json
from collections.abc import Iterator

import pytest
import structlog

import pie_client
from pie.engine.config import EngineConfig
from pie.service.logging import configure_logging
from pie.service.server import BackgroundServer, ServerConfig
from pie_client import cli
from tests.helpers import make_hf_model_dir

# slow: every test starts a BackgroundServer
pytestmark = pytest.mark.slow

# Greedy and past end-of-sequence: the same 8 tokens whichever way they are asked for.
MAX_TOKENS = 8
GREEDY = ["--max-tokens", str(MAX_TOKENS), "--ignore-eos"]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BackgroundServer]:
    model_dir = make_hf_model_dir(tmp_path_factory.mktemp("llama"), "llama", weight_scale=4.0)
    cfg = EngineConfig(model=str(model_dir), device="cpu", kv_cache_dtype="fp32", num_kv_blocks=32, max_num_seqs=4)
    saved = structlog.get_config()
    configure_logging(json=True, stream=io.StringIO())  # the server's log lines stay out of the CLI's stdout
    try:
        with BackgroundServer(ServerConfig(port=0, grace_s=1), cfg) as s:
            yield s
    finally:
        structlog.configure(**saved)


@pytest.fixture(scope="module")
def client(server: BackgroundServer) -> Iterator[pie_client.Client]:
    with pie_client.Client(server.address, timeout=60) as c:
        yield c


def _unary(client: pie_client.Client, logprobs: int = 0) -> pie_client.Completion:
    return client.generate("the cat sat", max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=logprobs, request_id="same")


def test_a_server_error_names_code_field_and_request_id_once(
    server: BackgroundServer, client: pie_client.Client, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(pie_client.InvalidArgument) as caught:
        client.generate("hi", temperature=-1.0, request_id="bad-temp-1")
    error = caught.value
    assert [field for field, _ in error.field_violations] == ["sampling.temperature"]
    text = str(error)
    assert text.startswith("INVALID_ARGUMENT: sampling.temperature: ") and text.endswith(" [request_id=bad-temp-1]")
    assert text.count("sampling.temperature") == 1 and text.count(error.field_violations[0][1]) == 1

    assert cli.main(["generate", "hi", "--temperature", "-1", "--address", server.address]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert err.startswith("pie-client: INVALID_ARGUMENT: sampling.temperature: ")
    assert err.count("sampling.temperature") == 1 and err.count(error.field_violations[0][1]) == 1
    request_id = err.rstrip("\n").rpartition(" [request_id=")[2].removesuffix("]")
    assert request_id and request_id != "bad-temp-1"  # the one the server made for this call


def test_streamed_logprobs_table_follows_the_clean_text(
    server: BackgroundServer, client: pie_client.Client, capsys: pytest.CaptureFixture[str]
) -> None:
    done = _unary(client, logprobs=2)
    assert len(done.logprobs) == MAX_TOKENS and all(len(lp.top_logprobs) == 2 for lp in done.logprobs)
    argv = ["generate", "the cat sat", *GREEDY, "--logprobs", "2", "--address", server.address, "--request-id", "same"]
    assert cli.main(argv) == 0
    out, err = capsys.readouterr()
    assert out == done.text + "\n"
    assert err.splitlines() == [
        "logprobs:",
        *cli.logprob_table(done.logprobs),
        f"[finish_reason=length prompt_tokens={done.prompt_tokens} completion_tokens={MAX_TOKENS} request_id=same]",
    ]


def test_json_lines_join_into_the_unary_completion(
    server: BackgroundServer, client: pie_client.Client, capsys: pytest.CaptureFixture[str]
) -> None:
    done = _unary(client, logprobs=1)
    base = ["generate", "the cat sat", *GREEDY, "--logprobs", "1", "--json", "--address", server.address,
            "--request-id", "same"]
    assert cli.main(base) == 0
    out, err = capsys.readouterr()
    assert err == ""
    messages = [json.loads(line) for line in out.splitlines()]
    assert "".join(m["text"] for m in messages) == done.text
    assert [t for m in messages for t in m["token_ids"]] == done.token_ids
    assert [lp for m in messages for lp in m["logprobs"]] == [dataclasses.asdict(lp) for lp in done.logprobs]
    assert messages[-1]["finish_reason"] == "length" and messages[-1]["usage"]["completion_tokens"] == MAX_TOKENS

    assert cli.main([*base, "--no-stream"]) == 0
    out, err = capsys.readouterr()
    assert err == "" and json.loads(out) == dataclasses.asdict(done)
