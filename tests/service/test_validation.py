"""Request validation and rich errors without a server: each malformed request is refused naming its
protobuf field, and a ServiceError's trailers decode in the bundled client to the same code, reason,
field, retry delay and request id. The same rules through a live server: test_fuzz.py, test_server.py
(the slow tier)."""

from __future__ import annotations

import math

import grpc
import pytest

from pie.engine.errors import RequestError
from pie.engine.sampling_params import MAX_LOGPROBS, MAX_N, MAX_STOP_STRINGS
from pie.service.errors import REASONS, ServiceError, status_of
from pie.service.validation import (
    DEFAULT_MAX_TOKENS,
    Limits,
    prompt_from_proto,
    qualify,
    request_id_from,
    sampling_from_proto,
)
from pie.v1 import generate_pb2 as pb
from pie_client.errors import InvalidArgument, ResourceExhausted, from_rpc_error

CONTEXT = 256


def test_an_unset_sampling_message_is_the_defaults() -> None:
    params = sampling_from_proto(pb.SamplingParams(), max_model_len=CONTEXT)
    assert (params.max_tokens, params.temperature, params.top_p, params.repetition_penalty) == (DEFAULT_MAX_TOKENS,
                                                                                                 0.0, 1.0, 1.0)
    assert (params.seed, params.n, params.skip_special_tokens, params.logprobs) == (None, 1, True, 0)


def test_set_fields_arrive_as_given() -> None:
    msg = pb.SamplingParams(max_tokens=7, temperature=0.5, top_k=3, top_p=0.9, seed=0, stop=["\n\n"],
                            stop_token_ids=[2], n=2, logprobs=1, skip_special_tokens=False)
    params = sampling_from_proto(msg, max_model_len=CONTEXT)
    assert (params.max_tokens, params.temperature, params.top_k, params.top_p) == (7, 0.5, 3, pytest.approx(0.9))
    assert (params.seed, params.stop, params.stop_token_ids, params.n, params.logprobs) == (0, ["\n\n"], [2], 2, 1)
    assert params.skip_special_tokens is False


@pytest.mark.parametrize("fields, field", [
    ({"max_tokens": CONTEXT + 1}, "sampling.max_tokens"),
    ({"temperature": -1.0}, "sampling.temperature"),
    ({"temperature": math.nan}, "sampling.temperature"),
    ({"top_p": 0.0}, "sampling.top_p"),
    ({"top_p": 1.5}, "sampling.top_p"),
    ({"min_p": 2.0}, "sampling.min_p"),
    ({"repetition_penalty": 0.0}, "sampling.repetition_penalty"),
    ({"presence_penalty": math.inf}, "sampling.presence_penalty"),
    ({"frequency_penalty": -3.0}, "sampling.frequency_penalty"),
    ({"stop": ["x"] * (MAX_STOP_STRINGS + 1)}, "sampling.stop"),
    ({"stop": [""]}, "sampling.stop"),
    ({"n": MAX_N + 1}, "sampling.n"),
    ({"logprobs": MAX_LOGPROBS + 1}, "sampling.logprobs"),
])
def test_a_bad_sampling_field_is_named_by_its_proto_path(fields, field) -> None:
    """The engine's name (`top_p`) or the contract's; admission qualifies it once (`qualify`)."""
    with pytest.raises(RequestError) as err:
        sampling_from_proto(pb.SamplingParams(**fields), max_model_len=CONTEXT)
    assert qualify(err.value.field) == field
    assert str(err.value).startswith(f"{err.value.field}: ")


def test_engine_field_names_are_qualified_once() -> None:
    assert qualify("top_p") == "sampling.top_p"
    assert [qualify(f) for f in ("sampling.n", "prompt", "prompt_token_ids", "request_id")] == \
        ["sampling.n", "prompt", "prompt_token_ids", "request_id"]


def test_the_prompt_is_text_or_ids_as_given() -> None:
    limits = Limits(max_prompt_chars=10, max_prompt_token_ids=3)
    assert prompt_from_proto(pb.GenerateRequest(prompt="once upon"), limits) == "once upon"
    ids = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[5, 6, 7]))
    assert prompt_from_proto(ids, limits) == [5, 6, 7]


@pytest.mark.parametrize("request_, field", [
    (pb.GenerateRequest(), "prompt"),
    (pb.GenerateRequest(prompt=""), "prompt"),
    (pb.GenerateRequest(prompt="x" * 11), "prompt"),
    (pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[])), "prompt_token_ids"),
    (pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[1, 2, 3, 4])), "prompt_token_ids"),
], ids=["none", "empty-text", "too-many-chars", "no-ids", "too-many-ids"])
def test_a_bad_prompt_is_named(request_, field) -> None:
    with pytest.raises(RequestError) as err:
        prompt_from_proto(request_, Limits(max_prompt_chars=10, max_prompt_token_ids=3))
    assert err.value.field == field


def test_the_request_id_comes_from_the_message_then_the_header_then_the_server() -> None:
    minted = iter(["srv-1", "srv-2"])
    assert request_id_from(pb.GenerateRequest(request_id="mine"), {"x-request-id": "hdr"}, lambda: next(minted)) == "mine"
    assert request_id_from(pb.GenerateRequest(), {"x-request-id": "hdr"}, lambda: next(minted)) == "hdr"
    assert request_id_from(pb.GenerateRequest(), {}, lambda: next(minted)) == "srv-1"
    assert request_id_from(pb.GenerateRequest(request_id="r" * 128), {}, lambda: next(minted)) == "r" * 128


@pytest.mark.parametrize("rid", ["r" * 129, "bad\x00id", "caf\u00e9", "tab\there"])
def test_a_request_id_that_cannot_travel_in_metadata_is_refused(rid) -> None:
    with pytest.raises(RequestError) as err:
        request_id_from(pb.GenerateRequest(request_id=rid), {}, lambda: "unused")
    assert err.value.field == "request_id"


class _CallError(grpc.RpcError):
    """What a failed call gives the client: the code, details and trailers the server set."""

    def __init__(self, err: ServiceError, request_id: str | None):
        self._err, self._trailers = err, err.trailing_metadata(request_id)

    def code(self) -> grpc.StatusCode:
        return self._err.code

    def details(self) -> str:
        return self._err.message

    def trailing_metadata(self):
        return self._trailers


def test_an_invalid_field_reaches_the_client_with_its_field_and_request_id() -> None:
    err = status_of(RequestError("sampling.top_p", "must be in (0, 1], got 1.5"))
    seen = from_rpc_error(_CallError(err, "req-7"))
    assert isinstance(seen, InvalidArgument)
    assert seen.reason == "INVALID_FIELD" and seen.request_id == "req-7"
    assert seen.field_violations == [("sampling.top_p", "must be in (0, 1], got 1.5")]


def test_a_retryable_error_carries_its_delay_and_no_field() -> None:
    err = ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED, "the waiting queue is full", reason="QUEUE_FULL",
                       retry_after_s=1.0)
    seen = from_rpc_error(_CallError(err, None))
    assert isinstance(seen, ResourceExhausted)
    assert (seen.reason, seen.retry_after, seen.field_violations, seen.request_id) == ("QUEUE_FULL", 1.0, [], None)
    assert [key for key, _ in err.trailing_metadata(None)] == ["grpc-status-details-bin"]


def test_a_reason_is_sent_only_with_its_documented_code() -> None:
    assert {code for code, _ in REASONS.values()} >= {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNAVAILABLE}
    with pytest.raises(AssertionError, match="QUEUE_FULL is documented with RESOURCE_EXHAUSTED"):
        ServiceError(grpc.StatusCode.UNAVAILABLE, "full", reason="QUEUE_FULL")
