"""The HTTP door's one mapping of a refusal: every non-2xx body is an OpenAI error object
{"error": {"message", "type", "param", "code"}}, with the HTTP status a gRPC caller's code maps to.

A RequestError (service/admission.py's refusals, the body's own checks) is a 400 whose `param`
is the OpenAI parameter the contract field came from (service/http/requests.py `param_of`); a
ServiceError keeps its reason as the `code` (lower case, OpenAI's names where OpenAI has one); an
HttpError is a refusal only this door has (an API key, another model's name, an unknown route).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import grpc

from pie.engine.errors import RequestError

from ..errors import ServiceError
from .requests import Sampling, structured_kinds

# gRPC status -> (HTTP status, OpenAI error type)
_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.NOT_FOUND: (404, "invalid_request_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.CANCELLED: (499, "invalid_request_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "server_error"),
    grpc.StatusCode.INTERNAL: (500, "server_error"),
}
_CODES = {"PROMPT_TOO_LONG": "context_length_exceeded", "QUEUE_FULL": "rate_limit_exceeded",
          "INVALID_FIELD": "invalid_field"}


class HttpError(Exception):
    """An OpenAI error object and its HTTP status (with Retry-After where the caller may retry).
    `grpc_code`: the status a gRPC caller would get, which the summary line and
    pie_requests_finished count it by."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, retry_after_s: float | None = None,
                 grpc_code: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT) -> None:
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param: str | None = param
        self.code: str | None = code
        self.retry_after_s = retry_after_s
        self.grpc_code = grpc_code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def headers(self) -> dict[str, str]:
        return {} if self.retry_after_s is None else {"Retry-After": str(max(1, round(self.retry_after_s)))}


def http_error(err: RequestError | ServiceError | HttpError, params: Params) -> HttpError:
    """`err` as this door answers it; contract fields named as the caller sent them (`params`)."""
    if isinstance(err, HttpError):
        return err
    if isinstance(err, RequestError):
        name = param_of(err.field, params)
        return HttpError(400, f"{name}: {err.message}", param=name, code=_CODES.get(err.reason, err.reason.lower()))
    status, type_ = _STATUS.get(err.code, (500, "server_error"))
    param = None if err.field is None else param_of(err.field, params)
    message = err.message if param is None else f"{param}: {err.description}"
    return HttpError(status, message, type=type_, param=param, code=_CODES.get(err.reason, err.reason.lower()),
                     retry_after_s=err.retry_after_s, grpc_code=err.code)


def not_found(what: str, code: str = "not_found") -> HttpError:
    return HttpError(404, what, code=code, grpc_code=grpc.StatusCode.NOT_FOUND)


@dataclass(frozen=True, slots=True)
class Params:
    """How one request's OpenAI parameters are named, for refusals of the contract's fields."""

    chat: bool  # /v1/chat/completions (its length limit is max_completion_tokens, its logprobs top_logprobs)
    structured: str = "response_format"  # the parameter its structured output came from (guided_regex, tools, ...)
    max_tokens: str = "max_tokens"  # the length limit's name as the caller sent it


def params_of(body: Sampling, *, chat: bool, forced: bool = False) -> Params:
    """The names of `body`'s parameters (`forced`: tool_choice forces a call, whose schema is the
    structured output: `tools`)."""
    kinds = structured_kinds(body)
    structured = "tools" if forced else (kinds[0] if kinds else "response_format")
    max_tokens = "max_tokens"
    if chat and getattr(body, "max_completion_tokens", None) is not None:
        max_tokens = "max_completion_tokens"
    return Params(chat, structured, max_tokens)


def param_of(field: str, params: Params) -> str:
    """The OpenAI parameter a contract field came from: sampling.top_p -> top_p,
    chat.messages[2].role -> messages[2].role, sampling.structured.regex -> guided_regex (or
    response_format, as the request gave it)."""
    if field.startswith("sampling.structured"):
        return params.structured
    for prefix, to in (("sampling.", ""), ("chat.messages", "messages"), ("chat.tools_json", "tools"),
                       ("chat.template_kwargs_json", "chat_template_kwargs"), ("chat.", ""),
                       ("prompt_token_ids", "prompt")):
        if field.startswith(prefix):
            field = to + field[len(prefix):]
            break
    if field in ("chat", "adapter", "name", "path"):  # (the LoRA fields: the request's or vLLM's words)
        return {"chat": "messages", "adapter": "model", "name": "lora_name", "path": "lora_path"}[field]
    if field == "max_tokens":
        return params.max_tokens
    if field == "logprobs" and params.chat:
        return "top_logprobs"
    return field


def body_problem(errors: list[dict[str, Any]]) -> tuple[str | None, str]:
    """(param, message) for the first of pydantic's errors about a request body, in the words of
    pie's own refusals: `messages[0].content`, not pydantic's `body.messages.0.content.str`. A
    field of several forms (`prompt`: a text, token ids, or a list of either) that matches none
    is named once, with its forms, instead of by the first form's complaint; a body that is not
    JSON, or not an object, is said so (param null, as OpenAI's errors about the body)."""
    if not errors:
        return None, "the body is not a valid request"
    first = errors[0]
    loc = list(first["loc"][1:] if first["loc"][:1] == ("body",) else first["loc"])
    if first["type"] == "json_invalid":
        where = f" at character {loc[0]}" if loc and isinstance(loc[0], int) else ""
        return None, f"the body is not valid JSON ({first.get('ctx', {}).get('error', first['msg'])}{where})"
    if not loc:
        return None, "the body must be a JSON object (the request's fields)"
    # pydantic names a union's member after the field (`prompt`, `list[int]`, 0): a name with
    # brackets or a bare type is a member, not a field of ours
    forms = next((i for i, p in enumerate(loc) if isinstance(p, str) and ("[" in p or p in _TYPE_NAMES)), None)
    if forms is None:
        param = _dotted(loc)
        words = str(first["msg"]).replace("Input should be", "must be").replace("Field required", "is required")
        return param, f"{param}: {words}"
    field = loc[:forms]
    tried = []
    for e in errors:
        other = list(e["loc"][1:] if e["loc"][:1] == ("body",) else e["loc"])
        if other[:forms] == field and len(other) > forms and other[forms] not in tried:
            tried.append(other[forms])
    param = _dotted(field)
    return param, f"{param}: matches none of its forms ({', '.join(map(str, tried))})"


_TYPE_NAMES = frozenset({"str", "int", "float", "bool", "none", "list", "dict"})


def _dotted(loc: list[str | int]) -> str:
    """("messages", 0, "content") -> messages[0].content"""
    out = ""
    for p in loc:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out
