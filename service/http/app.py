"""The OpenAI-compatible HTTP door (`pie serve --http-port`): a FastAPI app on the server's own
event loop, holding the same Admission as the gRPC servicer. A request is read into the
contract's GenerateStreamRequest (service/http/requests.py) and run through the one lifecycle
(service/generation.py, a lifecycle per prompt: service/http/calls.py), so both doors validate,
log and count alike; its outputs come back as OpenAI's bodies or server-sent events.

    GET  /                     the playground page (service/http/playground.html)
    GET  /health               200 while serving; 503 while loading or draining
    GET  /metrics              Prometheus text (the --metrics-port series)
    GET  /v1/models            the served model and its loaded LoRA adapters (`parent`: the model)
    GET  /v1/models/{id}       one of them by its name (404 model_not_found for another)
    POST /v1/completions       text or token-id prompts (a list of them too)
    POST /v1/chat/completions  a conversation, rendered with the model's chat template
    POST /v1/load_lora_adapter    {"lora_name", "lora_path"}: load a PEFT adapter (vLLM's route)
    POST /v1/unload_lora_adapter  {"lora_name"}: unload it; requests running on it finish

A generation's `model` picks the base model (the served name) or a loaded adapter (its name).

Every non-2xx body is an OpenAI error object (service/http/errors.py), with the call's
x-request-id header: 400 bad input (the parameter named), 401 a missing or wrong API key (the
gRPC door's bearer tokens), 404 another model's name or an unknown route, 405 a wrong method, 429
a full queue (Retry-After), 503 loading or draining. A refused generation call gets its
`request_done` line and its pie_requests_finished count, as a refused RPC does. A caller that
disconnects cancels its requests: their KV blocks free within a step.
"""

from __future__ import annotations

import hmac
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response
from fastapi_offline import FastAPIOffline
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException

from pie.engine.errors import RequestError
from pie.v1 import generate_pb2 as pb

from ..admission import Admission
from ..errors import ServiceError
from ..generation import end_summary
from ..logging import RequestSummary
from ..validation import request_id_from
from .calls import Call, HttpChannel, collect, sse
from .errors import HttpError, Params, body_problem, http_error, not_found, params_of
from .requests import (
    ChatRequest,
    CompletionRequest,
    LoadLoraRequest,
    UnloadLoraRequest,
    chat_request,
    completion_requests,
)
from .responses import (
    Answer,
    chat_body,
    chat_chunk,
    completion_body,
    completion_chunk,
    usage_chunk,
)
from .tool_parsers import ToolParser

PLAYGROUND = Path(__file__).with_name("playground.html")
# The generation routes, by the rpc label their summary lines and pie_requests_finished carry.
GENERATION_RPCS = {"/v1/completions": ("http/completions", "cmpl"), "/v1/chat/completions": ("http/chat", "chatcmpl")}


class Door:
    """What the app reads of the server: the admission both doors hold, and the API keys."""

    def __init__(self, admission: Admission, api_keys: tuple[str, ...], tool_call_parser: str | None = None) -> None:
        self.admission = admission
        self.metrics = admission.metrics
        self.model_name = admission.model_name
        self.api_keys = api_keys
        self.tool_call_parser = tool_call_parser  # reads "auto"'s tool calls out of the text (tool_parsers.py)


def build_app(door: Door) -> FastAPI:
    # /docs (Swagger UI) with its script and styles served from the fastapi-offline package (under
    # /static-offline-docs), not a CDN: the page works without internet. No /redoc: its bundle
    # still fetches a logo from Redocly's CDN.
    app = FastAPIOffline(title="pie", summary="OpenAI-compatible HTTP API of a pie server", redoc_url=None)

    async def refused(request: Request, err: Exception) -> JSONResponse:
        """Every error response of the door: an OpenAI error object with the call's x-request-id; a
        generation call refused before the lifecycle took it (its body, its key, its model) is
        logged and counted here as the lifecycle counts its own refusals."""
        headers: dict[str, str] = {}
        if isinstance(err, RequestValidationError):
            param, message = body_problem(list(err.errors()))
            err = HttpError(400, message, param=param, code="invalid_field")
        elif isinstance(err, HTTPException):  # a route or a method this door does not have
            headers = dict(err.headers or {})  # (405's Allow)
            code = {404: "not_found", 405: "method_not_allowed"}.get(err.status_code)
            err = HttpError(err.status_code, f"{request.method} {request.url.path}: {err.detail}", code=code,
                            grpc_code=grpc.StatusCode.NOT_FOUND if err.status_code == 404 else
                            grpc.StatusCode.UNIMPLEMENTED)
        assert isinstance(err, RequestError | ServiceError | HttpError)
        chat = request.url.path.endswith("chat/completions")
        e = http_error(err, getattr(request.state, "params", None) or Params(chat=chat))
        rid = _call_id(request)
        s = _summary(request)
        if s is not None and not s.ended:
            s.request_id = s.request_id or rid
            end_summary(door.metrics, s, e.grpc_code, e.message)
        return JSONResponse(e.body(), status_code=e.status, headers=headers | e.headers() | {"x-request-id": rid})

    for error in (HttpError, RequestError, ServiceError, RequestValidationError, HTTPException):
        app.add_exception_handler(error, refused)

    async def authorized(request: Request) -> None:
        _summary(request)  # the call's time starts here
        if not door.api_keys:
            return
        given = request.headers.get("authorization", "")
        token = given[7:] if given[:7].lower() == "bearer " else ""
        if not any(hmac.compare_digest(token.encode(), key.encode()) for key in door.api_keys):
            raise HttpError(401, "missing or wrong API key (Authorization: Bearer <key>)",
                            type="authentication_error", code="invalid_api_key",
                            grpc_code=grpc.StatusCode.UNAUTHENTICATED)

    def adapter_names() -> list[str]:
        client = door.admission.engine_client
        return [] if client is None else client.adapter_names

    def check_model(model: str | None) -> str | None:
        """The LoRA adapter a request's `model` names (None: the served model itself)."""
        if model is None or model == door.model_name:
            return None
        if model in adapter_names():
            return model
        raise not_found(f"the model {model!r} does not exist; this server serves {door.model_name!r}"
                        + (f" and the adapters {adapter_names()}" if adapter_names() else ""), "model_not_found")

    def model_card(name: str | None = None) -> dict[str, Any]:
        card: dict[str, Any] = {"id": name or door.model_name, "object": "model", "created": int(time.time()),
                                "owned_by": "pie"}
        if door.admission.engine_client is not None:
            card["max_model_len"] = door.admission.engine_client.info.max_model_len
        if name is not None:  # an adapter: its base, as vLLM lists them
            card["parent"] = card["root"] = door.model_name
        return card

    async def open_call(request: Request, requests: list[pb.GenerateStreamRequest], given_id: str | None, *,
                        streamed: bool, to_context: bool = False) -> tuple[str, Call]:
        """The call's id (the body's, the x-request-id header's, or minted) and its generations,
        one lifecycle per prompt (refused together: the lifecycle logs which one)."""
        rid = request_id_from(pb.GenerateRequest(request_id=given_id or ""), dict(request.headers), _mint(request))
        request.state.request_id = rid
        rpc, _ = GENERATION_RPCS[request.url.path]
        peer = _peer(request)
        summaries = [_summary(request) or RequestSummary(rpc, peer)]
        summaries += [RequestSummary(rpc, peer) for _ in requests[1:]]
        for i, r in enumerate(requests):
            r.request_id = rid if len(requests) == 1 else f"{rid}-{i}"
        call = await Call.open(door.admission, requests, summaries, HttpChannel(request, peer), streamed=streamed,
                               to_context=to_context)
        return rid, call

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def playground() -> HTMLResponse:
        return HTMLResponse(PLAYGROUND.read_text())

    @app.get("/health")
    async def health() -> JSONResponse:
        ready = door.admission.ready
        return JSONResponse({"status": "ok" if ready else "unavailable"}, status_code=200 if ready else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(door.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", dependencies=[Depends(authorized)])
    async def models() -> dict:
        return {"object": "list", "data": [model_card()] + [model_card(name) for name in adapter_names()]}

    @app.get("/v1/models/{model_id:path}", dependencies=[Depends(authorized)])
    async def model(model_id: str) -> dict:
        return model_card(check_model(model_id))

    @app.post("/v1/load_lora_adapter", dependencies=[Depends(authorized)])
    async def load_lora_adapter(body: LoadLoraRequest) -> Response:
        await door.admission.load_adapter(body.lora_name, body.lora_path)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", dependencies=[Depends(authorized)])
    async def unload_lora_adapter(body: UnloadLoraRequest) -> Response:
        await door.admission.unload_adapter(body.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    @app.post("/v1/completions", dependencies=[Depends(authorized)])
    async def completions(body: CompletionRequest, request: Request) -> Response:
        request.state.params = params_of(body, chat=False)
        adapter = check_model(body.model)
        requests = completion_requests(body)
        for r in requests:
            r.adapter = adapter or ""
        rid, call = await open_call(request, requests, body.request_id, streamed=body.stream)
        answer = Answer(rid, adapter or door.model_name, score_only=body.max_tokens == 0)
        answer.prompt_tokens = sum(len(a.prompt) for a in call.admitted)
        tokenizer = call.admitted[0].client.tokenizer
        echo = [_prompt_text(tokenizer, a.prompt, r) for a, r in zip(call.admitted, requests)] if body.echo else None
        logprobs = body.logprobs  # alternatives per token; None: no logprobs
        if not body.stream:
            await collect(call, answer, request)
            prompts = [a.prompt for a in call.admitted]
            return JSONResponse(completion_body(answer, tokenizer, logprobs, echo, call.n, prompts), headers=_rid(rid))
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        usage = {"usage": None} if include_usage else {}  # as OpenAI: null on every chunk but the last

        async def events() -> AsyncIterator[dict]:
            offsets: dict[int, int] = {}  # each choice's text so far, the echoed prompt included
            async for index, outs in call.choices(answer):
                prefix = echo[index // call.n] if echo and index not in offsets else ""
                offset = offsets.get(index, 0)
                yield completion_chunk(answer, index, outs, tokenizer, logprobs, offset, prefix) | usage
                offsets[index] = offset + len(prefix) + sum(len(o.new_text) for o in outs)
            if include_usage:
                yield usage_chunk(answer, chat=False)

        return sse(call, events(), rid, request.state.params)

    @app.post("/v1/chat/completions", dependencies=[Depends(authorized)])
    async def chat_completions(body: ChatRequest, request: Request) -> Response:
        request.state.params = params_of(body, chat=True)
        adapter = check_model(body.model)
        chat, forced = chat_request(body)
        chat.adapter = adapter or ""
        request.state.params = params_of(body, chat=True, forced=forced is not None)
        rid, call = await open_call(request, [chat], body.request_id, streamed=body.stream,
                                    to_context=body.max_tokens is None and body.max_completion_tokens is None)
        answer = Answer(rid, adapter or door.model_name)
        answer.prompt_tokens = len(call.admitted[0].prompt)
        tokenizer = call.admitted[0].client.tokenizer
        top = (body.top_logprobs or 0) if body.logprobs else None
        parser = None
        if door.tool_call_parser and body.tools and body.tool_choice in (None, "auto"):
            parser = ToolParser(door.tool_call_parser)
        if not body.stream:
            await collect(call, answer, request)
            return JSONResponse(chat_body(answer, tokenizer, top, forced, parser), headers=_rid(rid))
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        usage = {"usage": None} if include_usage else {}  # as OpenAI: null on every chunk but the last

        async def events() -> AsyncIterator[dict]:
            for index in range(call.n):  # the assistant's role opens each choice
                yield chat_chunk(answer, index, None, tokenizer, top, first=True, forced=forced) | usage
            async for index, outs in call.choices(answer):
                yield chat_chunk(answer, index, outs, tokenizer, top, forced=forced, parser=parser) | usage
            if include_usage:
                yield usage_chunk(answer, chat=True)

        return sse(call, events(), rid, request.state.params)

    return app


def _mint(request: Request) -> Callable[[], str]:
    kind = GENERATION_RPCS.get(request.url.path, ("", "req"))[1]
    return lambda: f"{kind}-{uuid.uuid4().hex}"


def _call_id(request: Request) -> str:
    """The id an error response carries: the call's (once known), else the caller's x-request-id
    header, else minted (also for a header that could not travel back: not printable ASCII)."""
    rid = getattr(request.state, "request_id", None)
    if rid is None:
        try:
            rid = request_id_from(pb.GenerateRequest(), dict(request.headers), _mint(request))
        except RequestError:
            rid = _mint(request)()
        request.state.request_id = rid
    return rid


def _summary(request: Request) -> RequestSummary | None:
    """The summary line of a generation call (None for other routes), made at its first use."""
    rpc = GENERATION_RPCS.get(request.url.path, (None,))[0]
    if rpc is None or request.method != "POST":
        return None
    s = getattr(request.state, "summary", None)
    if s is None:
        s = request.state.summary = RequestSummary(rpc, _peer(request))
    return s


def _rid(rid: str) -> dict[str, str]:
    return {"x-request-id": rid}


def _peer(request: Request) -> str:
    client = request.client
    return "http" if client is None else f"http:{client.host}:{client.port}"


def _prompt_text(tokenizer, ids: list[int], request) -> str:
    """What `echo` puts before a completion: the prompt as given, or its ids decoded."""
    return request.prompt if request.WhichOneof("prompt_input") == "prompt" else tokenizer.decode(ids)
