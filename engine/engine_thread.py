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
import time
from collections import deque
from collections.abc import Callable

import structlog

from engine.engine import LLMEngine, PromptError, RequestOutput
from engine.request import RequestStatus
from engine.sampling_params import SamplingParams

log = structlog.get_logger(__name__)


class QueueFullError(RuntimeError):
    """The waiting queue is at its bound; the caller should retry later."""


class EngineDeadError(RuntimeError):
    """The engine thread has stopped; no request can be served."""


class StepTimeoutError(RuntimeError):
    """One engine step ran past the watchdog's limit; the engine is presumed hung."""


class StepWatchdog:
    """Watches the engine thread from a thread of its own: when one step has run longer than
    `timeout_s`, it calls `on_hang(error)` once and stops watching. A hung step cannot be
    interrupted from Python (it may be stuck inside a CUDA call), so the owner's job is to fail
    the waiting RPCs, flip readiness and let the process exit for a supervisor to restart it."""

    def __init__(self, engine: "AsyncEngine", timeout_s: float, on_hang: Callable[[StepTimeoutError], None]) -> None:
        if timeout_s <= 0:
            raise ValueError(f"step timeout must be > 0, got {timeout_s}")
        self.engine = engine
        self.timeout_s = timeout_s
        self.on_hang = on_hang
        self.fired = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="step-watchdog", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        interval = min(1.0, self.timeout_s / 4)
        while not self._stop.wait(interval):
            started = self.engine.step_started_at
            if started is None or time.monotonic() - started <= self.timeout_s:
                continue
            self.fired = True
            err = StepTimeoutError(f"engine step {self.engine.steps} has run for more than {self.timeout_s} s")
            log.error("engine_step_hung", step=self.engine.steps, timeout_s=self.timeout_s)
            # The owner hears first (readiness off, exit flagged), then the open RPCs fail: a caller
            # that sees its RPC fail finds the server already marked.
            self.on_hang(err)
            self.engine._declare_dead(err)
            return


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
        self.finished = self.finished or output.all_finished
        self._event.set()

    async def next_batch(self) -> list[RequestOutput]:
        """Waits for at least one output and returns every output delivered so far."""
        await self._event.wait()
        batch, self._pending = self._pending, []
        self._event.clear()
        return batch


def apply_commands(engine: LLMEngine, commands: list[tuple]) -> list[RequestOutput]:
    """Applies ("add", id, prompt, sampling) / ("abort", id) commands in order; returns an error
    output for each add the engine refused (validated up front: a last line of defence)."""
    early: list[RequestOutput] = []
    for cmd in commands:
        if cmd[0] == "add":
            _, rid, prompt, sampling = cmd
            try:
                engine.add_request(rid, prompt, sampling)
            except Exception as e:
                early.append(RequestOutput(rid, [], "", finished=True, status=RequestStatus.FINISHED_ERROR,
                                           error=str(e)))
        else:
            engine.abort(cmd[1])
    return early


class AsyncEngine:
    def __init__(self, engine: LLMEngine | None, *, step_timeout_s: float | None = None,
                 on_hang: Callable[[StepTimeoutError], None] | None = None) -> None:
        self.engine = engine  # None only in a subclass that sets it later (engine_process)
        self.steps = 0  # engine steps begun so far
        self.step_started_at: float | None = None  # monotonic start of the step in progress, else None
        self._watchdog = (StepWatchdog(self, step_timeout_s, on_hang or (lambda err: None))
                          if step_timeout_s is not None else None)
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
        if self._watchdog is not None:
            self._watchdog.start()

    def stop(self, timeout: float | None = 10.0) -> None:
        """Stops the thread after its current step; aborts whatever is left."""
        if self._watchdog is not None:
            self._watchdog.stop()
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(1.0 if isinstance(self.dead, StepTimeoutError) else timeout)

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
        """Samples (a request of n > 1 counts n) handed to the engine thread and not taken in yet."""
        return sum(cmd[3].n for cmd in list(self._inbox) if cmd[0] == "add")

    # ---- called on the asyncio loop --------------------------------------------------------
    def submit(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams) -> RequestStream:
        """Queues a request. Raises PromptError / SamplingParamsError for a request that can never
        be served, QueueFullError when the waiting queue is full, EngineDeadError when stopped."""
        if self.dead is not None or self._stopping:
            raise EngineDeadError("the engine is not running")
        self.engine.check_request(prompt_token_ids, sampling)
        if request_id in self._streams:
            raise PromptError("request_id", f"request id {request_id!r} is already in flight")
        # Requests the engine has not taken in yet may fill free batch slots at once, so a burst into
        # an idle engine is not shed early; in flight stays <= max_num_seqs + max_waiting.
        cfg, sched = self.engine.config, self.engine.scheduler
        # Counted in samples, as the scheduler counts them: a request of n > 1 takes n places.
        waiting = sched.num_waiting + self.num_queued  # pending aborts do not count
        headroom = max(0, cfg.max_num_seqs - sched.num_running)
        if waiting + sampling.n > cfg.max_waiting + headroom:
            raise QueueFullError(f"{waiting} requests are waiting (bound {cfg.max_waiting})")
        stream = RequestStream(request_id)
        self._streams[request_id] = stream
        self._idle.clear()
        self._enqueue(("add", request_id, prompt_token_ids, sampling))
        return stream

    def abort(self, request_id: str) -> None:
        """Stops a request within one step and frees its blocks; its stream gets nothing more."""
        if self._forget_stream(request_id) is None:
            return
        self._enqueue(("abort", request_id))

    def _enqueue(self, cmd: tuple) -> None:
        """Hands a command to the engine, which applies it before its next step."""
        with self._wake:
            self._inbox.append(cmd)
            self._wake.notify()

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for o in outputs:
            stream = self._streams.get(o.request_id)
            if stream is None:
                continue  # aborted by its caller after the step began
            stream._put(o)
            if o.all_finished:  # with n > 1, `finished` only ends one sample
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
                early = apply_commands(engine, commands)
                stepped: list[RequestOutput] = []
                if engine.has_unfinished():
                    self.steps += 1
                    self.step_started_at = time.monotonic()
                    try:
                        stepped = engine.step()
                    finally:
                        self.step_started_at = None
                if self.dead is not None:
                    break  # the watchdog gave up on this step; its requests were failed already
                outputs = early + stepped
                if outputs:
                    self._loop.call_soon_threadsafe(self._deliver, outputs)
        except BaseException as e:  # the loop itself broke: fail everyone rather than hang them
            log.exception("engine_thread_died")
            self.dead = self.dead or e
        finally:
            self._shutdown_requests()

    def _closing_status(self) -> RequestStatus:
        return RequestStatus.FINISHED_ERROR if self.dead is not None else RequestStatus.FINISHED_ABORTED

    def _shutdown_requests(self) -> None:
        status = self._closing_status()
        self.engine.abort_all()
        if self._loop is not None and not self._loop.is_closed():
            # Streams are owned by the loop thread: fail whatever is still open there.
            self._loop.call_soon_threadsafe(self._fail_open_streams, status)

    def _declare_dead(self, error: BaseException) -> None:
        """Called off the engine thread (watchdog): no new requests, every open stream fails now."""
        self.dead = error
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._fail_open_streams, RequestStatus.FINISHED_ERROR)

    def _fail_open_streams(self, status: RequestStatus) -> None:
        error = str(self.dead) if self.dead is not None else None
        self._deliver([RequestOutput(rid, [], "", finished=True, status=status, error=error)
                       for rid in list(self._streams)])
