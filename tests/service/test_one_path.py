"""Both doors through one lifecycle (issue 60), on one live server with both doors open: a gRPC
request and an HTTP request of the same seed give the same tokens, one `request_done` line each of
the same shape, and the same counters; every refused HTTP request is logged and counted like a
refused RPC and carries its x-request-id (as every gRPC error does); every HTTP error body is an
OpenAI error object."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import grpc
import openai
import pytest

from pie.engine.config import EngineConfig
from pie.service.server import BackgroundServer, ServerConfig
from pie.v1 import generate_pb2 as pb
from pie.v1 import generate_pb2_grpc
from pie_client import Client
from tests.service.test_metrics import MODEL, log_lines, scrape, value
from tests.service.test_metrics import log_buffer as log_buffer  # noqa: F401  (the fixture, shared)

# slow: starts a server on the bundled model
pytestmark = pytest.mark.slow

PROMPT = "Once upon a time, there was a little girl named Lily."
KEY = "sk-one-path"
SEEDED = dict(max_tokens=12, temperature=0.9, seed=5)


@pytest.fixture(scope="module")
def server(log_buffer):  # noqa: F811
    config = ServerConfig(port=0, http_port=0, metrics_port=0, grace_s=2, auth_tokens=(KEY,), model_name=MODEL)
    with BackgroundServer(config, EngineConfig(device="cpu", num_kv_blocks=64, max_num_seqs=4)) as s:
        yield s


def _http(server, method: str, path: str, body: bytes | dict | None = None, headers: dict | None = None,
          key: str = KEY) -> tuple[int, dict[str, str], dict]:
    """(status, lower-cased headers, JSON body) of one call to the HTTP door."""
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    sent = urllib.request.Request(f"{server.http_url}{path}", data=data, method=method, headers={
        "Content-Type": "application/json", "Authorization": f"Bearer {key}", **(headers or {})})
    try:
        with urllib.request.urlopen(sent, timeout=60) as r:
            return r.status, {k.lower(): v for k, v in r.headers.items()}, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, {k.lower(): v for k, v in e.headers.items()}, json.loads(e.read())


def _done(log_buffer, request_id: str) -> list[dict]:  # noqa: F811
    return [d for d in log_lines(log_buffer) if d.get("event") == "request_done" and d.get("request_id") == request_id]


def _finished(samples, rpc: str, code: str) -> float:
    return value(samples, "pie_requests_finished_total", 0.0, rpc=rpc, code=code)


def test_a_grpc_and_an_http_request_share_tokens_log_line_and_counters(server, log_buffer):  # noqa: F811
    before = scrape(server)
    with Client(server.address, timeout=60, token=KEY) as c:
        by_grpc = c.generate(PROMPT, request_id="same-grpc", logprobs=1, **SEEDED)
    status, headers, by_http = _http(server, "POST", "/v1/completions",
                                     {"model": MODEL, "prompt": PROMPT, "logprobs": 1, **SEEDED},
                                     {"x-request-id": "same-http"})
    after = scrape(server)
    assert status == 200 and headers["x-request-id"] == "same-http" and by_http["id"] == "same-http"
    assert by_http["choices"][0]["text"] == by_grpc.text and by_grpc.completion_tokens == 12
    assert by_http["choices"][0]["logprobs"]["tokens"] == [e.token for e in by_grpc.logprobs]  # token by token
    assert by_http["usage"]["completion_tokens"] == 12
    assert by_http["usage"]["prompt_tokens"] == by_grpc.prompt_tokens
    (grpc_line,), (http_line,) = _done(log_buffer, "same-grpc"), _done(log_buffer, "same-http")
    assert set(grpc_line) == set(http_line), set(grpc_line) ^ set(http_line)  # the same shape of line
    assert (grpc_line["rpc"], http_line["rpc"]) == ("Generate", "http/completions")
    for name in ("status", "prompt_tokens", "generated_tokens", "finish_reason", "level"):
        assert grpc_line[name] == http_line[name], name
    assert http_line["status"] == "OK" and http_line["finish_reason"] == "length"
    assert _finished(after, "Generate", "OK") - _finished(before, "Generate", "OK") == 1
    assert _finished(after, "http/completions", "OK") - _finished(before, "http/completions", "OK") == 1
    for name, grew in (("vllm:request_success_total", 2), ("vllm:generation_tokens_total", 24),
                       ("vllm:prompt_tokens_total", 2 * by_grpc.prompt_tokens)):
        labels = {"finished_reason": "length"} if "success" in name else {}
        assert value(after, name, 0.0, **labels) - value(before, name, 0.0, **labels) == grew, name


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
REFUSALS = [  # (case, path, body, status, code counted, param)
    ("max-tokens", "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": -1}, 400, "INVALID_ARGUMENT",
     "max_tokens"),
    ("max-tokens-too-long", "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 10**6}, 400,
     "INVALID_ARGUMENT", "max_tokens"),
    ("unknown-model", "/v1/chat/completions", {**CHAT, "model": "gpt-4"}, 404, "NOT_FOUND", None),
    ("malformed-json", "/v1/completions", b"{not json", 400, "INVALID_ARGUMENT", None),
    ("no-messages", "/v1/chat/completions", {"model": MODEL}, 400, "INVALID_ARGUMENT", "messages"),
    ("wizard", "/v1/chat/completions", {**CHAT, "messages": [{"role": "wizard", "content": "x"}]}, 400,
     "INVALID_ARGUMENT", "messages[0].role"),
    ("guided-regex", "/v1/chat/completions", {**CHAT, "guided_regex": "(unclosed"}, 400, "INVALID_ARGUMENT",
     "guided_regex"),
    ("bad-request-id", "/v1/completions", {"model": MODEL, "prompt": PROMPT, "request_id": "x" * 200}, 400,
     "INVALID_ARGUMENT", "request_id"),
]


@pytest.mark.parametrize("case, path, body, status, code, param", REFUSALS, ids=[r[0] for r in REFUSALS])
def test_every_refused_http_request_is_logged_counted_and_carries_its_id(server, log_buffer, case, path, body,  # noqa: F811
                                                                         status, code, param):
    rpc = "http/chat" if path.endswith("chat/completions") else "http/completions"
    before = scrape(server)
    got, headers, answer = _http(server, "POST", path, body, {"x-request-id": f"refused-{case}"})
    assert got == status, answer
    assert set(answer) == {"error"} and set(answer["error"]) == {"message", "type", "param", "code"}
    assert answer["error"]["param"] == param, answer
    assert headers["x-request-id"] == f"refused-{case}"
    (line,) = _done(log_buffer, f"refused-{case}")
    assert (line["rpc"], line["status"]) == (rpc, code)
    assert answer["error"]["message"].split(": ", 1)[-1] in line["error"]  # (the line names the contract's field)
    assert _finished(scrape(server), rpc, code) - _finished(before, rpc, code) == 1


def test_a_call_of_several_prompts_is_one_lifecycle_each_refused_together(server, log_buffer):  # noqa: F811
    """Prompt 1 refused by the engine's check (an id outside the vocabulary): prompt 0, admitted
    first, is aborted and ends CANCELLED; each prompt has its own line under the call's id."""
    body = {"model": MODEL, "prompt": [[5, 6, 7], [10**7]], "max_tokens": 4}
    got, headers, answer = _http(server, "POST", "/v1/completions", body, {"x-request-id": "several"})
    assert got == 400 and answer["error"]["param"] == "prompt" and headers["x-request-id"] == "several"
    (first,), (second,) = _done(log_buffer, "several-0"), _done(log_buffer, "several-1")
    assert (first["status"], first["error"]) == ("CANCELLED", "another prompt of the call was refused")
    assert second["status"] == "INVALID_ARGUMENT" and "outside the vocabulary" in second["error"]
    assert not _done(log_buffer, "several")  # no line for the call itself: its prompts have theirs
    got, _, answer = _http(server, "POST", "/v1/completions", {**body, "prompt": [[5, 6], [7, 8]], "n": 2})
    assert got == 200 and sorted(c["index"] for c in answer["choices"]) == [0, 1, 2, 3]
    rid = answer["id"]
    assert [_done(log_buffer, f"{rid}-{i}")[0]["status"] for i in (0, 1)] == ["OK", "OK"]


def test_a_refusal_without_an_id_gets_a_minted_one_in_its_header_and_line(server, log_buffer):  # noqa: F811
    got, headers, _ = _http(server, "POST", "/v1/completions", {"model": MODEL, "prompt": PROMPT}, key="wrong")
    assert got == 401 and headers["x-request-id"].startswith("cmpl-")
    (line,) = _done(log_buffer, headers["x-request-id"])
    assert line["status"] == "UNAUTHENTICATED"


def test_error_bodies_are_openai_error_objects(server):
    api = openai.OpenAI(base_url=f"{server.http_url}/v1", api_key=KEY, max_retries=0, timeout=60)
    assert api.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError) as unknown:
        api.models.retrieve("gpt-4")
    assert unknown.value.body["code"] == "model_not_found"
    for method, path, status in (("GET", "/v1/nowhere", 404), ("GET", "/v1/completions", 405),
                                 ("DELETE", "/v1/models", 405)):
        got, headers, answer = _http(server, method, path, headers={"x-request-id": "no-route"})
        assert got == status and "detail" not in answer, answer
        assert set(answer["error"]) == {"message", "type", "param", "code"} and headers["x-request-id"] == "no-route"
    with pytest.raises(openai.BadRequestError) as wizard:
        api.chat.completions.create(model=MODEL, messages=[{"role": "wizard", "content": "x"}])  # type: ignore[misc]
    message = wizard.value.body["message"]
    assert all(role in message for role in ("system", "developer", "user", "assistant", "tool")), message
    with pytest.raises(openai.BadRequestError) as regex:
        api.completions.create(model=MODEL, prompt=PROMPT, extra_body={"guided_regex": "(unclosed"})
    assert regex.value.body["param"] == "guided_regex"


def test_every_grpc_error_carries_a_request_id(server):
    """As docs/api.md promises: the caller's x-request-id, else one minted for the error (here for
    RPCs that have no request of their own, and for a call the auth interceptor refused)."""
    with grpc.insecure_channel(server.address) as channel:
        stub = generate_pb2_grpc.GenerateServiceStub(channel)
        auth = ("authorization", f"Bearer {KEY}")
        with pytest.raises(grpc.RpcError) as given:
            stub.Detokenize(pb.DetokenizeRequest(token_ids=[10**9]), metadata=[auth, ("x-request-id", "detok-1")])
        with pytest.raises(grpc.RpcError) as minted:
            stub.Abort(pb.AbortRequest(), metadata=[auth])
        with pytest.raises(grpc.RpcError) as stranger:
            stub.Tokenize(pb.TokenizeRequest(text="hi"))
    assert given.value.code() == minted.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert stranger.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert dict(given.value.trailing_metadata())["x-request-id"] == "detok-1"
    for refused in (minted, stranger):
        assert len(dict(refused.value.trailing_metadata())["x-request-id"]) == 32
