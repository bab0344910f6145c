"""Hostile input against a live server: a table of malformed requests (beyond test_server.py's),
raw bytes (unknown fields, garbage), and property-based fuzzing of whole request messages.
Every case must get the right status code naming the field, and the server must keep serving."""

from __future__ import annotations

import math

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pie.engine.config import EngineConfig
from pie.engine.sampling_params import MAX_LOGPROBS, MAX_N, MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS
from pie.service.server import BackgroundServer, ServerConfig
from pie.service.validation import Limits
from pie.v1 import generate_pb2 as pb
from pie.v1 import generate_pb2_grpc as pb_grpc
from pie_client.errors import from_rpc_error
from tests.helpers import TINY_CONFIG, make_hf_model_dir, wait_until

VOCAB = TINY_CONFIG["vocab_size"]
CONTEXT = TINY_CONFIG["max_position_embeddings"]
MAX_CHARS = 4000
MAX_MESSAGE = 256 << 10
GENERATE = "/pie.v1.GenerateService/Generate"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = make_hf_model_dir(tmp_path_factory.mktemp("llama"), "llama")
    cfg = EngineConfig(model=str(model_dir), device="cpu", kv_cache_dtype="fp32", num_kv_blocks=96, max_num_seqs=8,
                       max_num_batched_tokens=512)
    server_cfg = ServerConfig(port=0, max_message_bytes=MAX_MESSAGE, limits=Limits(max_prompt_chars=MAX_CHARS))
    with BackgroundServer(server_cfg, cfg) as s:
        yield s


@pytest.fixture(scope="module")
def channel(server):
    with grpc.insecure_channel(server.address, options=[("grpc.max_send_message_length", 4 << 20)]) as ch:
        yield ch


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(number: int, wire_type: int, payload: bytes) -> bytes:
    tag = _varint(number << 3 | wire_type)
    if wire_type == 2:
        return tag + _varint(len(payload)) + payload
    return tag + payload


def req(prompt: str | list[int] | None = "hello there", **sampling) -> pb.GenerateRequest:
    r = pb.GenerateRequest(sampling=pb.SamplingParams(**sampling))
    if isinstance(prompt, str):
        r.prompt = prompt
    elif prompt is not None:
        r.prompt_token_ids.ids.extend(prompt)
    return r


_VALID = req("hello", max_tokens=2, ignore_eos=True)
_SAMPLING_WITH_UNKNOWN = pb.SamplingParams(max_tokens=2, ignore_eos=True).SerializeToString() + _field(77, 0, _varint(5))

INVALID = grpc.StatusCode.INVALID_ARGUMENT
# (case id, request message or raw bytes, expected code, field named in the BadRequest detail or None)
CASES = [
    ("temperature-inf", req(temperature=math.inf), INVALID, "sampling.temperature"),
    ("temperature-neg-inf", req(temperature=-math.inf), INVALID, "sampling.temperature"),
    ("temperature-tiny", req(temperature=1e-5), INVALID, "sampling.temperature"),
    ("temperature-huge", req(temperature=1000.0), INVALID, "sampling.temperature"),
    ("top_p-nan", req(top_p=math.nan), INVALID, "sampling.top_p"),
    ("top_p-negative", req(top_p=-0.5), INVALID, "sampling.top_p"),
    ("top_p-inf", req(top_p=math.inf), INVALID, "sampling.top_p"),
    ("min_p-nan", req(min_p=math.nan), INVALID, "sampling.min_p"),
    ("min_p-negative", req(min_p=-0.1), INVALID, "sampling.min_p"),
    ("presence-nan", req(presence_penalty=math.nan), INVALID, "sampling.presence_penalty"),
    ("presence-low", req(presence_penalty=-2.5), INVALID, "sampling.presence_penalty"),
    ("frequency-inf", req(frequency_penalty=math.inf), INVALID, "sampling.frequency_penalty"),
    ("frequency-high", req(frequency_penalty=2.5), INVALID, "sampling.frequency_penalty"),
    ("repetition-nan", req(repetition_penalty=math.nan), INVALID, "sampling.repetition_penalty"),
    ("repetition-high", req(repetition_penalty=11.0), INVALID, "sampling.repetition_penalty"),
    ("repetition-negative", req(repetition_penalty=-1.0), INVALID, "sampling.repetition_penalty"),
    ("top_k-vocab-plus-1", req(top_k=VOCAB + 1), INVALID, "sampling.top_k"),
    ("top_k-max-uint32", req(top_k=2**32 - 1), INVALID, "sampling.top_k"),
    ("seed-2^63", req(seed=2**63), INVALID, "sampling.seed"),
    ("stop-too-many", req(stop=[f"s{i}" for i in range(MAX_STOP_STRINGS + 1)]), INVALID, "sampling.stop"),
    ("stop-too-long", req(stop=["y" * (MAX_STOP_STRING_CHARS + 1)]), INVALID, "sampling.stop"),
    ("stop_token_ids-too-many", req(stop_token_ids=list(range(3, 3 + MAX_STOP_TOKEN_IDS + 1))), INVALID,
     "sampling.stop_token_ids"),
    ("stop_token_ids-vocab", req(stop_token_ids=[VOCAB]), INVALID, "sampling.stop_token_ids"),
    ("logprobs-cap-plus-1", req(logprobs=MAX_LOGPROBS + 1), INVALID, "sampling.logprobs"),
    ("n-too-large", req(n=MAX_N + 1), INVALID, "sampling.n"),
    ("n-huge", req(n=2**32 - 1), INVALID, "sampling.n"),
    ("max_tokens-context", req([5], max_tokens=CONTEXT), INVALID, "sampling.max_tokens"),
    ("max_tokens-uint32", req(max_tokens=2**32 - 1), INVALID, "sampling.max_tokens"),
    ("no-prompt", req(None), INVALID, "prompt"),
    ("token-id-vocab", req([3, VOCAB]), INVALID, "prompt_token_ids"),
    ("token-id-uint32", req([2**32 - 1]), INVALID, "prompt_token_ids"),
    ("token-prompt-at-context", req([5] * CONTEXT), INVALID, "prompt"),
    ("text-prompt-too-long", req("z" * (MAX_CHARS + 1)), INVALID, "prompt"),
    ("text-prompt-past-context", req(" ".join(["mountain river"] * 600)[:MAX_CHARS]), INVALID, "prompt"),
    ("whitespace-prompt-past-context", req("\u00e9" * MAX_CHARS), INVALID, "prompt"),
    ("request_id-too-long", pb.GenerateRequest(prompt="hi", request_id="r" * 129), INVALID, "request_id"),
    ("request_id-control-char", pb.GenerateRequest(prompt="hi", request_id="bad\x00id"), INVALID, "request_id"),
    ("oversize-message", req("q" * (MAX_MESSAGE + 1024)), grpc.StatusCode.RESOURCE_EXHAUSTED, None),
    ("unknown-fields", _VALID.SerializeToString() + _field(99, 0, _varint(7)) + _field(100, 2, b"future"),
     grpc.StatusCode.OK, None),
    ("unknown-nested-field", _field(1, 2, b"hello") + _field(3, 2, _SAMPLING_WITH_UNKNOWN) + _field(120, 5, b"\0\0\0\0"),
     grpc.StatusCode.OK, None),
    ("garbage-bytes", b"\xff\xff\xff\xff\x0f", INVALID, None),
    ("truncated-message", _VALID.SerializeToString()[:-3], INVALID, None),
    ("invalid-utf8-prompt", _field(1, 2, b"\xc3\x28\xff"), INVALID, None),
    ("request_id-non-ascii", pb.GenerateRequest(prompt="hi", request_id="caf\u00e9"), INVALID, "request_id"),
]


def _call_raw(channel, body: bytes, timeout: float = 30):
    return channel.unary_unary(GENERATE, request_serializer=None, response_deserializer=None)(body, timeout=timeout)


def _assert_serving(channel) -> None:
    out = pb_grpc.GenerateServiceStub(channel).Generate(req("still there?", max_tokens=2, ignore_eos=True), timeout=30)
    assert out.usage.completion_tokens == 2


@pytest.mark.slow
@pytest.mark.parametrize("case,message,code,field", CASES, ids=[c[0] for c in CASES])
def test_hostile_request(channel, case, message, code, field):
    body = message if isinstance(message, bytes) else message.SerializeToString()
    codes = code if isinstance(code, tuple) else (code,)
    try:
        raw = _call_raw(channel, body)
    except grpc.RpcError as e:
        assert e.code() in codes, (e.code(), e.details())
        error = from_rpc_error(e)
        if field is not None:
            violations = [f for f, _ in error.field_violations]
            assert field in violations, (violations, e.details())
        if e.code() == grpc.StatusCode.INVALID_ARGUMENT:  # every one of ours says why (docs/api.md "Errors")
            want = ("MALFORMED_MESSAGE" if field is None else
                    {"INVALID_FIELD", "PROMPT_TOO_LONG"} if field == "prompt" else "INVALID_FIELD")
            assert error.reason in (want if isinstance(want, set) else {want}), (error.reason, e.details())
    else:
        assert codes == (grpc.StatusCode.OK,), f"accepted; expected {codes}"
        assert pb.GenerateResponse.FromString(raw).usage.completion_tokens == 2  # unknown fields were ignored
    _assert_serving(channel)


def test_the_table_is_big_enough():
    assert len(CASES) >= 30


# ---- property-based fuzzing ---------------------------------------------------------------------

_floats = st.floats(width=32, allow_nan=True, allow_infinity=True)
_uint32 = st.integers(0, 2**32 - 1)
_sampling = st.fixed_dictionaries({}, optional={
    "max_tokens": st.one_of(st.integers(0, 12), _uint32),
    "temperature": st.one_of(st.floats(0, 2, width=32), _floats),
    "top_k": st.one_of(st.integers(0, 64), _uint32),
    "top_p": _floats, "min_p": _floats, "repetition_penalty": _floats,
    "presence_penalty": _floats, "frequency_penalty": _floats,
    "seed": st.integers(0, 2**64 - 1),
    "stop": st.lists(st.text(max_size=300), max_size=20),
    "stop_token_ids": st.lists(st.one_of(st.integers(0, VOCAB), _uint32), max_size=70),
    "ignore_eos": st.booleans(),
    "logprobs": st.one_of(st.integers(0, 25), _uint32),
    "skip_special_tokens": st.booleans(),
})
_prompt = st.one_of(st.none(), st.text(max_size=300), st.lists(st.one_of(st.integers(0, VOCAB + 2), _uint32),
                                                               max_size=80))


@pytest.mark.slow
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prompt=_prompt, sampling=_sampling, request_id=st.one_of(st.just(""), st.text(max_size=140)),
       streaming=st.booleans())
def test_fuzzed_requests_never_crash_hang_or_leak(server, channel, prompt, sampling, request_id, streaming):
    r = req(prompt, **sampling)
    r.request_id = request_id
    stub = pb_grpc.GenerateServiceStub(channel)
    try:
        if streaming:
            s = pb.GenerateStreamRequest.FromString(r.SerializeToString())
            msgs = list(stub.GenerateStream(s, timeout=30))
            assert msgs and msgs[-1].finish_reason != pb.FINISH_REASON_UNSPECIFIED
        else:
            out = stub.Generate(r, timeout=30)
            assert out.finish_reason != pb.FINISH_REASON_UNSPECIFIED
    except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, (e.code(), e.details())
        assert from_rpc_error(e).field_violations, e.details()  # names the field
    wait_until(lambda: server.core.stats().kv_blocks_free == server.core.stats().kv_blocks_total,
               what="every KV block back")
    assert server.pie.engine_client.num_in_flight == 0
