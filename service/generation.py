"""The one lifecycle of a generation RPC, which Generate and GenerateStream share.

`generation` is an async generator: it validates and admits the request (through its host's
`admit`), registers it for Abort calls, sends the x-request-id header, and yields the engine's
outputs as they arrive (`Handoff`s). It maps every way out to one ending, written once: the
summary line and the metrics (OK, a refusal, an engine failure, an Abort call, the caller's cancel
or deadline, the server's shutdown), aborting the request in the engine whenever it ends unfinished.
GenerateStream turns each hand-off into messages; Generate collects them into one answer
(service/answers.py).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Protocol

import grpc
import structlog

from pie.engine.client.engine_client import EngineClient, RequestStream
from pie.engine.errors import RequestAbortedError
from pie.engine.messages import RequestOutput, RequestStatus
from pie.engine.sampling_params import SamplingParams
from pie.service.aborts import InFlight, caller_of
from pie.service.errors import ServiceError, invalid_argument, send_error
from pie.service.logging import RequestSummary
from pie.service.metrics import ServiceMetrics
from pie.service.validation import FieldError, request_id_from

log = structlog.get_logger(__name__)

# A caller whose RPC ends within this many seconds of its deadline is counted as DEADLINE_EXCEEDED
# (the client's own timer fires a little before the server's).
DEADLINE_SLACK_S = 0.05


@dataclass(frozen=True, slots=True)
class Admitted:
    """A request the engine accepted, and what its RPC needs to answer it."""

    request_id: str  # the caller's (request field, x-request-id metadata, or minted)
    client: EngineClient  # the engine that holds it
    prompt: list[int]  # the prompt's token ids (a text or chat tokenized)
    sampling: SamplingParams
    stream: RequestStream  # its outputs, as the engine delivers them


@dataclass(frozen=True, slots=True)
class Handoff:
    """The outputs that reached the RPC together: one step's, or several when the RPC read slowly
    (RequestStream.next_batch) or a stream waited for more tokens (`interval`)."""

    admitted: Admitted  # the request they belong to
    outputs: list[RequestOutput]  # in arrival order, the choices interleaved when n > 1
    last: bool  # every sample finished with these: the RPC's answer is complete when it asks for more
    cached_tokens: int  # prompt tokens served from the prefix cache, as reported so far


class Host(Protocol):
    """What the lifecycle uses of the servicer that runs it."""

    metrics: ServiceMetrics
    in_flight: InFlight  # the requests an Abort call may end
    auth: bool  # callers are told apart by bearer token (else all are one: service/aborts.py)
    shutting_down: bool  # the shutdown's grace is over: what gRPC cancels now, the shutdown cut

    async def admit(self, request, request_id: str, *, streamed: bool) -> Admitted:
        """Validates the request and submits it to the engine (`streamed`: its tokens are read as
        they come); raises ServiceError or FieldError."""
        ...


async def generation(host: Host, request, context: grpc.aio.ServicerContext, s: RequestSummary, *,
                     interval: int | None = None, streamed: bool = True) -> AsyncGenerator[Handoff, None]:
    """The request's outputs, from admission to its end. With `interval`, a hand-off after the
    first token waits for `interval` new tokens per sample (or the end): fewer, larger stream
    messages. `streamed`: the caller reads the hand-offs as they come (a stream): the engine bounds
    its decodes' stalls and the x-request-id header goes out at admission; else (a unary call) the
    RPC sends the header with its answer. A refusal ends the iteration with the RPC's status set (`send_error`); a cancel or
    deadline raises out of it, as gRPC delivers them. Close it when done (contextlib.aclosing):
    closing it early counts as the caller going away."""
    try:
        s.request_id = rid = _request_id(request, context)
        admitted = await host.admit(request, rid, streamed=streamed)
        s.prompt_tokens = len(admitted.prompt)
        s.engine_request_id = admitted.stream.engine_id
        client, stream, n = admitted.client, admitted.stream, admitted.sampling.n
        caller = caller_of(context, host.auth)
        finished = False
        cached = 0
        try:  # from here on the engine holds the request: every way out must abort it
            host.in_flight.add(caller, client, stream)
            if streamed:  # else the RPC sends them with its answer (Generate: see there)
                await context.send_initial_metadata((("x-request-id", rid),))
            while not finished:
                batch = await stream.next_batch()
                if interval is not None and s.ttft_s is not None:  # the first token goes out at once
                    while (not batch[-1].all_finished
                           and sum(len(o.new_token_ids) for o in batch) < interval * n
                           and not any(o.status == RequestStatus.FINISHED_ERROR for o in batch)):
                        batch += await stream.next_batch()
                finished = batch[-1].all_finished
                failed = next((o for o in batch if o.status == RequestStatus.FINISHED_ERROR), None)
                if failed is not None:
                    log.error("request_failed", request_id=rid, engine_request_id=stream.engine_id,
                              error=failed.error)
                    raise _fail(host.metrics, s, failure(client, rid, failed))
                observe(host.metrics, s, batch)
                cached = max(cached, max((o.num_cached_tokens for o in batch), default=0))
                yield Handoff(admitted, batch, finished, cached)
            end_summary(host.metrics, s, grpc.StatusCode.OK)
        except RequestAbortedError:
            raise _fail(host.metrics, s, _aborted(rid)) from None
        finally:
            host.in_flight.remove(caller, stream)
            if not finished:
                client.abort(stream)
            if not s.ended:  # the caller went away (cancel or deadline) before its answer
                _gone(host, context, s)
    except (ServiceError, FieldError) as e:
        _refuse(host.metrics, context, s, e)


def _request_id(request, context: grpc.aio.ServicerContext) -> str:
    metadata = {k: v for k, v in (context.invocation_metadata() or ()) if isinstance(v, str)}
    return request_id_from(request, metadata, lambda: uuid.uuid4().hex)


def observe(metrics: ServiceMetrics, s: RequestSummary, batch: list[RequestOutput]) -> None:
    """Times one hand-off of outputs: TTFT, inter-token gaps (split over its tokens), queue time;
    counts its speculative proposals for the summary line."""
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
    if s.queue_time_s is None:
        q = next((o.queue_time_s for o in batch if o.queue_time_s is not None), None)
        if q is not None:
            s.queue_time_s = q
            metrics.queued(q)


def end_summary(metrics: ServiceMetrics, s: RequestSummary, code: grpc.StatusCode, error: str | None = None) -> None:
    """Where every generation RPC ends, once: its summary log line and its metrics."""
    s.status, s.error, s.ended = code.name, error, True
    metrics.request_finished(
        rpc=s.rpc, code=s.status, prompt_tokens=s.prompt_tokens, generated_tokens=s.generated_tokens,
        finished_reason=s.finish_reason, e2e_s=s.total_s if s.finish_reason is not None else None)
    s.emit(log)


def _fail(metrics: ServiceMetrics, s: RequestSummary, err: ServiceError) -> ServiceError:
    """Ends the RPC's summary with `err` (the error to raise next: `_refuse` sends it)."""
    end_summary(metrics, s, err.code, err.message)
    return err


def _refuse(metrics: ServiceMetrics, context, s: RequestSummary, err: ServiceError | FieldError) -> None:
    """The RPC ends with `err`: its summary line (unless written) and its status."""
    if isinstance(err, FieldError):
        err = invalid_argument(err.field, err.description)
    if not s.ended:
        end_summary(metrics, s, err.code, err.message)
    send_error(context, err, s.request_id)


def _gone(host: Host, context, s: RequestSummary) -> None:
    """Ends the summary of an RPC whose caller went away: its deadline, its cancel, or the shutdown
    that cut it."""
    if host.shutting_down:  # the caller gets UNAVAILABLE from gRPC; the reason is DRAINING's
        end_summary(host.metrics, s, grpc.StatusCode.UNAVAILABLE,
             "server shutting down (DRAINING): the grace period ended first")
        return
    remaining = context.time_remaining()
    if remaining is not None and remaining <= DEADLINE_SLACK_S:
        end_summary(host.metrics, s, grpc.StatusCode.DEADLINE_EXCEEDED, "the deadline passed")
    else:
        end_summary(host.metrics, s, grpc.StatusCode.CANCELLED, "cancelled by the caller")


def _aborted(rid: str) -> ServiceError:
    return ServiceError(grpc.StatusCode.CANCELLED, f"request {rid} was aborted by an Abort call of its caller",
                        reason="REQUEST_ABORTED")


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
