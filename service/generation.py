"""The one lifecycle of a generation request, whichever door it came through (TGI's
`generate_stream_internal`): Generate, GenerateStream, and each prompt of an HTTP call.

`start(...)` mints or takes the request id and admits the request (service/admission.py),
registers it for Abort calls and, for a stream, sends the x-request-id header (`generation` is
the same as an async context); the Generation's `handoffs()` yield the engine's outputs as they arrive. Every way out ends
the request once, here: the `request_done` summary line and the metrics (OK, a refusal, an engine
failure, an Abort call, the caller gone, the server's shutdown), aborting the request in the
engine whenever it ends unfinished. A refusal or failure is raised (RequestError or
ServiceError) after it was logged and counted; each door maps it once to its wire. The door
itself is a `Channel`: its headers, its caller, how it announces, why its caller went away.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Protocol

import grpc
import structlog

from pie.engine.client.engine_client import EngineClient
from pie.engine.errors import RequestAbortedError, RequestError
from pie.engine.messages import RequestOutput, RequestStatus
from pie.v1 import generate_pb2 as pb

from .admission import Admission, Admitted
from .errors import ServiceError, status_of
from .logging import RequestSummary
from .metrics import ServiceMetrics
from .validation import request_id_from

log = structlog.get_logger(__name__)

FINISH_LABELS = {  # the summary line's and vllm:request_success's finished_reason
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


class Channel(Protocol):
    """What the lifecycle needs of the door a request came through."""

    caller: str  # whose requests an Abort call may end (service/aborts.py)
    headers: dict[str, str]  # the caller's metadata or HTTP headers (x-request-id)

    def mint_id(self) -> str:
        """A request id for a caller that gave none."""
        ...

    async def announce(self, request_id: str) -> None:
        """A stream's response headers, sent once the request is admitted."""
        ...

    def gone(self) -> tuple[grpc.StatusCode, str]:
        """Why a request ended whose caller stopped reading it: the code and message it is counted by."""
        ...


@dataclass(frozen=True, slots=True)
class Handoff:
    """The outputs that reached the door together: one step's, or several when it read slowly
    (RequestStream.next_batch) or a stream waited for more tokens (`interval`)."""

    admitted: Admitted  # the request they belong to
    outputs: list[RequestOutput]  # in arrival order, the choices interleaved when n > 1
    last: bool  # every sample finished with these: the answer is complete when it asks for more
    cached_tokens: int  # prompt tokens served from the prefix cache, as reported so far


async def start(admission: Admission, request: pb.GenerateRequest | pb.GenerateStreamRequest, s: RequestSummary,
                channel: Channel, *, streamed: bool, to_context: bool = False) -> Generation:
    """The request admitted and registered for Abort calls; close the Generation however it ends
    (`generation` does). `streamed`: the caller reads the hand-offs as they come (the engine
    bounds its decodes' stalls; the x-request-id header goes out at admission). A refusal is
    logged, counted and raised."""
    try:
        s.request_id = rid = request_id_from(request, channel.headers, channel.mint_id)
        s.adapter = request.adapter or None
        admitted = await admission.admit(request, rid, streamed=streamed, to_context=to_context)
    except (RequestError, ServiceError) as e:
        refused = status_of(e)
        end_summary(admission.metrics, s, refused.code, refused.message)
        raise
    s.prompt_tokens, s.engine_request_id = len(admitted.prompt), admitted.stream.engine_id
    g = Generation(admission, admitted, s, channel)
    admission.in_flight.add(channel.caller, admitted.client, admitted.stream)
    try:  # from here on the engine holds the request: every way out must abort it
        if streamed:
            await channel.announce(rid)
    except BaseException:
        g.close()
        raise
    return g


@asynccontextmanager
async def generation(admission: Admission, request: pb.GenerateRequest | pb.GenerateStreamRequest,
                     s: RequestSummary, channel: Channel, *, streamed: bool) -> AsyncIterator[Generation]:
    """`start`, and the Generation closed on the way out: leaving before the last hand-off counts
    as the caller going away (`Channel.gone`) and aborts the request in the engine."""
    g = await start(admission, request, s, channel, streamed=streamed)
    try:
        yield g
    finally:
        g.close()


class Generation:
    """One admitted request: its hand-offs, and its one ending."""

    def __init__(self, admission: Admission, admitted: Admitted, s: RequestSummary, channel: Channel) -> None:
        self.admission, self.admitted, self.summary, self.channel = admission, admitted, s, channel
        self.finished = False  # every sample finished: nothing to abort

    async def handoffs(self, interval: int | None = None) -> AsyncGenerator[Handoff, None]:
        """The request's outputs until its last. With `interval`, a hand-off after the first token
        waits for `interval` new tokens per sample (or the end): fewer, larger stream messages. An
        engine failure or an Abort call raises ServiceError (logged and counted first); asking for
        more after the last hand-off ends the request OK."""
        a, s, metrics = self.admitted, self.summary, self.admission.metrics
        stream, n = a.stream, a.sampling.n
        cached = 0
        try:
            while not self.finished:
                batch = await stream.next_batch()
                if interval is not None and s.ttft_s is not None:  # the first token goes out at once
                    while (not batch[-1].all_finished
                           and sum(len(o.new_token_ids) for o in batch) < interval * n
                           and not any(o.status == RequestStatus.FINISHED_ERROR for o in batch)):
                        batch += await stream.next_batch()
                self.finished = batch[-1].all_finished
                failed = next((o for o in batch if o.status == RequestStatus.FINISHED_ERROR), None)
                if failed is not None:
                    log.error("request_failed", request_id=a.request_id, engine_request_id=stream.engine_id,
                              error=failed.error)
                    raise self._fail(failure(a.client, a.request_id, failed))
                observe(metrics, s, batch)
                cached = max(cached, max((o.num_cached_tokens for o in batch), default=0))
                yield Handoff(a, batch, self.finished, cached)
            end_summary(metrics, s)
        except RequestAbortedError:
            raise self._fail(ServiceError(
                grpc.StatusCode.CANCELLED, f"request {a.request_id} was aborted by an Abort call of its caller",
                reason="REQUEST_ABORTED")) from None

    def _fail(self, err: ServiceError) -> ServiceError:
        end_summary(self.admission.metrics, self.summary, err.code, err.message)
        return err

    def close(self) -> None:
        """Unregisters the request, aborts it if unfinished, and ends its summary if nothing did:
        its caller went away (a cancel, a deadline, a disconnect), or the shutdown cut it. Once is
        enough; again does nothing."""
        a, s = self.admitted, self.summary
        self.admission.in_flight.remove(self.channel.caller, a.stream)
        if not self.finished:
            self.finished = True
            a.client.abort(a.stream)
        if s.ended:
            return
        if self.admission.shutting_down:  # the caller gets UNAVAILABLE; the reason is DRAINING's
            code, why = grpc.StatusCode.UNAVAILABLE, "server shutting down (DRAINING): the grace period ended first"
        else:
            code, why = self.channel.gone()
        end_summary(self.admission.metrics, s, code, why)


def observe(metrics: ServiceMetrics, s: RequestSummary, batch: list[RequestOutput]) -> None:
    """Times one hand-off of outputs: TTFT, inter-token gaps (split over its tokens), queue time;
    counts its speculative proposals and notes sample 0's finish for the summary line."""
    first = s.ttft_s is None
    n = sum(len(o.new_token_ids) for o in batch)
    gap = s.tokens_arrived(n, time.monotonic())
    if first and s.ttft_s is not None:
        metrics.first_token(s.ttft_s)
    if gap is not None:
        metrics.token_gap(gap, n)
    for o in batch:  # on the output that finishes a sample that speculated
        s.num_draft_tokens += o.num_draft_tokens
        s.num_accepted_tokens += o.num_accepted_tokens
        if o.index == 0 and o.finished:
            s.finish_reason = FINISH_LABELS.get(o.status)
    if s.queue_time_s is None:
        q = next((o.queue_time_s for o in batch if o.queue_time_s is not None), None)
        if q is not None:
            s.queue_time_s = q
            metrics.queued(q)


def end_summary(metrics: ServiceMetrics, s: RequestSummary, code: grpc.StatusCode = grpc.StatusCode.OK,
                error: str | None = None) -> None:
    """Where every generation request ends, once: its summary log line and its metrics."""
    s.status, s.error, s.ended = code.name, error, True
    metrics.request_finished(
        rpc=s.rpc, code=s.status, prompt_tokens=s.prompt_tokens, generated_tokens=s.generated_tokens,
        finished_reason=s.finish_reason, e2e_s=s.total_s if s.finish_reason is not None else None,
        adapter=s.adapter)
    s.emit(log)


def failure(client: EngineClient, rid: str, failed: RequestOutput) -> ServiceError:
    """The status a caller gets for an engine-side failure (`failed` has FINISHED_ERROR)."""
    if client.dead is not None:  # hung, stalled or crashed: try another replica
        return ServiceError(grpc.StatusCode.UNAVAILABLE,
                            f"the engine stopped while serving request {rid} ({client.dead}); "
                            "search the server log for this id", reason="ENGINE_STOPPED")
    if failed.out_of_memory:
        return ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                            f"out of device memory while serving request {rid}; retry later",
                            reason="OUT_OF_MEMORY", retry_after_s=1.0)
    return ServiceError(grpc.StatusCode.INTERNAL,
                        f"engine fault while serving request {rid}; search the server log for this id",
                        reason="ENGINE_FAULT")
