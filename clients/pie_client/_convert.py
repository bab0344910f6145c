"""Protobuf at the boundary: keyword arguments -> request messages, responses -> dataclasses."""

from __future__ import annotations

import functools
import json
import struct
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from google.protobuf.descriptor import FieldDescriptor

from pie.v1 import generate_pb2 as pb

from .types import (
    Choice,
    Completion,
    Delta,
    ModelInfo,
    ModelLoad,
    PromptLogprob,
    SpeculativeDecoding,
    Tokenization,
    TokenLogprob,
    TopLogprob,
    Usage,
)

# Every SamplingParams field is a keyword of generate/stream, under the same name.
SAMPLING_FIELDS: frozenset[str] = frozenset(f.name for f in pb.SamplingParams.DESCRIPTOR.fields)
# Map fields (logit_bias): name -> (key type, value type).
_MAP_FIELDS: dict[str, tuple[int, int]] = {
    f.name: (f.message_type.fields_by_name["key"].type, f.message_type.fields_by_name["value"].type)
    for f in pb.SamplingParams.DESCRIPTOR.fields
    if f.message_type is not None and f.message_type.GetOptions().map_entry
}
_REPEATED_FIELDS = frozenset(
    f.name for f in pb.SamplingParams.DESCRIPTOR.fields if f.is_repeated and f.name not in _MAP_FIELDS
)
# Fields that take a message: built by their own converter (`structured`).
_MESSAGE_FIELDS = frozenset(
    f.name for f in pb.SamplingParams.DESCRIPTOR.fields if f.type == FieldDescriptor.TYPE_MESSAGE
)
# The kinds of a structured output (StructuredOutput's oneof), each a keyword of `structured`.
STRUCTURED_KINDS: tuple[str, ...] = tuple(f.name for f in pb.StructuredOutput.DESCRIPTOR.oneofs_by_name["kind"].fields)
_FIELD_TYPES: dict[str, int] = {f.name: f.type for f in pb.SamplingParams.DESCRIPTOR.fields}
_UINT_MAX = {FieldDescriptor.TYPE_UINT32: 2**32 - 1, FieldDescriptor.TYPE_UINT64: 2**64 - 1}

# Fields whose 0 is not 0: proto3 sends 0 as "unset", which the server reads as the default named
# here (generate.proto says so), so 0 is refused rather than silently becoming it.
ZERO_MEANS_DEFAULT: dict[str, str] = {"max_tokens": "the server's default, 16", "n": "the default, 1"}


def _uint_problem(value: int, hi: int, zero_means: str | None) -> str | None:
    lo = 0 if zero_means is None else 1
    if value < lo:
        hint = "" if zero_means is None else f" (leave it out for {zero_means})"
        return f"must be >= {lo}, got {value}{hint}"
    if value > hi:
        return f"must be <= {hi}, got {value}"
    return None


def structured_output(value: Any) -> pb.StructuredOutput:
    """The `structured=` argument as a StructuredOutput: a pb.StructuredOutput as it is, or a dict
    of one kind: {"json_schema": schema (a dict, or its JSON text)}, {"regex": "..."},
    {"choice": ["yes", "no"]}, {"grammar": "<Lark grammar>"} or {"json_object": True}."""
    if isinstance(value, pb.StructuredOutput):
        return value
    if not isinstance(value, Mapping) or len(value) != 1:
        raise TypeError(f"structured: expected a dict with one of {', '.join(STRUCTURED_KINDS)}, got {value!r}")
    (kind, item), = value.items()
    if kind == "json_schema":
        text = item if isinstance(item, str) else json.dumps(item)
        return pb.StructuredOutput(json_schema=text)
    if kind in ("regex", "grammar"):
        if not isinstance(item, str):
            raise TypeError(f"structured.{kind}: expected a str, got {type(item).__name__}")
        return pb.StructuredOutput(regex=item) if kind == "regex" else pb.StructuredOutput(grammar=item)
    if kind == "choice":
        choices = [item] if isinstance(item, str) else list(item)
        if not all(isinstance(c, str) for c in choices):
            raise TypeError("structured.choice: expected a list of str")
        return pb.StructuredOutput(choice=pb.ChoiceList(choices=choices))
    if kind == "json_object":
        return pb.StructuredOutput(json_object=bool(item))
    raise TypeError(f"structured: unknown kind {kind!r}; one of {', '.join(STRUCTURED_KINDS)}")


def chat_input(messages: Sequence[Mapping[str, Any]], *, tools: Sequence[Any] | str | None = None,
               add_generation_prompt: bool | None = None, continue_final_message: bool = False,
               template_kwargs: Mapping[str, Any] | None = None) -> pb.ChatInput:
    """A ChatInput from messages as dicts: "role", and optionally "content", "name",
    "tool_call_id", "reasoning_content" and "tool_calls" (a list, sent as JSON; or its JSON text); `tools`: tool
    definitions (dicts, sent as a JSON array, or its JSON text); `template_kwargs`: further template
    variables. A key whose value is None is left out."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise TypeError(f"messages: expected a list of dicts, got {type(messages).__name__}")
    chat = pb.ChatInput(continue_final_message=continue_final_message)
    known = {"role", "content", "name", "tool_call_id", "tool_calls", "reasoning_content"}
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise TypeError(f"messages[{i}]: expected a dict, got {type(message).__name__}")
        unknown = sorted(set(message) - known)
        if unknown:
            raise TypeError(f"messages[{i}]: unknown key(s) {', '.join(unknown)}; expected some of {', '.join(sorted(known))}")
        m = chat.messages.add(role=message.get("role") or "")
        for key in ("content", "name", "tool_call_id", "reasoning_content"):
            if message.get(key) is not None:
                setattr(m, key, message[key])
        calls = message.get("tool_calls")
        if calls is not None:
            m.tool_calls_json = calls if isinstance(calls, str) else json.dumps(calls)
    if tools is not None:
        chat.tools_json = tools if isinstance(tools, str) else json.dumps(list(tools))
    if add_generation_prompt is not None:
        chat.add_generation_prompt = add_generation_prompt
    if template_kwargs:
        chat.template_kwargs_json = json.dumps(dict(template_kwargs))
    return chat


def value_problem(name: str, value: Any) -> str | None:
    """Why SamplingParams field `name` cannot carry `value` as meant, or None when it can.

    Only what the wire format itself cannot say is caught here: a negative or too large value of an
    unsigned field, a 0 that the server would read as its default, a float beyond float32's range
    (it would arrive as infinity). Ranges the wire can carry (temperature < 0, top_p > 1, ...)
    are the server's to check; it names the field in its INVALID_ARGUMENT answer. For a repeated
    field, `value` is one of its items. Values of a wrong type are left to protobuf.
    """
    return _scalar_problem(_FIELD_TYPES[name], value, ZERO_MEANS_DEFAULT.get(name))


def _scalar_problem(kind: int, value: Any, zero_means: str | None = None) -> str | None:
    """`value_problem` for one scalar of protobuf type `kind` (a field, a map key or a map value)."""
    if kind in _UINT_MAX and isinstance(value, int) and not isinstance(value, bool):
        return _uint_problem(value, _UINT_MAX[kind], zero_means)
    if kind == FieldDescriptor.TYPE_FLOAT and isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            struct.pack("<f", value)
        except OverflowError:
            return f"must fit a 32-bit float (magnitude below 3.4e38), got {value}"
    return None


def map_problem(name: str, key: Any, value: Any) -> str | None:
    """`value_problem` for one entry of map field `name` (logit_bias: a token id and its bias), as a
    message naming the entry ("logit_bias[5]: must fit a 32-bit float ..."), or None."""
    key_kind, value_kind = _MAP_FIELDS[name]
    problem = _scalar_problem(key_kind, key)
    if problem:
        return f"{name}: key {key!r} {problem}"
    problem = _scalar_problem(value_kind, value)
    return f"{name}[{key!r}]: {problem}" if problem else None


def token_id_problem(token_id: int) -> str | None:
    """Why `token_id` cannot be sent as a uint32 token id (a prompt's), or None."""
    return _uint_problem(token_id, _UINT_MAX[FieldDescriptor.TYPE_UINT32], None)


def _put(name: str, value: Any, put: Callable[[Any], Any]) -> None:
    """put(value), with protobuf's complaint about the value prefixed by the field's name."""
    try:
        put(value)
    except (TypeError, ValueError) as error:
        raise type(error)(f"{name}: cannot be {value!r} ({error})") from None


def _items(name: str, value: Any) -> list[Any]:
    """The items of a repeated field's value; one stop string or one stop token id is a list of one."""
    if isinstance(value, (str, int)):
        return [value]
    try:
        return list(value)
    except TypeError:
        raise TypeError(f"{name}: expected a list, got {type(value).__name__}") from None


RequestT = TypeVar("RequestT", pb.GenerateRequest, pb.GenerateStreamRequest)


def sampling_params(sampling: Mapping[str, Any]) -> pb.SamplingParams:
    """Build SamplingParams from keyword arguments; None leaves a field unset (its default).

    Raises TypeError for a name that is not a SamplingParams field or a value of the wrong type,
    and ValueError for a value the request cannot carry (see `value_problem`); either message
    starts with the field's name ("max_tokens: must be >= 1, got 0 ...").
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
        if name in _MAP_FIELDS:
            if not isinstance(value, Mapping):
                raise TypeError(f"{name}: expected a mapping (token id -> bias), got {type(value).__name__}")
            for key, item in value.items():
                problem = map_problem(name, key, item)
                if problem:
                    raise ValueError(problem)
            _put(name, dict(value), getattr(params, name).update)
        elif name in _MESSAGE_FIELDS:
            getattr(params, name).CopyFrom(structured_output(value))
        elif name in _REPEATED_FIELDS:
            items = _items(name, value)
            for i, item in enumerate(items):
                problem = value_problem(name, item)
                if problem:
                    raise ValueError(f"{name}[{i}]: {problem}")
            _put(name, items, getattr(params, name).extend)
        else:
            problem = value_problem(name, value)
            if problem:
                raise ValueError(f"{name}: {problem}")
            _put(name, value, functools.partial(setattr, params, name))
    return params


def build_request(
    cls: type[RequestT], prompt: str | Sequence[int] | pb.ChatInput, request_id: str | None,
    sampling: Mapping[str, Any], priority: int = 0, adapter: str | None = None,
) -> RequestT:
    """A GenerateRequest or GenerateStreamRequest for a text prompt, a list of token ids or a chat,
    on a LoRA adapter by name (None: the base model)."""
    if isinstance(priority, bool) or not isinstance(priority, int) or not -2**31 <= priority < 2**31:
        raise ValueError(f"priority: must be an int32, got {priority!r}")
    request = cls(sampling=sampling_params(sampling), request_id=request_id or "", priority=priority,
                  adapter=adapter or "")
    if isinstance(prompt, pb.ChatInput):
        request.chat.CopyFrom(prompt)
    elif isinstance(prompt, str):
        request.prompt = prompt
    elif isinstance(prompt, Sequence) and not isinstance(prompt, (bytes, bytearray)) and all(
        isinstance(t, int) for t in prompt
    ):
        ids = [int(t) for t in prompt]
        for i, token_id in enumerate(ids):
            problem = token_id_problem(token_id)
            if problem:
                raise ValueError(f"prompt_token_ids[{i}]: {problem}")
        request.prompt_token_ids.ids.extend(ids)
        request.prompt_token_ids.SetInParent()  # set even when empty, so the server can say why
    else:
        raise TypeError(f"prompt must be a str or a sequence of token ids, not {type(prompt).__name__}")
    return request


def detokenize_request(token_ids: Sequence[int], skip_special_tokens: bool) -> pb.DetokenizeRequest:
    """A DetokenizeRequest; a token id that is not a uint32 is refused here, naming its index."""
    if isinstance(token_ids, (str, bytes, bytearray)):
        raise TypeError(f"token_ids must be a sequence of ints, not {type(token_ids).__name__}")
    ids = list(token_ids)
    for i, token_id in enumerate(ids):
        if not isinstance(token_id, int) or isinstance(token_id, bool):
            raise TypeError(f"token_ids[{i}]: expected an int, got {type(token_id).__name__}")
        problem = token_id_problem(token_id)
        if problem:
            raise ValueError(f"token_ids[{i}]: {problem}")
    return pb.DetokenizeRequest(token_ids=ids, skip_special_tokens=skip_special_tokens)


def abort_request(request_ids: str | Sequence[str]) -> pb.AbortRequest:
    """An AbortRequest for one request id or several."""
    ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
    for i, rid in enumerate(ids):
        if not isinstance(rid, str):
            raise TypeError(f"request_ids[{i}]: expected a str, got {type(rid).__name__}")
    return pb.AbortRequest(request_ids=ids)


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


def _prompt_logprobs(items: Sequence[pb.PromptLogprob]) -> list[PromptLogprob]:
    return [
        PromptLogprob(
            token_id=lp.token_id,
            token=lp.token,
            logprob=lp.logprob if lp.HasField("logprob") else None,
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
        prompt_logprobs=_prompt_logprobs(response.prompt_logprobs),
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
        prompt_logprobs=_prompt_logprobs(response.prompt_logprobs),
    )


def tokenization(response: pb.TokenizeResponse) -> Tokenization:
    return Tokenization(token_ids=list(response.token_ids), tokens=list(response.tokens),
                        rendered_text=response.rendered_text)


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
        logprobs_mode=response.logprobs_mode,
        load=ModelLoad(
            kv_blocks_total=load.kv_blocks_total,
            kv_blocks_free=load.kv_blocks_free,
            requests_running=load.requests_running,
            requests_waiting=load.requests_waiting,
            max_num_seqs=load.max_num_seqs,
            max_waiting=load.max_waiting,
            kv_blocks_cached=load.kv_blocks_cached,
            requests_waiting_by_priority=dict(load.requests_waiting_by_priority),
        ),
        speculative=_speculative(response.speculative) if response.HasField("speculative") else None,
    )


def _speculative(msg: pb.SpeculativeDecoding) -> SpeculativeDecoding:
    return SpeculativeDecoding(
        method=msg.method, num_speculative_tokens=msg.num_speculative_tokens, num_drafts=msg.num_drafts,
        num_draft_tokens=msg.num_draft_tokens, num_accepted_tokens=msg.num_accepted_tokens,
        acceptance_rate=msg.acceptance_rate, mean_acceptance_length=msg.mean_acceptance_length)
