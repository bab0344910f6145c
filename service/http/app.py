"""The OpenAI-compatible HTTP door (`pie serve --http-port`): a FastAPI app on the server's own
event loop, over the same engine client as the gRPC servicer. A request is read into the
contract's GenerateStreamRequest (service/http/requests.py) and admitted by the servicer, so
both doors validate alike; its outputs come back as OpenAI's bodies or server-sent events.

    GET  /                     the playground page (service/http/playground.html)
    GET  /health               200 while serving; 503 while loading or draining
    GET  /metrics              Prometheus text (the --metrics-port series)
    GET  /v1/models            the served model
    POST /v1/completions       text or token-id prompts (a list of them too)
    POST /v1/chat/completions  a conversation, rendered with the model's chat template

Errors are OpenAI error objects: 400 bad input (the parameter named), 401 a missing or wrong API
key (the gRPC door's bearer tokens), 404 another model's name, 429 a full queue (Retry-After),
503 loading or draining. A caller that disconnects cancels its requests: their KV blocks free
within a step.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from fastapi_offline import FastAPIOffline
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from pie.service.http.calls import Admitter, Call, HttpError
from pie.service.http.requests import ChatRequest, CompletionRequest, body_problem, chat_request, completion_requests
from pie.service.http.responses import (
    Answer,
    Choice,
    chat_body,
    chat_chunk,
    completion_body,
    completion_chunk,
    usage_chunk,
)
from pie.service.http.tool_parsers import ToolParser
from pie.service.metrics import ServiceMetrics
from pie.service.validation import FieldError

PLAYGROUND = Path(__file__).with_name("playground.html")
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # no proxy buffers the events


class Door(Admitter):
    """What the app reads of the server: the servicer's admission and state, and the API keys."""

    def __init__(self, servicer: Any, metrics: ServiceMetrics, model_name: str, api_keys: tuple[str, ...],
                 tool_call_parser: str | None = None) -> None:
        self.servicer = servicer
        self.metrics = metrics
        self.model_name = model_name
        self.api_keys = api_keys
        self.tool_call_parser = tool_call_parser  # reads "auto"'s tool calls out of the text (tool_parsers.py)

    async def admit(self, request, request_id, *, streamed, to_context=False):
        return await self.servicer.admit(request, request_id, streamed=streamed, to_context=to_context)

    @property
    def ready(self) -> bool:
        return self.servicer.engine_client is not None and not self.servicer.draining


def build_app(door: Door) -> FastAPI:
    # /docs (Swagger UI) with its script and styles served from the fastapi-offline package (under
    # /static-offline-docs), not a CDN: the page works without internet. No /redoc: its bundle
    # still fetches a logo from Redocly's CDN.
    app = FastAPIOffline(title="pie", summary="OpenAI-compatible HTTP API of a pie server", redoc_url=None)

    @app.exception_handler(HttpError)
    async def http_error(request: Request, e: HttpError) -> JSONResponse:
        headers = {} if e.retry_after_s is None else {"Retry-After": str(max(1, round(e.retry_after_s)))}
        return JSONResponse(e.body(), status_code=e.status, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def bad_body(request: Request, e: RequestValidationError) -> JSONResponse:
        param, message = body_problem(list(e.errors()))
        return JSONResponse(HttpError(400, message, param=param, code="invalid_field").body(), status_code=400)

    async def authorized(request: Request) -> None:
        if not door.api_keys:
            return
        given = request.headers.get("authorization", "")
        token = given[7:] if given[:7].lower() == "bearer " else ""
        if not any(hmac.compare_digest(token.encode(), key.encode()) for key in door.api_keys):
            raise HttpError(401, "missing or wrong API key (Authorization: Bearer <key>)",
                            type="authentication_error", code="invalid_api_key")

    def check_ready(model: str | None) -> None:
        if not door.ready:
            raise HttpError(503, "the server is loading its model or draining; retry shortly",
                            type="server_error", code="unavailable", retry_after_s=1.0)
        if model is not None and model != door.model_name:
            raise HttpError(404, f"the model {model!r} does not exist; this server serves {door.model_name!r}",
                            param="model", code="model_not_found")

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def playground() -> HTMLResponse:
        return HTMLResponse(PLAYGROUND.read_text())

    @app.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse({"status": "ok" if door.ready else "unavailable"}, status_code=200 if door.ready else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(door.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", dependencies=[Depends(authorized)])
    async def models() -> dict:
        created = int(time.time())
        card: dict[str, Any] = {"id": door.model_name, "object": "model", "created": created, "owned_by": "pie"}
        if door.servicer.engine_client is not None:
            card["max_model_len"] = door.servicer.engine_client.info.max_model_len
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions", dependencies=[Depends(authorized)])
    async def completions(body: CompletionRequest, request: Request) -> Response:
        check_ready(body.model)
        try:
            requests = completion_requests(body)
        except FieldError as e:
            raise HttpError.of(e, chat=False) from None
        rid = _request_id(request, body.request_id, "cmpl")
        call = await Call.admit(door, requests, rid, "http/completions", _peer(request), chat=False,
                                streamed=body.stream)
        answer = Answer(rid, door.model_name, score_only=body.max_tokens == 0)
        answer.prompt_tokens = sum(len(a.prompt) for a in call.admitted)
        tokenizer = call.admitted[0].client.tokenizer
        echo = [_prompt_text(tokenizer, a.prompt, r) for a, r in zip(call.admitted, requests)] if body.echo else None
        logprobs = body.logprobs  # alternatives per token; None: no logprobs
        if not body.stream:
            await _collect(call, answer, request)
            prompts = [a.prompt for a in call.admitted]
            return JSONResponse(completion_body(answer, tokenizer, logprobs, echo, call.n, prompts), headers=_rid(rid))
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        usage = {"usage": None} if include_usage else {}  # as OpenAI: null on every chunk but the last

        async def events() -> AsyncIterator[dict]:
            offsets: dict[int, int] = {}  # each choice's text so far, the echoed prompt included
            async for index, outs in _choices(call, answer):
                prefix = echo[index // call.n] if echo and index not in offsets else ""
                offset = offsets.get(index, 0)
                yield completion_chunk(answer, index, outs, tokenizer, logprobs, offset, prefix) | usage
                offsets[index] = offset + len(prefix) + sum(len(o.new_text) for o in outs)
            if include_usage:
                yield usage_chunk(answer, chat=False)

        return _sse(call, events(), rid)

    @app.post("/v1/chat/completions", dependencies=[Depends(authorized)])
    async def chat_completions(body: ChatRequest, request: Request) -> Response:
        check_ready(body.model)
        try:
            chat, forced = chat_request(body)
        except FieldError as e:
            raise _as_sent(HttpError.of(e, chat=True), body) from None
        rid = _request_id(request, body.request_id, "chatcmpl")
        try:
            call = await Call.admit(door, [chat], rid, "http/chat", _peer(request), chat=True, streamed=body.stream,
                                    to_context=body.max_tokens is None and body.max_completion_tokens is None)
        except HttpError as e:
            if forced is not None and e.param == "response_format":  # the tools' schema, refused by the matcher
                e.param, e.message = "tools", "tools" + e.message.removeprefix("response_format")
            raise _as_sent(e, body) from None
        answer = Answer(rid, door.model_name)
        answer.prompt_tokens = len(call.admitted[0].prompt)
        tokenizer = call.admitted[0].client.tokenizer
        top = (body.top_logprobs or 0) if body.logprobs else None
        parser = None
        if door.tool_call_parser and body.tools and body.tool_choice in (None, "auto"):
            parser = ToolParser(door.tool_call_parser)
        if not body.stream:
            await _collect(call, answer, request)
            return JSONResponse(chat_body(answer, tokenizer, top, forced, parser), headers=_rid(rid))
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        usage = {"usage": None} if include_usage else {}  # as OpenAI: null on every chunk but the last

        async def events() -> AsyncIterator[dict]:
            for index in range(call.n):  # the assistant's role opens each choice
                yield chat_chunk(answer, index, None, tokenizer, top, first=True, forced=forced) | usage
            async for index, outs in _choices(call, answer):
                yield chat_chunk(answer, index, outs, tokenizer, top, forced=forced, parser=parser) | usage
            if include_usage:
                yield usage_chunk(answer, chat=True)

        return _sse(call, events(), rid)

    return app


def _as_sent(e: HttpError, body: ChatRequest) -> HttpError:
    """A chat's length limit named as the caller sent it: the contract's max_tokens is OpenAI's
    max_completion_tokens, unless the request said max_tokens (the older name, still accepted)."""
    if e.param == "max_completion_tokens" and body.max_completion_tokens is None:
        e.param, e.message = "max_tokens", "max_tokens" + e.message.removeprefix("max_completion_tokens")
    return e


async def _choices(call: Call, answer: Answer) -> AsyncIterator[tuple[int, list]]:
    """(choice index, its new outputs) as they arrive, counted into the answer's usage."""
    async for prompt, batch in call.outputs():
        by_index: dict[int, list] = {}
        for o in batch:
            by_index.setdefault(prompt * call.n + o.index, []).append(o)
            answer.completion_tokens += len(o.new_token_ids)
            answer.cached_tokens[prompt] = max(answer.cached_tokens.get(prompt, 0), o.num_cached_tokens)
        for index, outs in sorted(by_index.items()):
            yield index, outs


async def _collect(call: Call, answer: Answer, request: Request) -> None:
    """A whole answer; the caller disconnecting meanwhile cancels it (and its requests)."""

    async def gather() -> None:
        async for index, outs in _choices(call, answer):
            choice = answer.choices.setdefault(index, Choice())
            for o in outs:
                choice.add(o)

    await _unless_disconnected(request, gather, call)


async def _unless_disconnected(request: Request, work: Callable[[], Awaitable[None]], call: Call) -> None:
    task = asyncio.ensure_future(work())
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        call.close()
    if task.cancelled():
        raise HttpError(499, "the caller disconnected", code="cancelled")
    task.result()  # an HttpError of the engine's


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _sse(call: Call, events: AsyncIterator[dict], rid: str) -> StreamingResponse:
    """Server-sent events: `data: <json>` per chunk, then `data: [DONE]`; an engine failure after
    the first event is an error event (the status line is gone by then). A caller that goes away
    cancels the iteration, and its requests are aborted."""

    async def lines() -> AsyncIterator[str]:
        try:
            async for event in events:
                yield f"data: {json.dumps(event)}\n\n"
        except HttpError as e:
            yield f"data: {json.dumps(e.body())}\n\n"
        finally:
            call.close(grpc.StatusCode.CANCELLED)
        yield "data: [DONE]\n\n"

    return StreamingResponse(lines(), media_type="text/event-stream", headers=SSE_HEADERS | _rid(rid))


def _request_id(request: Request, given: str | None, kind: str) -> str:
    return given or request.headers.get("x-request-id") or f"{kind}-{uuid.uuid4().hex}"


def _rid(rid: str) -> dict[str, str]:
    return {"x-request-id": rid}


def _peer(request: Request) -> str:
    client = request.client
    return "http" if client is None else f"http:{client.host}:{client.port}"


def _prompt_text(tokenizer, ids: list[int], request) -> str:
    """What `echo` puts before a completion: the prompt as given, or its ids decoded."""
    return request.prompt if request.WhichOneof("prompt_input") == "prompt" else tokenizer.decode(ids)
