"""The engine core in a child process (`pie serve`'s default), so the gRPC loop and the engine
stop sharing one GIL.

With the core on a thread (thread.ThreadEngineClient), the asyncio loop that writes the
streams' messages and the engine's per-request Python take turns on one interpreter lock. At a
few hundred open streams the loop is busy most of the time and the engine's steps stretch with it.
In its own process the core steps at its own pace and the loop coalesces what it cannot send at
once into larger messages.

    parent (gRPC, asyncio)                               child (engine/core/child_process.py)
      ProcessEngineClient.submit/abort -> sender -->       reader thread -> Inbox
                     (a thread: never blocks the loop)     run_core_loop (as on a thread)
      link thread: starts the child, then  <----------     outbox thread: StepResult per step
        hands each result to the loop (_on_result)           and heartbeat; CoreDied on a crash
      watchdog thread: requests in flight and nothing
        heard for --step-timeout -> the engine stalled

Commands and results are the typed messages of engine/messages.py, MessagePack-encoded.

The watchdog lives here, outside the child, so it sees a child that is stopped or frozen as a
whole (SIGSTOP, a host stall, a stuck driver call, a deadlocked extension): while requests are in
flight, the child reports at least every heartbeat (engine/core/loop.py); silence longer than the step
timeout declares the engine dead (requests fail UNAVAILABLE, readiness off, the server exits 3)
and kills the child. An engine with nothing to do sends nothing and is not stalled.

The parent keeps what the service reads without a round trip: its own tokenizer (and structured
output's compiler over it, which checks constraints before they are sent), the engine's facts
(EngineInfo, sent once when the child is ready), and the stats the child sends with every step. Requests are validated in the parent, the one place they are checked (engine/client/engine_client.py).

The child never outlives the parent (see core_process.py). Its parent-death signal is tied to the
thread that started it, so the link thread, which lives exactly as long as the child serves,
starts it; when the link thread gives up on a hung or failed child, the kernel kills the child.
"""

from __future__ import annotations

import asyncio
import multiprocessing.spawn
import os
import queue
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection

import structlog

from pie.model.tokenizer import Tokenizer

from ..config import EngineConfig
from ..core.child_process import BOOT
from ..core.engine_core import EngineCore
from ..core.loop import Watchdog, heartbeat_interval
from ..errors import StartupError, StepTimeoutError
from ..messages import Command, StepResult, StopCore, decode_result, encode
from ..sample.structured import GrammarCompiler
from .engine_client import EngineClientBase

log = structlog.get_logger(__name__)

READY_TIMEOUT_S = 1800.0  # loading a model (and capturing CUDA graphs) may take minutes


class LaunchCancelled(RuntimeError):
    """stop() was called while the engine process was still starting."""


class ProcessEngineClient(EngineClientBase):
    """An EngineClient whose EngineCore runs in a child process. `launch()` (blocking: run it off
    the event loop) starts the child and waits until its model is loaded; `start(loop)` then
    begins delivering outputs. `on_dead` hears when the child stalls past `step_timeout_s` (the
    watchdog, above) or dies: it cannot recover by itself, so the owner should exit."""

    def __init__(self, config: EngineConfig, *, step_timeout_s: float | None = None,
                 on_dead: Callable[[BaseException], None] | None = None,
                 log_setup: Callable[[], None] | None = None,
                 engine_setup: Callable[[EngineCore], None] | None = None) -> None:
        super().__init__(on_dead=on_dead)
        self.config = config
        self.pid: int | None = None  # the child's, once started
        heartbeat_s = heartbeat_interval(step_timeout_s) if step_timeout_s is not None else 1.0
        self._init = ("init", config, heartbeat_s, log_setup, engine_setup)
        self._step_timeout_s = step_timeout_s
        self._watchdog: Watchdog | None = None
        self._last_heard = time.monotonic()  # when the child's latest message arrived (link thread)
        self._conn: Connection | None = None
        self._process: subprocess.Popen | None = None
        self._outgoing: queue.SimpleQueue[Command | None] = queue.SimpleQueue()  # None ends the sender
        self._launched = threading.Event()
        self._launch_error: BaseException | None = None
        self._link: threading.Thread | None = None
        self._sender: threading.Thread | None = None

    # ---- lifecycle -------------------------------------------------------------------------
    def launch(self) -> None:
        """Starts the child and waits until its engine is built; raises if it fails to start,
        LaunchCancelled if stop() came first."""
        self._link = threading.Thread(target=self._run_link, name="engine-link", daemon=True)
        self._link.start()
        if not self._launched.wait(READY_TIMEOUT_S):
            self._kill()
            raise RuntimeError(f"the engine process did not start within {READY_TIMEOUT_S:.0f} s")
        if self._launch_error is not None:
            raise self._launch_error
        self._tokenizer = Tokenizer.from_pretrained(self.config.model, self.info.model_config)
        self._grammars = GrammarCompiler(self._tokenizer.backend.to_str(), self.info.vocab_size, self.info.eos_token_ids)
        log.info("engine_process_ready", pid=self.pid)

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        if not self.loaded:
            raise RuntimeError("launch() the engine process before start()")
        self._loop = loop or asyncio.get_running_loop()
        self._sender = threading.Thread(target=self._run_sender, name="engine-sender", daemon=True)
        self._sender.start()
        if self._step_timeout_s is not None:
            self._watchdog = Watchdog(self._step_timeout_s, self._waiting_since, self._stall_message, self._stalled)
            self._watchdog.start()

    # ---- the watchdog ----------------------------------------------------------------------
    def _waiting_since(self) -> float | None:
        """Since when a message from the child is due: requests are in flight, and it has said
        nothing since they became so (or since its last message). None while idle."""
        if not self.num_in_flight:
            return None
        return max(self._last_heard, self._busy_since)

    def _stall_message(self, waited_s: float) -> str:
        return (f"engine stalled: the engine process (pid {self.pid}) finished no step in {waited_s:.1f} s "
                f"(--step-timeout {self._step_timeout_s:g}) with {self.num_in_flight} requests in flight")

    def _stalled(self, err: StepTimeoutError) -> None:
        log.error("engine_stalled", pid=self.pid, error=str(err))
        self.declare_dead(err)
        self._kill()  # stopped or frozen, it cannot be asked; SIGKILL reaches a stopped process too

    def stop(self, timeout: float | None = 10.0) -> None:
        """Asks the child to stop after its current step (it aborts what is left) and waits for
        it; kills it when it does not end in time, is hung, or is still starting."""
        self._stopping = True
        if self._watchdog is not None:
            self._watchdog.stop()
        if not self.loaded or self.dead is not None or self._sender is None:
            self._kill()  # starting or never started (nothing to drain), or given up on
        else:
            self._outgoing.put(StopCore())
        self._outgoing.put(None)  # the sender thread ends
        if self._process is not None:
            try:
                self._process.wait(timeout)
            except subprocess.TimeoutExpired:
                log.warning("engine_process_killed", pid=self.pid, reason="did not stop in time")
                self._kill()
                self._process.wait(5.0)
        for thread in (self._sender, self._link):
            if thread is not None:
                thread.join(5.0)
        self._fail_open_streams_soon()

    def _exit_code(self) -> int | None:
        """The child's exit status once its end of the pipe closed (None if it lingers)."""
        try:
            return self._process.wait(5.0) if self._process is not None else None
        except subprocess.TimeoutExpired:
            return None

    def _kill(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.kill()

    # ---- commands out ----------------------------------------------------------------------
    def _send(self, command: Command) -> None:
        self._outgoing.put(command)  # the sender thread writes the pipe: a full pipe never blocks the loop

    def _run_sender(self) -> None:
        conn = self._conn
        assert conn is not None, "the child was started before the sender"
        try:
            while (cmd := self._outgoing.get()) is not None:
                conn.send_bytes(encode(cmd))
        except OSError:
            return  # the child is gone; the link thread reports it

    # ---- the link thread: start the child, then relay what it says --------------------------
    def _run_link(self) -> None:
        try:
            conn = self._spawn()
            kind, *payload = conn.recv()
            if kind == "failed":
                message, startup = payload
                raise StartupError(message) if startup else RuntimeError(f"the engine process failed to start: {message}")
            self._info, self._stats = payload
        except BaseException as e:
            if isinstance(e, (EOFError, OSError)):
                code = self._exit_code()
                e = (LaunchCancelled("the server stopped while the engine was starting") if self._stopping
                     else RuntimeError(f"the engine process exited while starting (exit code {code})"))
            self._launch_error = e
            self._launched.set()
            return
        self._launched.set()
        self._relay(conn)

    def _spawn(self) -> Connection:
        parent_end, child_end = socket.socketpair()
        fd = child_end.fileno()
        self._process = subprocess.Popen(
            [sys.executable, "-c", BOOT, str(os.getpid()), str(fd), *[p for p in sys.path if p]],
            pass_fds=(fd,), close_fds=True)
        child_end.close()
        self.pid = self._process.pid
        self._conn = conn = Connection(parent_end.detach())
        log.info("engine_process_started", pid=self.pid)
        conn.send(("prepare", _preparation_data()))
        conn.send(self._init)
        return conn

    def _relay(self, conn: Connection) -> None:
        try:
            while True:
                msg = decode_result(conn.recv_bytes())
                self._last_heard = time.monotonic()
                if isinstance(msg, StepResult):
                    # One hand-off per message: the child already merges what piled up while a
                    # send was under way. (Draining the pipe here first held outputs back for
                    # seconds at 256 streams: under load something had always arrived meanwhile.)
                    # (Results come only after a submit, so start() has given the loop by then.)
                    self._event_loop().call_soon_threadsafe(self._on_result, msg)
                else:  # CoreDied
                    self.declare_dead(RuntimeError(f"the engine process failed: {msg.message}"))
                    return
        except (EOFError, OSError):
            if not self._stopping:
                code = self._exit_code()
                self.declare_dead(RuntimeError(f"the engine process exited unexpectedly (exit code {code})"))


def _preparation_data() -> dict:
    """What multiprocessing's spawn tells a child about the parent (its main module, working
    directory, sys.path), without the process's authentication key, which we do not use."""
    data = multiprocessing.spawn.get_preparation_data("pie-engine")
    return {k: v for k, v in data.items() if k in (
        "name", "sys_path", "sys_argv", "dir", "orig_dir", "init_main_from_name", "init_main_from_path")}
