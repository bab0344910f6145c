"""Structured output: constraints compiled into llguidance matchers, one matcher per sample, and
each step's token masks filled for the batch.

    SamplingParams.structured ──GrammarCompiler──> a compiled matcher, cached by the constraint
                               (worker thread: compiling drops the GIL; the request waits for it
                                in the queue, not the step)
    Request.grammar: GrammarState ── deep copy of one of its replicas: this sample's parser state
    each step: StructuredOutputs.fill(rows) ──> TokenMasks (S, ceil(V/32)) int32 on the host, one
               bit per token, filled in parallel by llguidance's executor; the runner copies them
               to the device and forbids the rest (kernels: apply_token_bitmask_) before sampling
    each token read back: Scheduler.update_from_output -> StructuredOutputs.consume: the matcher
               advances with the token the request appended; a matcher that can take nothing more
               ends the request (finished, STOP)

The tokenizer llguidance sees is the model's tokenizer.json with the model's vocabulary size (the
logits' width: rows past the tokenizer are never allowed) and every end-of-sequence id of the
model as its EOS: where the constraint is complete, the mask allows each of them, so the model
ends its turn with the id it prefers (a chat model's end-of-turn, not end-of-text).

Replicas: llguidance's deep copy of a matcher shares the original's lexer (its lazily built
automaton) behind one lock, taken for each mask. Copies of one matcher therefore fill their masks
one at a time whatever the executor's threads (a step's rows cost as many fills in a row, however
many threads), and a batch constrained by one schema is the common case. So a constraint is
compiled into as many independent matchers as the
executor has threads (the first on demand, the rest in the background), samples take copies of
them in turn, and a fill orders its rows by replica.

The service compiles each constraint once more in its own process (EngineClient.check_structured,
off its event loop) to refuse one that does not compile with the compiler's message; the engine's
copy then only meets valid constraints, and one that is not fails its request (FINISHED_ERROR).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import llguidance
import torch

from ..config import usable_cores
from ..errors import RequestError
from ..sampling_params import StructuredOutputParams

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

# Compiled constraints kept, least recently used dropped first (a matcher holds its lexer's
# states: kilobytes to megabytes).
MAX_CACHED_GRAMMARS = 256
_ANY_OBJECT = '{"type": "object"}'
# JSON's layout unless the schema's "x-guidance" says otherwise: json.dumps' separators and no other
# whitespace. Where any whitespace may come between tokens (llguidance's default), models run into
# long runs of newlines (a story model wrote 50 of them after a key and hit max_tokens every time).
JSON_LAYOUT: JsonCompileOptions = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def grammar_of(params: StructuredOutputParams) -> str:
    """The llguidance grammar (its JSON form) of a constraint; RequestError for a JSON
    schema that is not JSON (the compiler reports everything else)."""
    if params.kind == "json_schema":
        try:
            schema = json.loads(params.text)
        except ValueError as e:
            raise RequestError(params.field, f"is not JSON: {e}") from None
        if not isinstance(schema, (dict, bool)):
            raise RequestError(params.field, f"must be a JSON object (a schema), got {type(schema).__name__}")
        if schema is False:
            raise RequestError(params.field, "the schema false admits no value")
        # The schema true is {} (any JSON value): the compiler takes its layout options from an object.
        return llguidance.LLMatcher.grammar_from_json_schema("{}" if schema is True else params.text,
                                                             defaults=JSON_LAYOUT)
    if params.kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema(_ANY_OBJECT, defaults=JSON_LAYOUT)
    if params.kind == "regex":
        # Rust's regex syntax, with \d as [0-9]: Rust's (and Python's) \d takes every Unicode
        # digit, and a random model at temperature 1 did write a date in Javanese digits.
        return llguidance.LLMatcher.grammar_from_lark(f"start: /{llguidance.regex_to_lark(params.text, 'd')}/")
    if params.kind == "grammar":
        return llguidance.LLMatcher.grammar_from_lark(params.text)
    if params.kind == "choice":
        # Lark string literals take JSON's escapes: each choice matched exactly, whatever it holds.
        return llguidance.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in params.choices))
    raise RequestError("structured", f"unknown kind {params.kind!r}")


class Compiled:
    """A constraint's independent matchers (module docstring: replicas), the first compiled on
    demand and the rest appended by the compiler's thread; `take` hands out copies in turn."""

    __slots__ = ("matchers", "_turn")

    def __init__(self, first: llguidance.LLMatcher) -> None:
        self.matchers = [first]
        self._turn = 0

    def take(self) -> tuple[llguidance.LLMatcher, int]:
        """A new sample's matcher: a deep copy of the next replica, and that replica's index."""
        i = self._turn % len(self.matchers)
        self._turn += 1
        return self.matchers[i].deep_copy(), i


class GrammarCompiler:
    """Compiles constraints for one tokenizer, each once: results (`Compiled`, or the error) are
    cached by the constraint. Thread-safe; `submit` compiles on a worker thread of its own, which
    also builds a constraint's other `replicas` after its first matcher."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: tuple[int, ...], *,
                 max_cached: int = MAX_CACHED_GRAMMARS, replicas: int = 1) -> None:
        self.vocab_size = vocab_size  # the logits' width: the masks' bits
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size,
                                                eos_token=list(eos_token_ids) if eos_token_ids else None)
        self._max_cached = max_cached
        self.replicas = replicas
        self._cache: OrderedDict[StructuredOutputParams, Future[Compiled]] = OrderedDict()
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None

    def _worker(self) -> ThreadPoolExecutor:
        if self._pool is None:
            with self._lock:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")
        return self._pool

    def _entry(self, params: StructuredOutputParams, compile_now: bool) -> Future[Compiled]:
        with self._lock:
            future = self._cache.get(params)
            if future is not None:
                self._cache.move_to_end(params)
                return future
            future = Future()
            self._cache[params] = future
            while len(self._cache) > self._max_cached:
                self._cache.popitem(last=False)
        if compile_now:
            self._compile_into(params, future)
        else:
            self._worker().submit(self._compile_into, params, future)
        return future

    def _compile_into(self, params: StructuredOutputParams, future: Future) -> None:
        """Settles `future` with the compiled matcher or the reason it cannot be: always, since
        every request of that constraint waits on it."""
        try:
            grammar = grammar_of(params)
            # Never raises for a bad grammar: the matcher is then in an error state, saying why.
            matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        except RequestError as e:
            future.set_exception(e)
        except Exception as e:  # the grammar builders' ValueError for malformed input, or worse
            future.set_exception(RequestError(params.field, f"{type(e).__name__}: {e}"))
        else:
            if matcher.is_error():
                future.set_exception(RequestError(params.field, matcher.get_error().strip()))
            else:
                compiled = Compiled(matcher)
                if self.replicas > 1:  # queued first: work submitted once the result is out runs after it
                    self._worker().submit(self._replicate, grammar, compiled)
                future.set_result(compiled)

    def _replicate(self, grammar: str, compiled: Compiled) -> None:
        for _ in range(self.replicas - 1):
            compiled.matchers.append(llguidance.LLMatcher(self.tokenizer, grammar, log_level=0))

    def cached(self, params: StructuredOutputParams) -> Future[Compiled] | None:
        """The finished compilation of `params` if there is one (no compiling here)."""
        with self._lock:
            future = self._cache.get(params)
        return future if future is not None and future.done() else None

    def compile(self, params: StructuredOutputParams) -> llguidance.LLMatcher:
        """The compiled matcher of `params` (shared: deep-copy it before use), compiling it on this
        thread unless cached; raises RequestError."""
        return self._entry(params, compile_now=True).result().matchers[0]

    def check(self, params: StructuredOutputParams) -> None:
        """Raises RequestError when `params` does not compile."""
        self.compile(params)

    def submit(self, params: StructuredOutputParams) -> Future[Compiled]:
        """The compilation of `params`, started on the worker thread unless cached."""
        return self._entry(params, compile_now=False)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


class GrammarState:
    """One sample's constraint: its compilation, then its own matcher (a copy of the compiled one)
    that advances with each token the sample appends."""

    __slots__ = ("_future", "matcher", "replica", "error")

    def __init__(self, future: Future[Compiled]) -> None:
        self._future = future
        self.matcher: llguidance.LLMatcher | None = None
        self.replica = 0  # which of the constraint's replicas it copies (fills order rows by it)
        self.error: str | None = None  # why the sample cannot go on (a bad constraint, a rejected token)

    @property
    def ready(self) -> bool:
        """Compiled (or failed): the sample can be scheduled. Takes its copy of the matcher."""
        if self.matcher is not None or self.error is not None:
            return True
        if not self._future.done():
            return False
        try:
            self.matcher, self.replica = self._future.result().take()
        except RequestError as e:
            self.error = str(e)
        return True

    @property
    def pending(self) -> Future | None:
        """The compilation still running, if any."""
        return None if self._future.done() else self._future

    @property
    def finished(self) -> bool:
        """The matcher can take nothing more but an end-of-sequence: the output is complete."""
        return self.matcher is not None and self.matcher.is_stopped()


class Constrained(Protocol):
    """What mask filling reads of a request (engine.scheduling.request.Request has it)."""

    grammar: GrammarState | None
    spec_token_ids: list[int]  # speculative proposals in flight (engine/spec_decode/speculator.py)


@dataclass(slots=True)
class TokenMasks:
    """One step's token masks, on the host (pinned with CUDA): row s of `bitmask` constrains
    sampling row rows[s]."""

    bitmask: torch.Tensor  # (S, ceil(V/32)) int32: token v allowed when bit v % 32 of word v // 32 is set
    rows: torch.Tensor  # (S,) int32: the sampling rows they constrain, ascending


class StructuredOutputs:
    """The engine's side of structured output: compiles constraints (GrammarCompiler), fills each
    step's masks and advances the matchers, with llguidance's thread pool for both."""

    def __init__(self, compiler: GrammarCompiler, *, max_num_seqs: int, pin_memory: bool,
                 threads: int | None = None) -> None:
        self.compiler = compiler
        # Mask filling and token consumption run in parallel over the batch on llguidance's own
        # threads (Rust, no GIL). Default: the usable cores, at most 8.
        self.threads = threads or max(1, min(8, usable_cores()))
        self.executor = llguidance.LLExecutor(self.threads)
        compiler.replicas = self.threads  # a thread per independent matcher of a constraint (module docstring)
        words = -(-compiler.vocab_size // 32)
        # Two sets of buffers taken in turn, so that the host never writes a mask whose copy to the
        # device a queued step may still read (as the runner's pinned sample buffers).
        self._pin = pin_memory
        self._masks = [self._new_masks(max_num_seqs, words) for _ in range(2)]
        self._parity = 0

    def grammar_for(self, params: StructuredOutputParams) -> GrammarState:
        """A new sample's constraint (its compilation starts now unless cached)."""
        return GrammarState(self.compiler.submit(params))

    def fill(self, requests: Sequence[Constrained], proposals: bool = False) -> TokenMasks | None:
        """The masks of one step's sampling rows (`requests`, in row order); None when no row is
        constrained. A row whose constraint failed gets no mask: its request fails when its token
        is read back. `proposals`: a step that verifies speculative proposals, whose request i has
        1 + len(spec_token_ids) logits rows, masked as the matcher stands after each proposal."""
        if proposals:
            return self._fill_with_proposals(requests)
        rows = [i for i, r in enumerate(requests) if r.grammar is not None and r.grammar.matcher is not None]
        if not rows:
            return None
        self._parity ^= 1
        buffers = self._masks[self._parity]
        if len(rows) > buffers.rows.shape[0]:  # more sampling rows than max_num_seqs: grow
            buffers = self._masks[self._parity] = self._new_masks(len(rows), buffers.bitmask.shape[1])
        bitmask, row_index = buffers.bitmask[:len(rows)], buffers.rows[:len(rows)]
        pairs = []
        for s, i in enumerate(rows):
            grammar = requests[i].grammar
            assert grammar is not None and grammar.matcher is not None
            pairs.append((grammar.replica, grammar.matcher, s))
        # The executor's threads take runs of the list: a run of one replica's copies holds no
        # other thread up on that replica's lexer lock (module docstring)
        pairs.sort(key=lambda p: p[0])
        # What llguidance.torch.fill_next_token_bitmask_par does, without importing that module
        # (it pulls in torch._dynamo: seconds at start): row s at data_ptr + s * row bytes.
        assert bitmask.dtype == torch.int32 and bitmask.is_contiguous() and not bitmask.is_cuda
        self.executor.unsafe_compute_mask_ptr([(m, s) for _, m, s in pairs], bitmask.data_ptr(),
                                              bitmask.shape[1] * 4, bitmask.shape[0])
        row_index.copy_(torch.tensor(rows, dtype=torch.int32))
        return TokenMasks(bitmask, row_index)

    def _fill_with_proposals(self, requests: Sequence[Constrained]) -> TokenMasks | None:
        """`fill` of a verify step: llguidance advances each matcher through the request's proposals
        (mask after mask) and rolls it back. Rows past a proposal the matcher refuses keep an
        all-allowed mask: that proposal cannot be accepted, so nothing after it is read."""
        rows: list[int] = []
        plain, drafted = [], []  # llguidance takes rows without proposals apart
        at = 0
        for r in requests:
            spec = r.spec_token_ids
            grammar = r.grammar
            if grammar is not None and grammar.matcher is not None:
                if spec:
                    drafted.append((grammar.matcher, len(rows), list(spec)))
                else:
                    plain.append((grammar.matcher, len(rows)))
                rows.extend(range(at, at + 1 + len(spec)))
            at += 1 + len(spec)
        if not rows:
            return None
        self._parity ^= 1
        buffers = self._masks[self._parity]
        if len(rows) > buffers.rows.shape[0]:
            buffers = self._masks[self._parity] = self._new_masks(len(rows), buffers.bitmask.shape[1])
        bitmask, row_index = buffers.bitmask[:len(rows)], buffers.rows[:len(rows)]
        bitmask.fill_(-1)
        assert bitmask.dtype == torch.int32 and bitmask.is_contiguous() and not bitmask.is_cuda
        if plain:
            self.executor.unsafe_compute_mask_ptr(plain, bitmask.data_ptr(), bitmask.shape[1] * 4, bitmask.shape[0])
        if drafted:
            self.executor.unsafe_compute_mask_ptr_with_draft_token(drafted, bitmask.data_ptr(), bitmask.shape[1] * 4,
                                                                   bitmask.shape[0])
        row_index.copy_(torch.tensor(rows, dtype=torch.int32))
        return TokenMasks(bitmask, row_index)

    def _new_masks(self, rows: int, words: int) -> TokenMasks:
        return TokenMasks(torch.full((rows, words), -1, dtype=torch.int32, pin_memory=self._pin),
                          torch.zeros(rows, dtype=torch.int32, pin_memory=self._pin))

    def consume(self, pairs: list[tuple[GrammarState, int]]) -> None:
        """Each matcher takes its sample's new token; a matcher that refuses it records why."""
        live = [(g, g.matcher, t) for g, t in pairs if g.matcher is not None and g.error is None]
        if not live:
            return
        accepted = self.executor.consume_token_par([(m, t) for _, m, t in live])
        for (grammar, matcher, token), ok in zip(live, accepted):
            if not ok:
                grammar.error = (f"the structured output's matcher refused token {token}: "
                                 f"{matcher.get_error() or 'not allowed here'}")

    def close(self) -> None:
        self.compiler.close()
