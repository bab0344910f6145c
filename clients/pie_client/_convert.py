"""Protobuf at the boundary: keyword arguments -> request messages, responses -> dataclasses."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

from pie.v1 import generate_pb2 as pb

from .types import Choice, Completion, Delta, ModelInfo, ModelLoad, Tokenization, TokenLogprob, TopLogprob, Usage

# Every SamplingParams field is a keyword of generate/stream, under the same name.
SAMPLING_FIELDS: frozenset[str] = frozenset(f.name for f in pb.SamplingParams.DESCRIPTOR.fields)
_REPEATED_FIELDS = frozenset(
    f.name for f in pb.SamplingParams.DESCRIPTOR.fields if f.is_repeated
)

RequestT = TypeVar("RequestT", pb.GenerateRequest, pb.GenerateStreamRequest)


def sampling_params(sampling: Mapping[str, Any]) -> pb.SamplingParams:
    """Build SamplingParams from keyword arguments; None leaves a field unset (its default).

    Raises TypeError for a name that is not a SamplingParams field.
    """
    unknown = sorted(set(sampling) - SAMPLING_FIELDS)
    if unknown:
        raise TypeError(
            f"unknown sampling parameter(s) {', '.join(unknown)}; expected some of {', '.join(sorted(SAMPLING_FIELDS))}"
        )
    params = pb.SamplingParams()
    for name, value in sampling.items():
        if value is None:
            continue
        if name in _REPEATED_FIELDS:
            if isinstance(value, (str, int)):  # one stop string or one stop token id
                value = [value]
            getattr(params, name).extend(value)
        else:
            setattr(params, name, value)
    return params


def build_request(
    cls: type[RequestT], prompt: str | Sequence[int], request_id: str | None, sampling: Mapping[str, Any]
) -> RequestT:
    """A GenerateRequest or GenerateStreamRequest for a text prompt or a list of token ids."""
    request = cls(sampling=sampling_params(sampling), request_id=request_id or "")
    if isinstance(prompt, str):
        request.prompt = prompt
    elif isinstance(prompt, Sequence) and not isinstance(prompt, (bytes, bytearray)) and all(
        isinstance(t, int) for t in prompt
    ):
        request.prompt_token_ids.ids.extend(int(t) for t in prompt)
        request.prompt_token_ids.SetInParent()  # set even when empty, so the server can say why
    else:
        raise TypeError(f"prompt must be a str or a sequence of token ids, not {type(prompt).__name__}")
    return request


def finish_reason(value: int) -> str | None:
    """FINISH_REASON_STOP -> "stop"; UNSPECIFIED -> None; a value newer than these stubs -> its number."""
    if value == pb.FINISH_REASON_UNSPECIFIED:
        return None
    try:
        return pb.FinishReason.Name(value).removeprefix("FINISH_REASON_").lower()
    except ValueError:
        return str(value)


def _logprobs(items: Sequence[pb.TokenLogprob]) -> list[TokenLogprob]:
    return [
        TokenLogprob(
            token_id=lp.token_id,
            logprob=lp.logprob,
            token=lp.token,
            top_logprobs=[TopLogprob(t.token_id, t.logprob, t.token) for t in lp.top_logprobs],
        )
        for lp in items
    ]


def _choice(c: pb.Choice) -> Choice:
    return Choice(index=c.index, text=c.text, token_ids=list(c.token_ids), finish_reason=finish_reason(c.finish_reason),
                  stop_reason=c.stop_reason, logprobs=_logprobs(c.logprobs))


def completion(response: pb.GenerateResponse) -> Completion:
    return Completion(
        request_id=response.request_id,
        text=response.text,
        token_ids=list(response.token_ids),
        finish_reason=finish_reason(response.finish_reason),
        stop_reason=response.stop_reason,
        prompt_tokens=response.usage.prompt_tokens,
        completion_tokens=response.usage.completion_tokens,
        logprobs=_logprobs(response.logprobs),
        choices=[_choice(c) for c in response.choices],
        cached_prompt_tokens=response.usage.cached_prompt_tokens,
    )


def delta(response: pb.GenerateStreamResponse) -> Delta:
    usage = None
    if response.HasField("usage"):
        u = response.usage
        usage = Usage(u.prompt_tokens, u.completion_tokens, u.total_tokens, u.cached_prompt_tokens)
    return Delta(
        request_id=response.request_id,
        text=response.text,
        token_ids=list(response.token_ids),
        finish_reason=finish_reason(response.finish_reason),
        stop_reason=response.stop_reason,
        usage=usage,
        logprobs=_logprobs(response.logprobs),
        index=response.index,
    )


def tokenization(response: pb.TokenizeResponse) -> Tokenization:
    return Tokenization(token_ids=list(response.token_ids), tokens=list(response.tokens))


def model_info(response: pb.GetModelInfoResponse) -> ModelInfo:
    load = response.load
    return ModelInfo(
        model_name=response.model_name,
        architecture=response.architecture,
        model_type=response.model_type,
        max_model_len=response.max_model_len,
        vocab_size=response.vocab_size,
        eos_token_ids=list(response.eos_token_ids),
        bos_token_id=response.bos_token_id if response.HasField("bos_token_id") else None,
        kv_cache_dtype=response.kv_cache_dtype,
        block_size=response.block_size,
        device=response.device,
        dtype=response.dtype,
        load=ModelLoad(
            kv_blocks_total=load.kv_blocks_total,
            kv_blocks_free=load.kv_blocks_free,
            requests_running=load.requests_running,
            requests_waiting=load.requests_waiting,
            max_num_seqs=load.max_num_seqs,
            max_waiting=load.max_waiting,
        ),
    )
