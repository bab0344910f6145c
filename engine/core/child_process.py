"""The engine process: started by `engine.client.process.ProcessEngineClient` as

    python -c "<BOOT>" PARENT_PID FD [SYS_PATH...]

Its life is bound to its parent's from its first lines, before anything slow (importing torch,
loading weights, sizing the KV pool, capturing CUDA graphs) begins:

- on Linux, `prctl(PR_SET_PDEATHSIG, SIGKILL)`: the kernel kills this process when the parent
  thread that started it ends, however the parent dies (SIGKILL included); then a check that the
  parent is still the one that started us closes the race with a parent that died before prctl;
- everywhere, a watcher thread that exits when the parent pid changes (re-parented), and a reader
  thread on the pipe that exits at end-of-file unless the parent said "stop" first.

This module imports only the standard library at the top; the engine comes in after that.
SIGINT and SIGTERM are ignored: a signal sent to the whole process group must not cut the
parent's drain short. The parent ends this process with StopCore (after draining), or kills it.

Messages over one socket pair: the start-up handshake pickled (it carries configurations and the
engine_setup callable), then the typed messages of engine/messages.py, MessagePack-encoded:
    parent -> child: ("prepare", multiprocessing's spawn preparation data: the parent's main
                     module, working directory and sys.path),
                     ("init", config, heartbeat_s, log_setup, engine_setup), then
                     AddRequest / AbortRequest / StopCore
    child -> parent: ("ready", EngineInfo, EngineStats) or ("failed", message, is a StartupError),
                     then StepResult once per step with news, and at least every heartbeat_s while
                     the loop steps (what the parent's watchdog counts as progress), CoreDied on a
                     crash

No watchdog runs here: a process that is stopped or frozen as a whole (SIGSTOP, a host stall, a
deadlocked extension holding the GIL) would freeze it too. The parent watches instead.
"""

from __future__ import annotations

import multiprocessing.spawn
import os
import queue
import signal
import sys
import threading
import time
from multiprocessing.connection import Connection

# What the parent runs with `python -c`; argv: parent pid, the socket's fd, then sys.path entries.
BOOT = ("import sys; sys.path[:0] = sys.argv[3:]; "
        "from pie.engine.core.child_process import main; main(int(sys.argv[1]), int(sys.argv[2]))")

EXIT_ORPHANED = 70  # the parent went away before this process was told to stop
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
PARENT_POLL_S = 0.2


def bind_to_parent(parent_pid: int) -> None:
    """Makes this process end when the parent does, in every phase from here on."""
    if sys.platform.startswith("linux"):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(EXIT_ORPHANED)
    threading.Thread(target=_watch_parent, args=(parent_pid,), name="parent-watch", daemon=True).start()


def _watch_parent(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(PARENT_POLL_S)
    os._exit(EXIT_ORPHANED)


class Outbox:
    """The child's messages to the parent, sent by a thread of their own: the engine loop only
    queues them, so a parent that reads late (its loop busy writing hundreds of streams) never
    blocks a step. Step results queued while a send is under way go out together, as one result
    with the newest counts. Tuples (the start-up handshake) are pickled; the typed messages are
    MessagePack-encoded (engine/messages.py)."""

    _CLOSE = ("close",)  # the end marker (never sent)

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="engine-outbox", daemon=True)
        self._thread.start()

    def put(self, msg) -> None:
        self._queue.put(msg)

    def close(self, timeout: float = 10.0) -> None:
        """Sends what is queued, then stops the thread."""
        self._queue.put(self._CLOSE)
        self._thread.join(timeout)

    def _run(self) -> None:
        from ..messages import StepResult, encode, merge

        q = self._queue
        try:
            msg = q.get()
            while msg is not self._CLOSE:
                after = None  # a message taken off the queue that must go out after msg
                while isinstance(msg, StepResult) and after is None and not q.empty():
                    nxt = q.get()
                    if isinstance(nxt, StepResult):  # merge the step results queued meanwhile
                        msg = merge(msg, nxt)
                    else:
                        after = nxt
                if isinstance(msg, tuple):
                    self._conn.send(msg)
                else:
                    self._conn.send_bytes(encode(msg))
                msg = after if after is not None else q.get()
        except (BrokenPipeError, OSError):
            return  # the parent is gone; the reader thread ends this process


def _read_commands(conn: Connection, inbox) -> None:
    """Reader thread: the parent's commands into the inbox, from before the engine is built. The
    pipe's end without a StopCore means the parent died: nothing is left to serve."""
    from ..messages import StopCore, decode_command

    try:
        while True:
            cmd = decode_command(conn.recv_bytes())
            if isinstance(cmd, StopCore):
                inbox.close()
                return
            inbox.put(cmd)
    except (EOFError, OSError):
        os._exit(EXIT_ORPHANED)


def main(parent_pid: int, fd: int) -> None:
    bind_to_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    conn = Connection(fd)
    try:
        kind, preparation = conn.recv()
        assert kind == "prepare", kind
        # As multiprocessing's spawn does: the parent's __main__ is loaded as __mp_main__ (and
        # its working directory taken), so functions it defined can be unpickled here.
        multiprocessing.spawn.prepare(preparation)
        kind, config, heartbeat_s, log_setup, engine_setup = conn.recv()
    except (EOFError, OSError):
        os._exit(EXIT_ORPHANED)
    assert kind == "init", kind
    if log_setup is not None:
        log_setup()
    # The engine's imports come only now: everything above is the standard library.
    import structlog

    from ..errors import StartupError
    from ..messages import CoreDied
    from .engine_core import EngineCore
    from .loop import Inbox, StepClock, run_core_loop

    log = structlog.get_logger("pie.engine.core.child_process")
    inbox = Inbox()
    threading.Thread(target=_read_commands, args=(conn, inbox), name="engine-inbox", daemon=True).start()
    outbox = Outbox(conn)
    try:
        engine = EngineCore(config)
        if engine_setup is not None:
            engine_setup(engine)
    except BaseException as e:
        # The parent says it in one line (pie serve prints it); the traceback at --log-level debug.
        log.debug("engine_process_failed_to_start", exc_info=True)
        startup = isinstance(e, StartupError)  # its message already names the flag or file and the fix
        outbox.put(("failed", str(e) if startup else f"{type(e).__name__}: {e}", startup))
        outbox.close()
        return
    outbox.put(("ready", engine.info(), engine.stats()))
    clock = StepClock()
    try:
        run_core_loop(engine, inbox, clock, outbox.put, heartbeat_s=heartbeat_s)
    except BaseException as e:
        log.exception("engine_process_died")
        outbox.put(CoreDied(f"{type(e).__name__}: {e}"))
    finally:
        outbox.close()
