"""One HTTP generation call: the lifecycle of service/generation.py run for each of its prompts
(n prompts x n samples each), their hand-offs merged as they arrive. Admission, streaming,
aborting, the summary lines and the metrics are the lifecycle's; this only starts, merges and
closes them.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import grpc
from fastapi import Request

from pie.engine.errors import RequestError
from pie.engine.messages import RequestOutput
from pie.service.admission import Admission, Admitted
from pie.service.errors import ServiceError
from pie.service.generation import Generation, Handoff, start
from pie.service.logging import RequestSummary
from pie.v1 import generate_pb2 as pb


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

    def close(self) -> None:
        """Ends every generation still running (aborted, its blocks free within a step)."""
        for g in self.generations:
            g.close()
