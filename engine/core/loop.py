"""The engine loop, the same function on a thread of the server and in the engine process:

    while True:
        commands = inbox.take(block=engine idle)     # every command that arrived, at once
        apply them (AddRequest / AbortRequest)       # before the step, in arrival order
        step, timed (the watchdog reads the clock)   # schedule -> execute -> update
        publish(StepResult)                          # to the asyncio loop, or into the pipe

Commands are never read in the middle of a step: an abort takes effect before the next one, so a
cancelled request's blocks are free within one step.

The loop publishes after every step with outputs, after every batch of commands, and at least every
`heartbeat_s` while it steps without outputs (prefill chunks, a step that could schedule nothing):
a step that finished is what a watchdog outside this process counts as progress.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

import structlog

from ..errors import StepTimeoutError
from ..messages import AbortRequest, AdapterCommand, AdapterReply, AddRequest, Command, StepResult
from .engine_core import EngineCore

log = structlog.get_logger(__name__)

# publish(result): a step's outputs with the engine's counts after it, to the client.
Publish = Callable[[StepResult], None]


class Inbox:
    """Commands for the engine loop, put from any thread, taken all at once between steps."""

    def __init__(self) -> None:
        self._commands: deque[Command] = deque()
        self._cond = threading.Condition()
        self._closed = False

    def put(self, command: Command) -> None:
        with self._cond:
            self._commands.append(command)
            self._cond.notify()

    def close(self) -> None:
        """The loop stops before its next step (what is left unapplied is dropped)."""
        with self._cond:
            self._closed = True
            self._cond.notify()

    def take(self, block: bool) -> list[Command] | None:
        """Every command queued so far (waiting for one when `block`); None once closed."""
        with self._cond:
            while block and not self._commands and not self._closed:
                self._cond.wait()
            if self._closed:
                return None
            commands = list(self._commands)
            self._commands.clear()
            return commands


class StepClock:
    """What the watchdog reads: steps begun, and when the step in progress began."""

    __slots__ = ("steps", "step_started_at", "dead")

    def __init__(self) -> None:
        self.steps = 0
        self.step_started_at: float | None = None  # monotonic start of the step in progress, else None
        self.dead: BaseException | None = None  # set by the watchdog: the loop ends after this step


class Watchdog:
    """Watches for progress from a thread of its own. `waiting_since()` says since when progress is
    awaited (monotonic seconds), or None while nothing is (an idle engine is not a stall). Once the
    wait exceeds `timeout_s`, `describe(waited_s)` names the stall, `on_stall(error)` is called once
    and the watch ends. A stall cannot be interrupted from Python (a step stuck in a CUDA call, a
    stopped process): the owner fails the waiting RPCs, turns readiness off and exits for a
    supervisor to restart.

    Two watch the engine: on a thread, `StepClock.step_started_at` (a step that runs too long);
    in a child process, the parent's time since it last heard from the child while requests are in
    flight (client_process.py), which also sees a child that is stopped or frozen as a whole."""

    def __init__(self, timeout_s: float, waiting_since: Callable[[], float | None],
                 describe: Callable[[float], str], on_stall: Callable[[StepTimeoutError], None]) -> None:
        if timeout_s <= 0:
            raise ValueError(f"step timeout must be > 0, got {timeout_s}")
        self.timeout_s = timeout_s
        self._waiting_since = waiting_since
        self._describe = describe
        self._on_stall = on_stall
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="engine-watchdog", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        while not self._stop.wait(heartbeat_interval(self.timeout_s)):
            since = self._waiting_since()
            if since is None or (waited := time.monotonic() - since) <= self.timeout_s:
                continue
            self._on_stall(StepTimeoutError(self._describe(waited)))
            return


def heartbeat_interval(timeout_s: float) -> float:
    """How often a watchdog of `timeout_s` looks, and how often the loop reports while busy."""
    return min(1.0, timeout_s / 4)


def step_watchdog(clock: StepClock, timeout_s: float, on_hang: Callable[[StepTimeoutError], None]) -> Watchdog:
    """The watchdog of a loop on a thread of this process: one step running past `timeout_s`
    marks the clock dead (the loop ends after it, if it ever returns) and calls `on_hang`."""

    def hung(err: StepTimeoutError) -> None:
        log.error("engine_step_hung", step=clock.steps, timeout_s=timeout_s)
        clock.dead = err
        on_hang(err)

    return Watchdog(timeout_s, lambda: clock.step_started_at,
                    lambda waited: f"engine step {clock.steps} has run for more than {timeout_s} s", hung)


def apply_commands(engine: EngineCore, commands: list[Command], replies: list[AdapterReply]) -> int:
    """Applies AddRequest / AbortRequest / AdapterCommand in order; returns the samples the adds
    brought in, and appends each adapter command's outcome to `replies`. The requests were
    validated by the client that sent them (the one place requests are checked,
    engine/client/engine_client.py; it sends no add naming an adapter it unloads, and commands
    arrive in order): an add that fails here is a bug, and ends the loop."""
    taken = 0
    for cmd in commands:
        if isinstance(cmd, AdapterCommand):
            replies.append(engine.adapter_command(cmd))
            continue
        if isinstance(cmd, AddRequest):
            taken += cmd.sampling.n
            engine.add_request(cmd.request_id, cmd.prompt_token_ids, cmd.sampling, priority=cmd.priority,
                               streamed=cmd.streamed, adapter=cmd.adapter)
        elif isinstance(cmd, AbortRequest):
            engine.abort(cmd.request_id)
        else:
            raise ValueError(f"not a command for the loop: {cmd!r}")
    return taken


def run_core_loop(engine: EngineCore, inbox: Inbox, clock: StepClock, publish: Publish, *,
                  heartbeat_s: float = 1.0) -> None:
    """Steps the engine while it has work, applying commands between steps, until the inbox is
    closed or the watchdog gives up on a step. Publishes what each step made, and at least every
    `heartbeat_s` while stepping. Exceptions of the loop itself propagate; either way every request
    left in the engine is aborted on the way out."""
    taken = 0
    published_at = time.monotonic()
    try:
        while True:
            commands = inbox.take(block=not engine.has_unfinished())
            if commands is None:
                return
            replies: list[AdapterReply] = []
            taken += apply_commands(engine, commands, replies)
            outputs = []
            if engine.has_unfinished():
                clock.steps += 1
                clock.step_started_at = time.monotonic()
                try:
                    outputs += engine.step()
                finally:
                    clock.step_started_at = None
            if clock.dead is not None:
                return  # the watchdog gave up on this step; the owner failed its requests
            now = time.monotonic()
            if outputs or commands or now - published_at >= heartbeat_s:
                publish(StepResult(outputs, engine.stats(), clock.steps, taken, replies))
                published_at = now
    finally:
        engine.abort_all()
        engine.close()
