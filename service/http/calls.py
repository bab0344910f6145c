"""One HTTP generation call, from admission to its end: its engine requests (one per prompt),
their outputs as they arrive, and every way out aborting what is unfinished. Refusals come out as
`HttpError`s, OpenAI's error objects with the status a gRPC caller's code maps to.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

import grpc
import structlog

from pie.engine.messages import RequestOutput, RequestStatus
from pie.service.errors import ServiceError
from pie.service.generation import Admitted, end_summary, failure, observe
from pie.service.http.requests import param_of
from pie.service.logging import RequestSummary
from pie.service.metrics import ServiceMetrics
from pie.service.validation import FieldError
from pie.v1 import generate_pb2 as pb

log = structlog.get_logger(__name__)

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
_CODES = {"PROMPT_TOO_LONG": "context_length_exceeded", "QUEUE_FULL": "rate_limit_exceeded"}


class HttpError(Exception):
    """An OpenAI error object and its HTTP status (with Retry-After where the caller may retry)."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param: str | None = param
        self.code: str | None = code
        self.retry_after_s = retry_after_s

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    @classmethod
    def of(cls, e: ServiceError | FieldError, *, chat: bool) -> HttpError:
        if isinstance(e, FieldError):
            name = param_of(e.field, chat=chat)
            return cls(400, f"{name}: {e.description}", param=name, code="invalid_field")
        status, type_ = _STATUS.get(e.code, (500, "server_error"))
        param = None if e.field is None else param_of(e.field, chat=chat)
        message = e.message if param is None else f"{param}: {e.description}"
        return cls(status, message, type=type_, param=param, code=_CODES.get(e.reason, e.reason.lower()),
                   retry_after_s=e.retry_after_s)


class Admitter(Protocol):
    """What a call needs of the gRPC servicer: its admission (validation, prompt, submit)."""

    metrics: ServiceMetrics

    async def admit(self, request: pb.GenerateStreamRequest, request_id: str, *, streamed: bool,
                    to_context: bool = False) -> Admitted: ...


@dataclass(slots=True)
class Call:
    """The engine requests of one HTTP call: prompt i's samples are choices i x n .. i x n + n - 1."""

    admitted: list[Admitted]
    summaries: list[RequestSummary]
    metrics: ServiceMetrics
    chat: bool
    finished: list[bool]

    @classmethod
    async def admit(cls, host: Admitter, requests: list[pb.GenerateStreamRequest], request_id: str, rpc: str,
                    peer: str, *, chat: bool, streamed: bool, to_context: bool = False) -> Call:
        """Admits every prompt's request or none: a refusal aborts those admitted before it.
        `streamed`: the answer goes out as server-sent events (the engine bounds those decodes' stalls)."""
        call = cls([], [], host.metrics, chat, [])
        try:
            for i, request in enumerate(requests):
                s = RequestSummary(rpc, peer)
                s.request_id = request_id if len(requests) == 1 else f"{request_id}-{i}"
                call.summaries.append(s)
                a = await host.admit(request, s.request_id, streamed=streamed, to_context=to_context)
                s.prompt_tokens, s.engine_request_id = len(a.prompt), a.stream.engine_id
                call.admitted.append(a)
                call.finished.append(False)
        except (ServiceError, FieldError) as e:
            err = e if isinstance(e, ServiceError) else None
            code = err.code if err is not None else grpc.StatusCode.INVALID_ARGUMENT
            end_summary(host.metrics, call.summaries[-1], code, str(e))
            call.close(grpc.StatusCode.CANCELLED, "another prompt of the call was refused")
            raise HttpError.of(e, chat=chat) from None
        return call

    @property
    def n(self) -> int:
        return self.admitted[0].sampling.n

    async def outputs(self) -> AsyncIterator[tuple[int, list[RequestOutput]]]:
        """(prompt index, the outputs that arrived together) until every request finished. An engine
        failure raises HttpError; cancelling the iteration (the caller went away) aborts the rest
        once the iteration is closed (`close`)."""
        queue: asyncio.Queue[tuple[int, list[RequestOutput] | Exception]] = asyncio.Queue()

        async def read(i: int) -> None:
            stream = self.admitted[i].stream
            try:
                while True:
                    batch = await stream.next_batch()
                    await queue.put((i, batch))
                    if batch[-1].all_finished:
                        return
            except Exception as e:  # the stream was cancelled: its reader says so, not the queue's silence
                await queue.put((i, e))

        readers = [asyncio.ensure_future(read(i)) for i in range(len(self.admitted))]
        try:
            while not all(self.finished):
                i, batch = await queue.get()
                if isinstance(batch, Exception):
                    end_summary(self.metrics, self.summaries[i], grpc.StatusCode.CANCELLED, str(batch))
                    raise HttpError(499, f"the request was aborted: {batch}", code="aborted")
                failed = next((o for o in batch if o.status == RequestStatus.FINISHED_ERROR), None)
                a, s = self.admitted[i], self.summaries[i]
                if failed is not None:
                    log.error("request_failed", request_id=s.request_id, engine_request_id=a.stream.engine_id,
                              error=failed.error)
                    err = failure(a.client, s.request_id or "", failed)
                    end_summary(self.metrics, s, err.code, err.message)
                    raise HttpError.of(err, chat=self.chat)
                observe(self.metrics, s, batch)
                self.finished[i] = batch[-1].all_finished
                if self.finished[i]:
                    s.finish_reason = _finish_label(batch)
                    end_summary(self.metrics, s, grpc.StatusCode.OK)
                yield i, batch
        finally:
            for reader in readers:
                reader.cancel()

    def close(self, code: grpc.StatusCode = grpc.StatusCode.CANCELLED, why: str = "the caller went away") -> None:
        """Aborts every request still unfinished (its blocks free within a step) and ends its summary."""
        for i, a in enumerate(self.admitted):
            if not self.finished[i]:
                self.finished[i] = True
                a.client.abort(a.stream)
                if not self.summaries[i].ended:
                    end_summary(self.metrics, self.summaries[i], code, why)


def _finish_label(batch: list[RequestOutput]) -> str | None:
    """Sample 0's finish reason, for the summary line."""
    out = next((o for o in reversed(batch) if o.index == 0 and o.finished), None)
    if out is None:
        return None
    return {RequestStatus.FINISHED_STOPPED: "stop", RequestStatus.FINISHED_LENGTH: "length"}.get(out.status, "abort")
