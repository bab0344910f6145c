"""Runs the LLMEngine in a child process, so the gRPC loop and the engine stop sharing one GIL.

With the engine on a thread (engine_thread.AsyncEngine), the asyncio loop that writes the
streams' messages and the engine's per-request Python take turns on one interpreter lock. At a
few hundred open streams the loop is busy most of the time and the engine's steps stretch with it
(benchmarks/grpc_overhead.py: 7 ms steps became 15 ms at 256 streams). In its own process the
engine steps at its own pace and the loop coalesces what it cannot send at once into larger
messages, as it already does for a slow reader.

    parent (gRPC, asyncio)                         child (spawned)
      ProcessAsyncEngine.submit/abort ---- pipe -->  commands between steps (apply_commands)
      receiver thread -> _deliver on the loop <----  ("out", outputs, stats) once per step
      EngineProxy: tokenizer, config, limits,        LLMEngine + StepWatchdog; ("hung", ...)
                   stats from the last snapshot       when a step overruns

The parent keeps everything the service reads without a round trip: its own tokenizer, the
engine's limits (sent once, when the child is ready), and the stats the child sends with every
batch of outputs. Requests are validated in the parent with the same check as in-process.
"""

from __future__ import annotations

import asyncio
import dataclasses
import multiprocessing
import queue
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from engine.config import EngineConfig
from engine.engine import EngineStats, LLMEngine, RequestOutput, check_request
from engine.engine_thread import AsyncEngine, StepTimeoutError, StepWatchdog, apply_commands
from engine.sampling_params import SamplingParams
from model import ModelConfig, Tokenizer

log = structlog.get_logger(__name__)

READY_TIMEOUT_S = 1800.0  # loading a model (and capturing CUDA graphs) may take minutes


@dataclass(slots=True)
class EngineInfo:
    """What the child tells the parent once its engine is built."""

    model_config: ModelConfig
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    device: str
    dtype_name: str
    num_kv_blocks: int
    stats: EngineStats


class _Counts:
    """The scheduler counts `AsyncEngine.submit` reads, as of the child's last snapshot."""

    __slots__ = ("num_waiting", "num_running")

    def __init__(self) -> None:
        self.num_waiting = 0
        self.num_running = 0


class EngineProxy:
    """The parent's stand-in for the child's LLMEngine: the attributes the service reads."""

    def __init__(self, config: EngineConfig, info: EngineInfo) -> None:
        self.config = config
        self.model_config = info.model_config
        self.max_model_len = info.max_model_len
        self.vocab_size = info.vocab_size
        self.eos_token_ids = info.eos_token_ids
        self.device = info.device
        self.dtype_name = info.dtype_name
        self.num_kv_blocks = info.num_kv_blocks
        self.tokenizer = Tokenizer.from_pretrained(config.model, info.model_config)
        self.scheduler = _Counts()
        self._stats = info.stats
        self.update(info.stats)

    def update(self, stats: EngineStats) -> None:
        self._stats = stats
        self.scheduler.num_waiting = stats.requests_waiting
        self.scheduler.num_running = stats.requests_running

    def stats(self) -> EngineStats:
        return dataclasses.replace(self._stats)

    def check_request(self, prompt_token_ids: list[int], sampling: SamplingParams) -> None:
        check_request(prompt_token_ids, sampling, config=self.config, vocab_size=self.vocab_size,
                      max_model_len=self.max_model_len, num_kv_blocks=self.num_kv_blocks)


# ---- the child ------------------------------------------------------------------------------------

class _Outbox:
    """The child's messages to the parent, sent by a thread of their own: the engine loop only
    queues them, so a parent that reads late (its loop busy writing hundreds of streams) never
    blocks a step. Step outputs queued while a send is under way go out together, as one message
    with the newest stats."""

    def __init__(self, conn) -> None:
        self._conn = conn
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="engine-outbox", daemon=True)
        self._thread.start()

    def put(self, msg: tuple) -> None:
        self._queue.put(msg)

    def close(self, timeout: float = 10.0) -> None:
        """Sends what is queued, then stops the thread."""
        self._queue.put(_CLOSE)
        self._thread.join(timeout)

    def _run(self) -> None:
        q = self._queue
        try:
            msg = q.get()
            while msg is not _CLOSE:
                after = None  # a message taken off the queue that must go out after msg
                while msg[0] == "out" and after is None and not q.empty():
                    nxt = q.get()
                    if nxt[0] == "out":  # merge the step outputs queued meanwhile
                        msg = ("out", msg[1] + nxt[1], *nxt[2:])
                    else:
                        after = nxt
                self._conn.send(msg)
                msg = after if after is not None else q.get()
        except (BrokenPipeError, OSError):
            return  # the parent is gone; the engine loop sees the pipe closed


_CLOSE = ("close",)  # the outbox's end marker (never sent)


class _ChildState:
    """What the child's StepWatchdog watches; on a hang it tells the parent and stops watching."""

    def __init__(self, outbox: _Outbox) -> None:
        self.steps = 0
        self.step_started_at: float | None = None
        self.dead: BaseException | None = None
        self._outbox = outbox

    def _declare_dead(self, error: BaseException) -> None:
        self.dead = error
        self._outbox.put(("hung", str(error)))


def _child_main(config: EngineConfig, conn, step_timeout_s: float | None,
                log_setup: Callable[[], None] | None, engine_setup: Callable[[LLMEngine], None] | None) -> None:
    """The engine process: build the engine, then step it while requests are unfinished, taking
    commands between steps and sending each step's outputs with a stats snapshot."""
    # The parent decides when this process ends (a "stop" after draining, or its pipe closing when
    # it dies): a SIGINT or SIGTERM sent to the whole process group must not cut the drain short.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if log_setup is not None:
        log_setup()
    try:
        engine = LLMEngine(config)
        if engine_setup is not None:
            engine_setup(engine)
    except BaseException as e:
        log.exception("engine_process_failed_to_start")
        conn.send(("failed", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", EngineInfo(
        model_config=engine.model_config, max_model_len=engine.max_model_len, vocab_size=engine.vocab_size,
        eos_token_ids=engine.eos_token_ids, device=str(engine.device), dtype_name=engine.dtype_name,
        num_kv_blocks=engine.block_manager.num_total_blocks, stats=engine.stats())))
    outbox = _Outbox(conn)
    state = _ChildState(outbox)
    watchdog = None
    if step_timeout_s is not None:
        watchdog = StepWatchdog(state, step_timeout_s, lambda err: None)
        watchdog.start()
    received = 0  # samples of the requests taken in so far (the parent counts what it sent)
    try:
        while True:
            if not engine.has_unfinished():
                conn.poll(None)  # idle: wait for a command
            commands = []
            while conn.poll():
                cmd = conn.recv()
                if cmd[0] == "stop":
                    return
                commands.append(cmd)
                if cmd[0] == "add":
                    received += cmd[3].n
            outputs = apply_commands(engine, commands)
            if engine.has_unfinished():
                state.steps += 1
                state.step_started_at = time.monotonic()
                try:
                    outputs += engine.step()
                finally:
                    state.step_started_at = None
            if state.dead is not None:
                return  # the parent was told; it fails the open requests and exits
            if outputs or commands:
                outbox.put(("out", [o.to_wire() for o in outputs], engine.stats(), state.steps, received))
    except (EOFError, BrokenPipeError, KeyboardInterrupt):
        return  # the parent is gone
    except BaseException as e:
        log.exception("engine_process_died")
        outbox.put(("died", f"{type(e).__name__}: {e}"))
    finally:
        if watchdog is not None:
            watchdog.stop()
        engine.abort_all()
        outbox.close()


# ---- the parent -----------------------------------------------------------------------------------

class ProcessAsyncEngine(AsyncEngine):
    """AsyncEngine whose LLMEngine runs in a spawned child process. `launch()` (blocking: run it
    off the event loop) starts the child and waits until its model is loaded; `start(loop)` then
    begins delivering outputs. `on_hang` is called when the child's step overruns the watchdog or
    the child dies: either way it cannot recover by itself, so the owner should exit."""

    def __init__(self, config: EngineConfig, *, step_timeout_s: float | None = None,
                 on_hang: Callable[[BaseException], None] | None = None,
                 log_setup: Callable[[], None] | None = None,
                 engine_setup: Callable[[LLMEngine], None] | None = None) -> None:
        super().__init__(None, step_timeout_s=None)  # the watchdog runs in the child
        self.config = config
        self._step_timeout_s = step_timeout_s
        self._on_hang = on_hang or (lambda err: None)
        self._log_setup = log_setup
        self._engine_setup = engine_setup  # called on the child's engine once built (tests, benchmarks)
        self._conn = None
        self._process = None
        self._receiver: threading.Thread | None = None
        self._send_lock = threading.Lock()
        self._sent = 0  # samples sent in add commands
        self._received = 0  # of those, taken in by the child (as of its last message)

    def launch(self) -> None:
        ctx = multiprocessing.get_context("spawn")  # CUDA cannot be forked
        self._conn, child_conn = ctx.Pipe()
        self._process = ctx.Process(target=_child_main, name="pie-engine", daemon=True,
                                    args=(self.config, child_conn, self._step_timeout_s, self._log_setup,
                                          self._engine_setup))
        self._process.start()
        child_conn.close()
        if not self._conn.poll(READY_TIMEOUT_S):
            self._process.kill()
            raise RuntimeError(f"the engine process did not start within {READY_TIMEOUT_S:.0f} s")
        try:
            kind, payload = self._conn.recv()
        except EOFError:
            raise RuntimeError(f"the engine process exited while starting (code {self._process.exitcode})") from None
        if kind != "ready":
            self._process.join(10)
            raise RuntimeError(f"the engine process failed to start: {payload}")
        self.engine = EngineProxy(self.config, payload)
        log.info("engine_process_ready", pid=self._process.pid)

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        if self.engine is None:
            raise RuntimeError("launch() the engine process before start()")
        self._loop = loop or asyncio.get_running_loop()
        self._idle = asyncio.Event()
        self._idle.set()
        self._receiver = threading.Thread(target=self._receive, name="engine-receiver", daemon=True)
        self._receiver.start()

    def stop(self, timeout: float | None = 10.0) -> None:
        self._stopping = True
        if self._process is not None and self._process.is_alive():
            try:
                self._send(("stop",))
            except (BrokenPipeError, OSError):
                pass
            self._process.join(1.0 if isinstance(self.dead, StepTimeoutError) else timeout)
            if self._process.is_alive():
                self._process.kill()
                self._process.join(5.0)
        if self._receiver is not None:
            self._receiver.join(5.0)
        if self._loop is not None and not self._loop.is_closed() and self._streams:
            self._loop.call_soon_threadsafe(self._fail_open_streams, self._closing_status())

    @property
    def num_queued(self) -> int:
        return self._sent - self._received

    def _enqueue(self, cmd: tuple) -> None:
        if cmd[0] == "add":
            self._sent += cmd[3].n
        self._send(cmd)

    def _send(self, cmd: tuple) -> None:
        with self._send_lock:
            self._conn.send(cmd)

    def _receive(self) -> None:
        """Receiver thread: the child's messages to the loop, until the child ends."""
        try:
            while True:
                msg = self._conn.recv()
                if msg[0] == "out":
                    # One hand-off per message: the child already merges what piled up while a
                    # send was under way. (Draining the pipe here first held outputs back for
                    # seconds at 256 streams: under load something had always arrived meanwhile.)
                    _, outputs, stats, steps, received = msg
                    self.engine.update(stats)
                    self.steps, self._received = steps, received
                    if outputs:
                        self._loop.call_soon_threadsafe(self._deliver, [RequestOutput.from_wire(o) for o in outputs])
                    continue
                if msg[0] == "hung":
                    self._fail(StepTimeoutError(msg[1]))
                    return
                elif msg[0] == "died":
                    self._fail(RuntimeError(f"the engine process failed: {msg[1]}"))
                    return
        except (EOFError, OSError):
            if not self._stopping:
                code = self._process.exitcode if self._process is not None else None
                self._fail(RuntimeError(f"the engine process exited unexpectedly (exit code {code})"))

    def _fail(self, error: BaseException) -> None:
        log.error("engine_process_lost", error=str(error))
        self._on_hang(error)  # first, as the watchdog does: the owner is marked before RPCs fail
        self._declare_dead(error)

