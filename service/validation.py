"""Protobuf request -> engine inputs, with every problem named by its field.

Field paths are the protobuf field names (`sampling.top_p`, `prompt_token_ids`), so a caller using
grpcurl can find the field in the contract; every problem is a RequestError (engine/errors.py).
Range checks on sampling live in `engine.sampling_params.SamplingParams.validate`, under the
engine's names; `qualify` gives them their field paths.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from pie.engine.errors import RequestError
from pie.engine.sampling_params import MAX_LOGIT_BIAS, SamplingParams, StructuredOutputParams
from pie.model.chat_template import RESERVED_VARIABLES

DEFAULT_MAX_TOKENS = 16
MAX_ABORT_IDS = 1024  # request ids one Abort call may name


@dataclass(slots=True)
class ChatPrompt:
    """A ChatInput as plain Python, checked: what model.chat_template renders."""

    messages: list[dict[str, Any]]  # role, and content / name / tool_call_id / tool_calls / reasoning_content where set
    tools: list[Any] | None  # the parsed tools_json; None without tools
    add_generation_prompt: bool
    continue_final_message: bool
    extra: dict[str, Any] = field(default_factory=dict)  # the parsed template_kwargs_json
    chars: int = 0  # characters of text in it: long conversations are rendered off the event loop


# Largest role name: the template decides which roles it knows; this only bounds the field.
MAX_ROLE_CHARS = 64


@dataclass(slots=True)
class Limits:
    max_prompt_chars: int = 1_000_000  # text prompts longer than this are refused before tokenizing
    max_prompt_token_ids: int = 1_000_000  # same for token-id prompts (the context caps it further)


def sampling_from_proto(msg, *, max_model_len: int) -> SamplingParams:
    """`msg` is a pie.v1.SamplingParams (possibly unset: all defaults). Ranges, NaN and infinities
    are SamplingParams.validate's to check; its RequestErrors name the engine's fields (`top_p`),
    which admission names by their proto path once (`qualify`)."""
    if msg.max_tokens > max_model_len:
        raise RequestError("sampling.max_tokens", f"must be <= the context length {max_model_len}, got {msg.max_tokens}")
    if len(msg.logit_bias) > MAX_LOGIT_BIAS:  # before building a dict of them
        raise RequestError("sampling.logit_bias", f"at most {MAX_LOGIT_BIAS} entries, got {len(msg.logit_bias)}")
    return SamplingParams(
        max_tokens=msg.max_tokens or DEFAULT_MAX_TOKENS,
        temperature=msg.temperature,
        top_k=msg.top_k,
        top_p=msg.top_p if msg.HasField("top_p") else 1.0,
        min_p=msg.min_p,
        repetition_penalty=msg.repetition_penalty if msg.HasField("repetition_penalty") else 1.0,
        presence_penalty=msg.presence_penalty,
        frequency_penalty=msg.frequency_penalty,
        seed=msg.seed if msg.HasField("seed") else None,
        stop=list(msg.stop),
        stop_token_ids=list(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
        logprobs=msg.logprobs,
        skip_special_tokens=msg.skip_special_tokens if msg.HasField("skip_special_tokens") else True,
        n=msg.n or 1,
        prompt_logprobs=msg.prompt_logprobs if msg.HasField("prompt_logprobs") else None,
        logit_bias=dict(msg.logit_bias),
        min_tokens=msg.min_tokens,
        structured=structured_from_proto(msg.structured) if msg.HasField("structured") else None,
        disable_speculation=msg.disable_speculation,
    )


def structured_from_proto(msg) -> StructuredOutputParams | None:
    """`msg` is a pie.v1.StructuredOutput; None for `json_object: false` (the same as unset)."""
    kind = msg.WhichOneof("kind")
    if kind is None:
        raise RequestError("sampling.structured", "set one of json_schema, regex, choice, grammar or json_object")
    if kind == "choice":
        return StructuredOutputParams("choice", choices=tuple(msg.choice.choices))
    if kind == "json_object":
        return StructuredOutputParams("json_object") if msg.json_object else None
    return StructuredOutputParams(kind, getattr(msg, kind))


def qualify(field: str) -> str:
    """Engine field names are sampling field names unless they are prompt fields."""
    if field in ("prompt", "prompt_token_ids", "request_id") or field.startswith(("chat", "sampling.")):
        return field  # (prompt_logprobs is a sampling field: a prefix test would take it for a prompt field)
    return f"sampling.{field}"


def _json(field: str, text: str, kind: type, what: str) -> Any:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise RequestError(field, f"is not JSON ({e})") from None
    if not isinstance(value, kind):
        raise RequestError(field, f"must be {what}, got JSON {type(value).__name__}")
    return value


def chat_from_proto(chat, limits: Limits, field: str = "chat") -> ChatPrompt:
    """`chat` is a pie.v1.ChatInput: its messages as dicts of the fields set, JSON fields parsed,
    each problem named by its field (`chat.messages[2].role`)."""
    if not chat.messages:
        raise RequestError(f"{field}.messages", "must hold at least one message")
    messages: list[dict[str, Any]] = []
    chars = len(chat.tools_json) + len(chat.template_kwargs_json)
    for i, m in enumerate(chat.messages):
        where = f"{field}.messages[{i}]"
        if not m.role:
            raise RequestError(f"{where}.role", "must not be empty")
        if len(m.role) > MAX_ROLE_CHARS:
            raise RequestError(f"{where}.role", f"is longer than {MAX_ROLE_CHARS} characters")
        message: dict[str, Any] = {"role": m.role}
        for name in ("content", "name", "tool_call_id", "reasoning_content"):
            if m.HasField(name):
                message[name] = getattr(m, name)
                chars += len(message[name])
        if m.HasField("tool_calls_json"):
            message["tool_calls"] = _json(f"{where}.tool_calls_json", m.tool_calls_json, list, "a JSON array")
            chars += len(m.tool_calls_json)
        messages.append(message)
    if chars > limits.max_prompt_chars:
        raise RequestError(field, f"is longer than {limits.max_prompt_chars} characters")
    tools = _json(f"{field}.tools_json", chat.tools_json, list, "a JSON array") if chat.tools_json else None
    extra = (_json(f"{field}.template_kwargs_json", chat.template_kwargs_json, dict, "a JSON object")
             if chat.template_kwargs_json else {})
    reserved = sorted(RESERVED_VARIABLES & set(extra))
    if reserved:
        raise RequestError(f"{field}.template_kwargs_json", f"may not set {', '.join(reserved)} (the request's own fields)")
    continue_final = chat.continue_final_message
    if chat.HasField("add_generation_prompt"):
        add_prompt = chat.add_generation_prompt
        if add_prompt and continue_final:
            raise RequestError(f"{field}.add_generation_prompt", "cannot be true with continue_final_message")
    else:
        add_prompt = not continue_final
    return ChatPrompt(messages, tools, add_prompt, continue_final, extra, chars)


def prompt_from_proto(request, limits: Limits) -> str | list[int] | ChatPrompt:
    """The request's prompt as given: text (to be tokenized with the model's special tokens),
    token ids, or a chat (to be rendered with the model's template). Checks what needs no
    tokenizer; rendering and tokenizing are the caller's, off the event loop when long."""
    which = request.WhichOneof("prompt_input")
    if which is None:
        raise RequestError("prompt", "set one of prompt (text), prompt_token_ids or chat")
    if which == "chat":
        return chat_from_proto(request.chat, limits)
    if which == "prompt":
        if not request.prompt:
            raise RequestError("prompt", "must not be empty")
        if len(request.prompt) > limits.max_prompt_chars:
            raise RequestError("prompt", f"is longer than {limits.max_prompt_chars} characters")
        return request.prompt
    ids = list(request.prompt_token_ids.ids)
    if not ids:
        raise RequestError("prompt_token_ids", "must not be empty")
    if len(ids) > limits.max_prompt_token_ids:
        raise RequestError("prompt_token_ids", f"has more than {limits.max_prompt_token_ids} ids")
    return ids


def request_id_from(request, metadata: dict[str, str], make_id) -> str:
    rid = request.request_id or metadata.get("x-request-id", "")
    if not rid:
        return make_id()
    if not valid_request_id(rid):
        raise RequestError("request_id", "must be at most 128 printable ASCII characters")
    return rid


def valid_request_id(rid: str) -> bool:
    """A request id that can travel back in metadata and headers (ASCII only)."""
    return len(rid) <= 128 and rid.isascii() and rid.isprintable()  # it travels in metadata: ASCII only


def abort_ids_from_proto(request) -> list[str]:
    """The request ids of a pie.v1.AbortRequest, each one a request id a caller could have given."""
    ids = list(request.request_ids)
    if not ids:
        raise RequestError("request_ids", "name at least one request id")
    if len(ids) > MAX_ABORT_IDS:
        raise RequestError("request_ids", f"at most {MAX_ABORT_IDS} ids, got {len(ids)}")
    for i, rid in enumerate(ids):
        if not rid or not valid_request_id(rid):
            raise RequestError("request_ids", f"id {i} must be 1 to 128 printable ASCII characters, got {rid!r:.60}")
    return ids


def detokenize_ids_from_proto(request, limits: Limits, *, vocab_size: int) -> list[int]:
    """The token ids of a pie.v1.DetokenizeRequest, each in the vocabulary."""
    ids = list(request.token_ids)
    if len(ids) > limits.max_prompt_token_ids:
        raise RequestError("token_ids", f"has more than {limits.max_prompt_token_ids} ids")
    if ids and max(ids) >= vocab_size:
        bad = next(i for i, t in enumerate(ids) if t >= vocab_size)
        raise RequestError("token_ids", f"id {ids[bad]} (at {bad}) is outside the vocabulary [0, {vocab_size})")
    return ids
