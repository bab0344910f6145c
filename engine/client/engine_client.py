"""The seam between the service and the engine core: `EngineClient`, what the service may use.

Two implementations stand behind it: the core on a thread of the server process
(`client_thread.ThreadEngineClient`) and the core in a process of its own
(`client_process.ProcessEngineClient`). Both share `EngineClientBase`, the asyncio side:

    service (asyncio loop)                        core loop (engine/core/loop.py)
      submit(prompt, sampling, caller_id=...)
        validates it (the one place requests are checked), mints the engine's own id ("r17")
                                       ------>   AddRequest("r17", prompt, sampling)
        returns a RequestStream keyed by it
      abort(stream) --------------------------->   AbortRequest("r17")
      RequestStream.next_batch() <- _on_result <-   StepResult: one step's outputs, the counts

Ids: the engine, the commands and the stream table know only ids this client minted, never the
caller's. So a caller may reuse an id at once after a cancel (outputs of the cancelled request,
still on their way, find no stream and are dropped) and two callers may send the same id at the
same time; each stream gets exactly its own request's outputs. The caller's id is data carried
along (`RequestStream.caller_id`) for the response, headers, logs and metrics.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import msgspec
import structlog

from pie.model.lora import AdapterError

from ..errors import EngineDeadError, QueueFullError, RequestAbortedError
from ..limits import check_request
from ..messages import (
    AbortRequest,
    AdapterCommand,
    AdapterReply,
    AddRequest,
    Command,
    EngineInfo,
    EngineStats,
    RequestOutput,
    RequestStatus,
    StepResult,
)
from ..sample.structured import GrammarCompiler
from ..sampling_params import SamplingParams, StructuredOutputParams
from ..scheduling.adapters import AdapterNotFoundError

if TYPE_CHECKING:
    from pie.model.tokenizer import Tokenizer

log = structlog.get_logger(__name__)


class RequestStream:
    """The asyncio end of one request: outputs pushed by the engine loop, read by the RPC."""

    __slots__ = ("engine_id", "caller_id", "_pending", "_event", "finished", "cancelled")

    def __init__(self, engine_id: str, caller_id: str) -> None:
        self.engine_id = engine_id  # minted by the client; what the engine core and the pipe know
        self.caller_id = caller_id  # the caller's id (response, x-request-id, logs, metrics)
        self._pending: list[RequestOutput] = []
        self._event = asyncio.Event()
        self.finished = False
        self.cancelled = False  # `cancel()`ed: its reader gets RequestAbortedError

    def _put(self, output: RequestOutput) -> None:
        self._pending.append(output)
        self.finished = self.finished or bool(output.all_finished)
        self._event.set()

    def cancel(self) -> None:
        """Ends the stream from elsewhere (an Abort call, after `EngineClient.abort` stopped the
        request): the reader's `next_batch` raises RequestAbortedError, now or when it next waits."""
        self.cancelled = True
        self._event.set()

    async def next_batch(self) -> list[RequestOutput]:
        """Waits for at least one output and returns every output delivered so far (coalesced:
        a slow reader gets fewer, larger batches instead of a growing backlog). Raises
        RequestAbortedError once the stream is cancelled, outputs still pending or not."""
        await self._event.wait()
        if self.cancelled:
            raise RequestAbortedError(f"request {self.caller_id} ({self.engine_id}) was aborted")
        batch, self._pending = self._pending, []
        self._event.clear()
        return batch


class EngineClient(Protocol):
    """What the service may use of an engine, wherever its loop runs. `launch()` builds the
    engine (blocking: call it off the event loop), `start(loop)` begins serving; every other
    method is called on that loop."""

    dead: BaseException | None  # why the engine stopped serving for good; None while it serves

    @property
    def loaded(self) -> bool: ...
    @property
    def info(self) -> EngineInfo: ...
    @property
    def tokenizer(self) -> Tokenizer: ...

    def launch(self) -> None: ...
    def start(self, loop: asyncio.AbstractEventLoop) -> None: ...
    def stop(self, timeout: float | None = 10.0) -> None: ...
    def declare_dead(self, error: BaseException) -> None: ...

    @property
    def steps(self) -> int: ...
    @property
    def num_in_flight(self) -> int: ...
    @property
    def num_queued(self) -> int: ...
    def stats(self) -> EngineStats: ...
    def check_request(self, prompt_token_ids: list[int], sampling: SamplingParams) -> None: ...
    def structured_known(self, params: StructuredOutputParams) -> bool: ...
    def check_structured(self, params: StructuredOutputParams) -> None: ...
    def submit(self, prompt_token_ids: list[int], sampling: SamplingParams, *, caller_id: str,
               priority: int = 0, streamed: bool = False, adapter: str | None = None) -> RequestStream: ...
    def abort(self, stream: RequestStream) -> None: ...
    async def wait_idle(self) -> None: ...
    @property
    def adapter_names(self) -> list[str]: ...
    async def load_adapter(self, name: str, path: str) -> None: ...
    async def unload_adapter(self, name: str) -> None: ...


class EngineClientBase:
    """The asyncio side both handles share: id minting, the stream table, admission against the
    waiting-queue bound, delivery of outputs and failing what is open when the engine dies.
    Subclasses build the engine (`launch`), run its loop (`start`/`stop`) and carry commands to it
    (`_send`); they hand each step's result to `_on_result` on the event loop."""

    def __init__(self, *, on_dead: Callable[[BaseException], None] | None = None) -> None:
        self._info: EngineInfo | None = None  # set by launch()
        self._tokenizer: Tokenizer | None = None  # the parent's own copy: tokenizing needs no round trip
        # Structured outputs are compiled here too, to refuse one that does not compile before it is
        # queued (the engine's own compiler, where the engine runs in this process).
        self._grammars: GrammarCompiler | None = None
        self.dead: BaseException | None = None
        self._steps = 0  # as of the engine loop's latest message
        self._on_dead = on_dead or (lambda error: None)
        self._ids = itertools.count()
        self._streams: dict[str, RequestStream] = {}  # engine id -> stream
        self._stats: EngineStats | None = None  # the engine's snapshot after its latest step
        self._sent = 0  # samples in add commands sent to the engine loop
        self._taken = 0  # of those, taken in by the loop (as of its latest step)
        # The adds on their way, in the order sent: (samples, priority, adapter), until the loop takes them.
        self._in_transit: deque[tuple[int, int, str | None]] = deque()
        # LoRA adapters requests may name (None until first read: those of the engine's config), and
        # the load / unload commands awaiting the loop's reply, by command id.
        self._adapters: set[str] | None = None
        self._adapter_ids = itertools.count()
        self._adapter_replies: dict[int, asyncio.Future[AdapterReply]] = {}
        self._in_transit_from = 0  # samples sent before the oldest entry of _in_transit
        self._loop: asyncio.AbstractEventLoop | None = None
        self._idle = asyncio.Event()  # set while no request is in flight (drain waits on it)
        self._idle.set()
        self._busy_since = 0.0  # monotonic time the latest request arrived to no other in flight
        self._stopping = False

    # ---- what the service reads ------------------------------------------------------------
    @property
    def loaded(self) -> bool:
        """launch() has built the engine: info, tokenizer and stats are there."""
        return self._info is not None

    @property
    def info(self) -> EngineInfo:
        if self._info is None:
            raise RuntimeError("the engine is not loaded")
        return self._info

    @property
    def tokenizer(self) -> Tokenizer:
        if self._tokenizer is None:
            raise RuntimeError("the engine is not loaded")
        return self._tokenizer

    @property
    def steps(self) -> int:
        """Engine steps begun so far."""
        return self._steps

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    @property
    def num_queued(self) -> int:
        """Samples (a request of n > 1 counts n) sent to the engine loop and not taken in yet."""
        return self._sent - self._taken

    def stats(self) -> EngineStats:
        """The engine's counts after its latest step; waiting includes what is on its way to it
        (by priority, and by adapter: an adapter with a request on its way has one waiting)."""
        stats = self._loaded_stats()
        if not self._in_transit:
            return stats
        by_priority = dict(stats.requests_waiting_by_priority)
        by_adapter: dict[str, int] = {}
        for samples, priority, adapter in self._in_transit:
            by_priority[priority] = by_priority.get(priority, 0) + samples
            if adapter is not None:
                by_adapter[adapter] = by_adapter.get(adapter, 0) + samples
        adapters = [msgspec.structs.replace(a, waiting=a.waiting + by_adapter[a.name]) if a.name in by_adapter else a
                    for a in stats.adapters]
        return msgspec.structs.replace(stats, requests_waiting=stats.requests_waiting + self.num_queued,
                                       requests_waiting_by_priority=by_priority, adapters=adapters)

    def check_request(self, prompt_token_ids: list[int], sampling: SamplingParams) -> None:
        """Raises RequestError for a request this engine could never serve."""
        info = self.info
        check_request(prompt_token_ids, sampling, config=info.config, vocab_size=info.vocab_size,
                      max_model_len=info.max_model_len, num_kv_blocks=info.num_kv_blocks)

    @property
    def adapter_names(self) -> list[str]:
        """The LoRA adapters requests may name now (loaded, not being unloaded)."""
        return sorted(self._adapter_set())

    def _adapter_set(self) -> set[str]:
        if self._adapters is None:
            self._adapters = {name for name, _ in self.info.config.loras}
        return self._adapters

    async def load_adapter(self, name: str, path: str) -> None:
        """Loads a LoRA adapter from a PEFT folder (AdapterError naming it when it cannot be
        served); requests may name it once this returns."""
        await self._adapter_command(name, path)
        self._adapter_set().add(name)

    async def unload_adapter(self, name: str) -> None:
        """From now on no request may name it; those running on it finish. AdapterNotFoundError
        for a name not loaded. (The loop applies commands in order: every add sent before this
        unload still finds the adapter.)"""
        if name not in self._adapter_set():
            raise AdapterNotFoundError(name, "not loaded")
        self._adapter_set().discard(name)
        await self._adapter_command(name, None)

    async def _adapter_command(self, name: str, path: str | None) -> None:
        if self.dead is not None or self._stopping or self._loop is None:
            raise EngineDeadError("the engine is not running")
        command_id = next(self._adapter_ids)
        reply = self._adapter_replies[command_id] = self._loop.create_future()
        self._send(AdapterCommand(command_id, name, path))
        done = await reply
        if done.error is not None:
            raise (AdapterNotFoundError if done.not_found else AdapterError)(name, done.error)

    def structured_known(self, params: StructuredOutputParams) -> bool:
        """`params` has been compiled here already: check_structured answers at once."""
        return self._grammar_compiler().cached(params) is not None

    def check_structured(self, params: StructuredOutputParams) -> None:
        """Raises RequestError (`structured.json_schema`, ..., with the compiler's message)
        when `params` does not compile. Compiles unless cached: blocking, so off the event loop."""
        self._grammar_compiler().check(params)

    def _grammar_compiler(self) -> GrammarCompiler:
        if self._grammars is None:
            raise RuntimeError("the engine is not loaded")
        return self._grammars

    async def wait_idle(self) -> None:
        """Returns once no request is in flight (used to drain before shutting down)."""
        await self._idle.wait()

    # ---- requests in and out ----------------------------------------------------------------
    def submit(self, prompt_token_ids: list[int], sampling: SamplingParams, *, caller_id: str,
               priority: int = 0, streamed: bool = False, adapter: str | None = None) -> RequestStream:
        """Queues a request under an id of the engine's own, at `priority` (lower first); `streamed`
        when its caller reads tokens as they come (EngineCore.add_request); on the LoRA `adapter`
        of that name (None: the base model). Raises RequestError for a request that can never be
        served, AdapterNotFoundError for an adapter the engine has not loaded, QueueFullError when
        the waiting queue is full, EngineDeadError when the engine is not running."""
        if self.dead is not None or self._stopping or self._loop is None:
            raise EngineDeadError("the engine is not running")
        self.check_request(prompt_token_ids, sampling)
        if adapter is not None and adapter not in self.adapter_names:
            raise AdapterNotFoundError(adapter, "not loaded")
        # Requests the engine has not taken in yet may fill free batch slots at once, so a burst
        # into an idle engine is not shed early; in flight stays <= max_num_seqs + max_waiting.
        # Counted in samples, as the scheduler counts them: a request of n > 1 takes n places.
        cfg, stats = self.info.config, self._loaded_stats()
        waiting = stats.requests_waiting + self.num_queued
        headroom = max(0, cfg.max_num_seqs - stats.requests_running)
        if waiting + sampling.n > cfg.max_waiting + headroom:
            raise QueueFullError(f"{waiting} requests are waiting (bound {cfg.max_waiting})")
        engine_id = f"r{next(self._ids)}"
        stream = RequestStream(engine_id, caller_id)
        if not self._streams:
            self._busy_since = time.monotonic()
        self._streams[engine_id] = stream
        self._idle.clear()
        self._sent += sampling.n
        self._in_transit.append((sampling.n, priority, adapter))
        self._send(AddRequest(engine_id, prompt_token_ids, sampling, priority, streamed, adapter))
        return stream

    def abort(self, stream: RequestStream) -> None:
        """Stops the request within one step and frees its blocks; its stream gets nothing more.
        Idempotent; a request that already finished is left alone."""
        if self._forget(stream.engine_id) is None:
            return
        self._send(AbortRequest(stream.engine_id))

    def _send(self, command: Command) -> None:
        raise NotImplementedError

    def _forget(self, engine_id: str) -> RequestStream | None:
        stream = self._streams.pop(engine_id, None)
        if not self._streams:
            self._idle.set()
        return stream

    def _on_result(self, result: StepResult) -> None:
        """On the event loop: one step's outputs (or the acknowledgement of commands) arrived."""
        self._stats, self._steps, self._taken = result.stats, result.steps, result.taken
        while self._in_transit and self._in_transit_from + self._in_transit[0][0] <= self._taken:
            self._in_transit_from += self._in_transit.popleft()[0]
        self._deliver(result.outputs)
        for reply in result.adapter_replies:
            waiting = self._adapter_replies.pop(reply.command_id, None)
            if waiting is not None and not waiting.done():
                waiting.set_result(reply)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for o in outputs:
            stream = self._streams.get(o.request_id)
            if stream is None:
                continue  # aborted by its caller after the step began
            stream._put(o)
            if o.all_finished:  # with n > 1, `finished` only ends one sample
                self._forget(o.request_id)

    # ---- when the engine stops ------------------------------------------------------------
    def declare_dead(self, error: BaseException) -> None:
        """The engine cannot serve again (a hung step, a crashed loop, a lost process). From any
        thread: the owner hears first (readiness off, exit flagged), then every open stream fails
        on the loop, so a caller that sees its RPC fail finds the server already marked."""
        if self.dead is not None:
            return
        self.dead = error
        log.error("engine_dead", error=str(error))
        self._on_dead(error)
        self._fail_open_streams_soon()

    def _fail_open_streams_soon(self) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._fail_open_streams)

    def _fail_open_streams(self) -> None:
        status = RequestStatus.FINISHED_ERROR if self.dead is not None else RequestStatus.FINISHED_ABORTED
        error = str(self.dead) if self.dead is not None else None
        self._deliver([RequestOutput(engine_id, [], "", finished=True, status=status, error=error, all_finished=True)
                       for engine_id in list(self._streams)])
        for waiting in self._adapter_replies.values():
            if not waiting.done():
                waiting.set_exception(EngineDeadError(error or "the engine stopped"))
        self._adapter_replies.clear()

    def _event_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            raise RuntimeError("start() the engine first")
        return self._loop

    def _loaded_stats(self) -> EngineStats:
        if self._stats is None:
            raise RuntimeError("the engine is not loaded")
        return self._stats
