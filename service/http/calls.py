"""One HTTP generation call: the lifecycle of service/generation.py run for each of its prompts
(n prompts x n samples each), their hand-offs merged as they arrive. Admission, streaming,
aborting, the summary lines and the metrics are the lifecycle's; this only starts, merges and
closes them, and hands their outputs to an answer: whole (`collect`) or as server-sent events
(`sse`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc
from fastapi import Request
from fastapi.responses import StreamingResponse

from pie.engine.errors import RequestError
from pie.engine.messages import RequestOutput
from pie.v1 import generate_pb2 as pb

from ..admission import Admission, Admitted
from ..errors import ServiceError
from ..generation import Generation, Handoff, start
from ..logging import RequestSummary
from .errors import HttpError, Params, http_error
from .responses import Answer, Choice

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # no proxy buffers the events


class HttpChannel:
    """An HTTP call as the lifecycle's Channel (service/generation.py)."""

    def __init__(self, request: Request, peer: str) -> None:
        # No gRPC Abort call names an HTTP caller: a disconnect is how one ends its requests.
        self.caller = peer
        self.headers = dict(request.headers)
        self.why = "the caller went away"  # what a request that ends unanswered is counted as

    def mint_id(self) -> str:
        return uuid.uuid4().hex

    async def announce(self, request_id: str) -> None:
        """Nothing: the response's headers go with its first bytes."""

    def gone(self) -> tuple[grpc.StatusCode, str]:
        return grpc.StatusCode.CANCELLED, self.why


class Call:
    """The generations of one HTTP call: prompt i's samples are choices i x n .. i x n + n - 1."""

    def __init__(self, generations: list[Generation]) -> None:
        self.generations = generations

    @classmethod
    async def open(cls, admission: Admission, requests: list[pb.GenerateStreamRequest],
                   summaries: list[RequestSummary], channel: HttpChannel, *, streamed: bool,
                   to_context: bool = False) -> Call:
        """Admits every prompt's request or none: a refusal (logged and counted by the lifecycle,
        then raised) closes those admitted before it."""
        call = cls([])
        try:
            for request, s in zip(requests, summaries):
                call.generations.append(await start(admission, request, s, channel, streamed=streamed,
                                                    to_context=to_context))
        except BaseException:
            channel.why = "another prompt of the call was refused"
            call.close()
            raise
        return call

    @property
    def admitted(self) -> list[Admitted]:
        return [g.admitted for g in self.generations]

    @property
    def n(self) -> int:
        return self.generations[0].admitted.sampling.n

    async def outputs(self) -> AsyncIterator[tuple[int, list[RequestOutput]]]:
        """(prompt index, the outputs that arrived together) until every request finished. A
        failure raises the lifecycle's ServiceError; cancelling the iteration (the caller went
        away) leaves the rest to `close`."""
        queue: asyncio.Queue[tuple[int, Handoff | Exception | None]] = asyncio.Queue()

        async def read(i: int, g: Generation) -> None:
            try:
                async for handoff in g.handoffs():
                    await queue.put((i, handoff))
                await queue.put((i, None))
            except (RequestError, ServiceError) as e:  # logged and counted already: the reader says so
                await queue.put((i, e))

        readers = [asyncio.ensure_future(read(i, g)) for i, g in enumerate(self.generations)]
        try:
            done = 0
            while done < len(readers):
                i, item = await queue.get()
                if item is None:
                    done += 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield i, item.outputs
        finally:
            for reader in readers:
                reader.cancel()

    async def choices(self, answer: Answer) -> AsyncIterator[tuple[int, list]]:
        """(choice index, its new outputs) as they arrive, counted into the answer's usage."""
        async for prompt, batch in self.outputs():
            by_index: dict[int, list] = {}
            for o in batch:
                by_index.setdefault(prompt * self.n + o.index, []).append(o)
                answer.completion_tokens += len(o.new_token_ids)
                answer.cached_tokens[prompt] = max(answer.cached_tokens.get(prompt, 0), o.num_cached_tokens)
            for index, outs in sorted(by_index.items()):
                yield index, outs

    def close(self) -> None:
        """Ends every generation still running (aborted, its blocks free within a step)."""
        for g in self.generations:
            g.close()


async def collect(call: Call, answer: Answer, request: Request) -> None:
    """A whole answer; the caller disconnecting meanwhile cancels it (and its requests)."""

    async def gather() -> None:
        async for index, outs in call.choices(answer):
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
        raise HttpError(499, "the caller disconnected", code="cancelled", grpc_code=grpc.StatusCode.CANCELLED)
    task.result()  # the lifecycle's ServiceError for a failure


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def sse(call: Call, events: AsyncIterator[dict], rid: str, params: Params) -> StreamingResponse:
    """Server-sent events: `data: <json>` per chunk, then `data: [DONE]`; an engine failure after
    the first event is an error event (the status line is gone by then). A caller that goes away
    cancels the iteration, and its requests are aborted."""

    async def lines() -> AsyncIterator[str]:
        try:
            async for event in events:
                yield f"data: {json.dumps(event)}\n\n"
        except (RequestError, ServiceError, HttpError) as e:
            yield f"data: {json.dumps(http_error(e, params).body())}\n\n"
        finally:
            call.close()
        yield "data: [DONE]\n\n"

    return StreamingResponse(lines(), media_type="text/event-stream", headers=SSE_HEADERS | {"x-request-id": rid})
