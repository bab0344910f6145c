"""The engine core on a background thread of the server process (`pie serve --no-engine-process`).

    asyncio loop (the gRPC servicer)                     engine thread
      ThreadEngineClient.submit/abort -> Inbox -------->   run_core_loop: apply commands, step
      RequestStream.next_batch() <- _on_result <-------   publish: loop.call_soon_threadsafe

Simple and quick to start (tests use it), but the engine and the asyncio loop share one GIL; at
hundreds of streams `process.ProcessEngineClient` serves more.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

import structlog

from ..config import EngineConfig
from ..core.engine_core import EngineCore
from ..core.loop import Inbox, StepClock, Watchdog, run_core_loop, step_watchdog
from ..messages import Command, StepResult
from .engine_client import EngineClientBase

log = structlog.get_logger(__name__)


class ThreadEngineClient(EngineClientBase):
    """An EngineClient whose EngineCore runs on a thread of this process."""

    def __init__(self, config: EngineConfig | None, *, step_timeout_s: float | None = None,
                 on_dead: Callable[[BaseException], None] | None = None,
                 engine_setup: Callable[[EngineCore], None] | None = None) -> None:
        super().__init__(on_dead=on_dead)
        self.config = config
        self.core: EngineCore | None = None  # the engine itself (tests and benchmarks reach in)
        self._engine_setup = engine_setup  # called on the engine once built (tests, benchmarks)
        self._step_timeout_s = step_timeout_s
        self._inbox = Inbox()
        self._clock = StepClock()
        self._watchdog: Watchdog | None = None
        self._thread: threading.Thread | None = None

    @classmethod
    def around(cls, engine: EngineCore, **kwargs) -> ThreadEngineClient:
        """A client of an engine core built elsewhere (tests, offline tools)."""
        client = cls(None, **kwargs)
        client._adopt(engine)
        return client

    @property
    def steps(self) -> int:
        return self._clock.steps  # read live: the engine thread is in this process

    def launch(self) -> None:
        """Builds the engine (blocking: loading a model may take minutes)."""
        if self.config is None:
            raise RuntimeError("no EngineConfig to build an engine from")
        engine = EngineCore(self.config)
        if self._engine_setup is not None:
            self._engine_setup(engine)
        self._adopt(engine)

    def _adopt(self, engine: EngineCore) -> None:
        self.core = engine
        self._info = engine.info()
        self._tokenizer = engine.tokenizer
        self._grammars = engine.structured.compiler  # one cache: what the service checked, the engine reuses
        self._stats = engine.stats()

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        if self.core is None:
            raise RuntimeError("launch() the engine before start()")
        self._loop = loop or asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()
        if self._step_timeout_s is not None:
            self._watchdog = step_watchdog(self._clock, self._step_timeout_s, self.declare_dead)
            self._watchdog.start()

    def stop(self, timeout: float | None = 10.0) -> None:
        """Stops the loop after its current step; aborts whatever is left. A hung step is not
        waited for long: its thread may never return."""
        self._stopping = True
        if self._watchdog is not None:
            self._watchdog.stop()
        self._inbox.close()
        if self._thread is not None:
            self._thread.join(1.0 if self._clock.dead is not None else timeout)
        self._fail_open_streams_soon()

    def _send(self, command: Command) -> None:
        self._inbox.put(command)

    def _publish(self, result: StepResult) -> None:
        self._event_loop().call_soon_threadsafe(self._on_result, result)

    def _run(self) -> None:
        assert self.core is not None, "launch() first"
        try:
            run_core_loop(self.core, self._inbox, self._clock, self._publish)
        except BaseException as e:  # the loop itself broke: fail everyone rather than hang them
            log.exception("engine_loop_died")
            self.declare_dead(RuntimeError(f"the engine loop failed: {type(e).__name__}: {e}"))
