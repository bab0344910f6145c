"""OpenAI's Completions and Chat Completions requests, read into the contract's own request
(pie.v1.GenerateStreamRequest) so that the HTTP door validates, prepares and admits exactly as
the gRPC door does (GenerateServicer.admit). No network hop: the message is built and read in
this process.

Beside OpenAI's fields both take vLLM's sampling extensions (top_k, min_p, repetition_penalty,
min_tokens, ignore_eos, stop_token_ids, skip_special_tokens, priority) and its structured-output
fields (guided_json, guided_regex, guided_choice, guided_grammar); `response_format` (json_object,
json_schema) is read by both. Unknown fields are ignored, as OpenAI's newer fields are by older
servers. What pie refuses, a field the contract names (`sampling.top_p`), is reported under the
OpenAI parameter it came from (service/http/errors.py `param_of`).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pie.engine.errors import RequestError
from pie.v1 import generate_pb2 as pb

from .tools import ForcedCall, forced_call


class StreamOptions(BaseModel):
    include_usage: bool = False


class LoadLoraRequest(BaseModel):
    """POST /v1/load_lora_adapter (vLLM's body): a PEFT folder on the server's machine."""

    lora_name: str
    lora_path: str


class UnloadLoraRequest(BaseModel):
    """POST /v1/unload_lora_adapter."""

    lora_name: str


class JsonSchema(BaseModel):
    model_config = ConfigDict(populate_by_name=True)
    name: str = "output"
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None


class Sampling(BaseModel):
    """The fields both endpoints share."""

    model: str | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    response_format: ResponseFormat | None = None
    # vLLM's extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    priority: int = 0
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    request_id: str | None = None


class CompletionRequest(Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None  # top logprobs per token (OpenAI allows 0..5; pie up to 20)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


# The roles OpenAI's Chat Completions define (the gRPC contract leaves roles to the model's template).
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    reasoning_content: str | None = None


class ChatRequest(Sampling):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    add_generation_prompt: bool | None = None
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


def _uint(param: str, value: int) -> int:
    if value < 0:
        raise RequestError(param, f"must be >= 0, got {value}")
    return value


def _sampling(body: Sampling, max_tokens: int | None, logprobs: int) -> pb.SamplingParams:
    s = pb.SamplingParams(n=_uint("n", body.n), min_tokens=_uint("min_tokens", body.min_tokens),
                          ignore_eos=body.ignore_eos, skip_special_tokens=body.skip_special_tokens,
                          presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
                          logprobs=logprobs)
    if body.n == 0:
        raise RequestError("n", "must be >= 1")
    if max_tokens is not None:
        if max_tokens < 1:
            raise RequestError("max_tokens", f"must be >= 1, got {max_tokens}")
        s.max_tokens = max_tokens
    s.temperature = 1.0 if body.temperature is None else body.temperature  # OpenAI's default: sampled
    for name in ("top_p", "repetition_penalty"):
        if (value := getattr(body, name)) is not None:
            setattr(s, name, value)
    if body.top_k is not None:
        s.top_k = 0 if body.top_k == -1 else _uint("top_k", body.top_k)  # vLLM's -1: off
    if body.min_p is not None:
        s.min_p = body.min_p
    if body.seed is not None:
        s.seed = _uint("seed", body.seed)
    if body.stop is not None:
        s.stop.extend([body.stop] if isinstance(body.stop, str) else body.stop)
    if body.stop_token_ids:
        s.stop_token_ids.extend(_uint("stop_token_ids", t) for t in body.stop_token_ids)
    for key, bias in (body.logit_bias or {}).items():
        if not key.isdigit():
            raise RequestError("logit_bias", f"keys are token ids, got {key!r}")
        s.logit_bias[int(key)] = bias
    _structured(body, s.structured)
    return s


def structured_kinds(body: Sampling) -> list[str]:
    """The parameters of `body` that ask for a structured output, in the order they are read."""
    fmt = body.response_format
    kinds = ["response_format"] if fmt is not None and fmt.type != "text" else []
    return kinds + [k for k in ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
                    if getattr(body, k) is not None]


def _structured(body: Sampling, out: pb.StructuredOutput) -> None:
    """response_format or one guided_* field into the contract's StructuredOutput (at most one)."""
    kinds = structured_kinds(body)
    fmt = body.response_format
    if fmt is not None and fmt.type == "json_object":
        out.json_object = True
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.json_schema is None:
            raise RequestError("response_format.json_schema.schema", "is required with type json_schema")
        out.json_schema = json.dumps(fmt.json_schema.json_schema)
    if body.guided_json is not None:
        out.json_schema = body.guided_json if isinstance(body.guided_json, str) else json.dumps(body.guided_json)
    if body.guided_regex is not None:
        out.regex = body.guided_regex
    if body.guided_choice is not None:
        out.choice.choices.extend(body.guided_choice)
    if body.guided_grammar is not None:
        out.grammar = body.guided_grammar
    if len(kinds) > 1:
        raise RequestError(kinds[1], f"cannot be given with {kinds[0]}: one structured output per request")


def completion_requests(body: CompletionRequest) -> list[pb.GenerateStreamRequest]:
    """One request per prompt (OpenAI's `prompt` may be a list of them)."""
    if body.suffix:
        raise RequestError("suffix", "is not supported")
    if body.best_of is not None and body.best_of != body.n:
        raise RequestError("best_of", "must equal n when given (pie returns every sample it draws)")
    if body.max_tokens == 0 and not body.echo:
        raise RequestError("max_tokens", "must be >= 1 (0, scoring the prompt alone, needs echo)")
    scored = body.echo and body.logprobs is not None  # the prompt's tokens get logprobs too
    if body.stream and (scored or body.max_tokens == 0):
        raise RequestError("stream", "echo with logprobs, and max_tokens 0, are answered whole (stream: false)")
    prompts: list[str | list[int]]
    if isinstance(body.prompt, str) or (body.prompt and isinstance(body.prompt[0], int)):
        prompts = [body.prompt]
    else:
        prompts = list(body.prompt)  # type: ignore[arg-type]
    if not prompts:
        raise RequestError("prompt", "must not be empty")
    # max_tokens 0: one token is made (the engine makes at least one) and left out of the answer
    sampling = _sampling(body, 1 if body.max_tokens == 0 else body.max_tokens, _uint("logprobs", body.logprobs or 0))
    if body.logprobs == 0:
        sampling.logprobs = 1  # OpenAI's logprobs: 0 still reports each token's own logprob
    if scored:
        sampling.prompt_logprobs = sampling.logprobs
    requests = []
    for p in prompts:
        r = pb.GenerateStreamRequest(sampling=sampling, priority=body.priority)
        if isinstance(p, str):
            r.prompt = p
        else:
            r.prompt_token_ids.ids.extend(_uint("prompt", t) for t in p)
        requests.append(r)
    return requests


def chat_request(body: ChatRequest) -> tuple[pb.GenerateStreamRequest, ForcedCall | None]:
    """The contract's request of a chat, and the tool call its tool_choice forces (service/http/tools.py)."""
    if body.max_tokens is not None and body.max_completion_tokens is not None:
        raise RequestError("max_completion_tokens", "cannot be given with max_tokens")
    if body.top_logprobs is not None and not body.logprobs:
        raise RequestError("top_logprobs", "needs logprobs: true")
    logprobs = (body.top_logprobs or 0) if body.logprobs else 0
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    sampling = _sampling(body, max_tokens, logprobs)
    # OpenAI reports the chosen token's logprob even with top_logprobs 0: one alternative is asked
    # for, the token itself.
    if body.logprobs and not logprobs:
        sampling.logprobs = 1
    chat = pb.ChatInput(continue_final_message=body.continue_final_message)
    if body.add_generation_prompt is not None:
        chat.add_generation_prompt = body.add_generation_prompt
    for i, m in enumerate(body.messages):
        if m.role not in CHAT_ROLES:
            raise RequestError(f"messages[{i}].role", f"must be one of {', '.join(CHAT_ROLES)}, got {m.role!r:.40}")
        msg = pb.ChatMessage(role=m.role)
        if m.content is not None:
            msg.content = m.content if isinstance(m.content, str) else _text_parts(f"messages[{i}].content", m.content)
        for name in ("name", "tool_call_id", "reasoning_content"):
            if (value := getattr(m, name)) is not None:
                setattr(msg, name, value)
        if m.tool_calls is not None:
            msg.tool_calls_json = json.dumps(m.tool_calls)
        chat.messages.append(msg)
    forced = forced_call(body.tools, body.tool_choice, body.parallel_tool_calls)
    if forced is not None:
        if sampling.HasField("structured"):
            raise RequestError("tool_choice", "forces a tool call, which cannot be given with response_format or "
                                            "guided_* (one structured output per request)")
        sampling.structured.json_schema = json.dumps(forced[1])
    tools = body.tools
    if body.tool_choice == "none":
        tools = None  # the model is told of no tools
    if tools is not None:
        chat.tools_json = json.dumps(tools)
    if body.chat_template_kwargs:
        chat.template_kwargs_json = json.dumps(body.chat_template_kwargs)
    return (pb.GenerateStreamRequest(chat=chat, sampling=sampling, priority=body.priority),
            None if forced is None else forced[0])


def _text_parts(param: str, parts: list[dict[str, Any]]) -> str:
    """OpenAI's content parts, text only: joined in order."""
    texts = []
    for j, part in enumerate(parts):
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise RequestError(f"{param}[{j}]", "only text parts ({\"type\": \"text\", \"text\": ...}) are supported")
        texts.append(part["text"])
    return "".join(texts)
