"""Runs an LLMEngine on one background thread and bridges it to an asyncio loop.

asyncio side (the gRPC servicer)                 engine thread
  submit()  -> inbox.append(("add", ...)) ----->   drain inbox: add / abort
  abort()   -> inbox.append(("abort", id)) ---->   engine.step()
  RequestStream.next() <- call_soon_threadsafe <-   one hand-off per step with every output

Outputs coalesce: a stream's consumer takes everything delivered since it last looked, so a slow
consumer gets fewer, larger messages instead of a growing backlog of small ones.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque

import structlog

from engine.engine import LLMEngine, PromptError, RequestOutput
from engine.request import RequestStatus
from engine.sampling_params import SamplingParams

log = structlog.get_logger(__name__)


class QueueFullError(RuntimeError):
    """The waiting queue is at its bound; the caller should retry later."""


class EngineDeadError(RuntimeError):
    """The engine thread has stopped; no request can be served."""


class RequestStream:
    """The asyncio end of one request: outputs pushed by the engine thread, read by the RPC."""

    __slots__ = ("request_id", "_pending", "_event", "finished")

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self._pending: list[RequestOutput] = []
        self._event = asyncio.Event()
        self.finished = False

    def _put(self, output: RequestOutput) -> None:
        self._pending.append(output)
        self.finished = self.finished or output.finished
        self._event.set()

    async def next_batch(self) -> list[RequestOutput]:
        """Waits for at least one output and returns every output delivered so far."""
        await self._event.wait()
        batch, self._pending = self._pending, []
        self._event.clear()
        return batch


class AsyncEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._inbox: deque[tuple] = deque()
        self._wake = threading.Condition()
        self._streams: dict[str, RequestStream] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.dead: BaseException | None = None
        self._idle: asyncio.Event | None = None  # set while no request is in flight (drain waits on it)

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._loop = loop or asyncio.get_running_loop()
        self._idle = asyncio.Event()
        self._idle.set()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = 10.0) -> None:
        """Stops the thread after its current step; aborts whatever is left."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    async def wait_idle(self) -> None:
        """Returns once no request is in flight (used to drain before shutting down)."""
        await self._idle.wait()

    def _forget_stream(self, request_id: str) -> RequestStream | None:
        stream = self._streams.pop(request_id, None)
        if not self._streams:
            self._idle.set()
        return stream

    @property
    def num_queued(self) -> int:
        """Requests handed to the engine thread that it has not taken in yet."""
        return sum(1 for cmd in list(self._inbox) if cmd[0] == "add")

    # ---- called on the asyncio loop --------------------------------------------------------
    def submit(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams) -> RequestStream:
        """Queues a request. Raises PromptError / SamplingParamsError for a request that can never
        be served, QueueFullError when the waiting queue is full, EngineDeadError when stopped."""
        if self.dead is not None or self._stopping:
            raise EngineDeadError("the engine is not running")
        self.engine.check_request(prompt_token_ids, sampling)
        if request_id in self._streams:
            raise PromptError("request_id", f"request id {request_id!r} is already in flight")
        waiting = self.engine.scheduler.num_waiting + len(self._inbox)
        if waiting >= self.engine.config.max_waiting:
            raise QueueFullError(f"{waiting} requests are waiting (bound {self.engine.config.max_waiting})")
        stream = RequestStream(request_id)
        self._streams[request_id] = stream
        self._idle.clear()
        with self._wake:
            self._inbox.append(("add", request_id, prompt_token_ids, sampling))
            self._wake.notify()
        return stream

    def abort(self, request_id: str) -> None:
        """Stops a request within one step and frees its blocks; its stream gets nothing more."""
        if self._forget_stream(request_id) is None:
            return
        with self._wake:
            self._inbox.append(("abort", request_id))
            self._wake.notify()

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for o in outputs:
            stream = self._streams.get(o.request_id)
            if stream is None:
                continue  # aborted by its caller after the step began
            stream._put(o)
            if o.finished:
                self._forget_stream(o.request_id)

    # ---- the engine thread -----------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                with self._wake:
                    while not self._inbox and not engine.has_unfinished() and not self._stopping:
                        self._wake.wait()
                    if self._stopping:
                        break
                    commands = list(self._inbox)
                    self._inbox.clear()
                early: list[RequestOutput] = []
                for cmd in commands:
                    if cmd[0] == "add":
                        _, rid, prompt, sampling = cmd
                        try:
                            engine.add_request(rid, prompt, sampling)
                        except Exception as e:  # validated up front; this is a last line of defence
                            early.append(RequestOutput(rid, [], "", finished=True,
                                                       status=RequestStatus.FINISHED_ERROR, error=str(e)))
                    else:
                        engine.abort(cmd[1])
                outputs = early + (engine.step() if engine.has_unfinished() else [])
                if outputs:
                    self._loop.call_soon_threadsafe(self._deliver, outputs)
        except BaseException as e:  # the loop itself broke: fail everyone rather than hang them
            log.exception("engine_thread_died")
            self.dead = e
        finally:
            self._shutdown_requests()

    def _shutdown_requests(self) -> None:
        status = RequestStatus.FINISHED_ERROR if self.dead is not None else RequestStatus.FINISHED_ABORTED
        self.engine.abort_all()
        if self._loop is not None and not self._loop.is_closed():
            # Streams are owned by the loop thread: fail whatever is still open there.
            self._loop.call_soon_threadsafe(self._fail_open_streams, status)

    def _fail_open_streams(self, status: RequestStatus) -> None:
        error = str(self.dead) if self.dead is not None else None
        self._deliver([RequestOutput(rid, [], "", finished=True, status=status, error=error)
                       for rid in list(self._streams)])
