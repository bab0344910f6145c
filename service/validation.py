"""Protobuf request -> engine inputs, with every problem named by its field.

Field paths are the protobuf field names (`sampling.top_p`, `prompt_token_ids`), so a caller using
grpcurl can find the field in the contract. Range checks on sampling live in
`engine.sampling_params.SamplingParams.validate`; this module maps them to field paths.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.sampling_params import SamplingParams, SamplingParamsError

DEFAULT_MAX_TOKENS = 16


class FieldError(ValueError):
    """One bad field; becomes INVALID_ARGUMENT with a google.rpc.BadRequest field violation."""

    def __init__(self, field: str, description: str):
        super().__init__(f"{field}: {description}")
        self.field = field
        self.description = description


@dataclass(slots=True)
class Limits:
    max_prompt_chars: int = 1_000_000  # text prompts longer than this are refused before tokenizing
    max_prompt_token_ids: int = 1_000_000  # same for token-id prompts (the context caps it further)


def sampling_from_proto(msg, *, max_model_len: int) -> SamplingParams:
    """`msg` is a pie.v1.SamplingParams (possibly unset: all defaults). Ranges, NaN and infinities
    are SamplingParams.validate's to check; its errors come back here named by their proto field."""
    if msg.max_tokens > max_model_len:
        raise FieldError("sampling.max_tokens", f"must be <= the context length {max_model_len}, got {msg.max_tokens}")
    try:
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
        )
    except SamplingParamsError as e:
        raise FieldError(qualify(e.field), e.message) from e


def qualify(field: str) -> str:
    """Engine field names are sampling field names unless they are prompt fields."""
    if field.startswith(("prompt", "sampling.", "request_id")):
        return field
    return f"sampling.{field}"


def prompt_from_proto(request, limits: Limits) -> str | list[int]:
    """The request's prompt as given: text (to be tokenized with the model's special tokens) or
    token ids. Checks what needs no tokenizer; tokenizing is the caller's, off the event loop
    when the text is long."""
    which = request.WhichOneof("prompt_input")
    if which is None:
        raise FieldError("prompt", "set either prompt (text) or prompt_token_ids")
    if which == "prompt":
        if not request.prompt:
            raise FieldError("prompt", "must not be empty")
        if len(request.prompt) > limits.max_prompt_chars:
            raise FieldError("prompt", f"is longer than {limits.max_prompt_chars} characters")
        return request.prompt
    ids = list(request.prompt_token_ids.ids)
    if not ids:
        raise FieldError("prompt_token_ids", "must not be empty")
    if len(ids) > limits.max_prompt_token_ids:
        raise FieldError("prompt_token_ids", f"has more than {limits.max_prompt_token_ids} ids")
    return ids


def request_id_from(request, metadata: dict[str, str], make_id) -> str:
    rid = request.request_id or metadata.get("x-request-id", "")
    if not rid:
        return make_id()
    if len(rid) > 128 or not (rid.isascii() and rid.isprintable()):  # it travels in metadata: ASCII only
        raise FieldError("request_id", "must be at most 128 printable ASCII characters")
    return rid
