"""Which requests advance this step, and by how many tokens.

One rule, no prefill/decode modes: every request has `num_computed_tokens` (K/V in the cache) and
`num_tokens` (prompt + output); a step gives each request up to `num_tokens - num_computed_tokens`
tokens from a shared token budget. A decode is one token; a prompt longer than the budget is
prefilled in chunks over several steps; a batch can mix both.

The engine loop around it:
    out = scheduler.schedule()
    ... run the model on out.scheduled, sample for those with `sample` ...
    scheduler.update_after_step(out)        # advances num_computed_tokens
    ... append sampled tokens; scheduler.finish(req, status) for requests that are done ...

Order within a step: running decodes, then running prefills (chunked to what is left of the
budget), then admissions. So a long prompt arriving mid-stream never stalls the streams already
decoding: each step holds one decode per running stream and a chunk of the prompt.

Admission looks up the request's longest cached prefix (block_manager.py): those tokens count as
computed and are never scheduled. For n > 1, samples 1..n-1 wait (skipped, not blocking the queue)
until sample 0 has computed the prompt; then they hit the cache for every full prompt block and
compute only the rest (at least one token, for the logits). Without prefix caching they prefill
independently.

When blocks run out, the running request that arrived last is preempted (ties: admitted last): its
blocks are freed (cached ones stay reusable) and it re-enters the waiting queue in arrival order
with `num_computed_tokens = 0`. It keeps its output tokens; when it is admitted again its "prefill"
recomputes prompt + outputs (hitting the cache where the blocks survived) and then samples the next
token. Choosing by arrival, not admission, means an old request that was re-admitted is never the
victim of newer ones, so nothing starves.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import structlog

from engine.block_manager import BlockManager
from engine.request import Request, RequestStatus

log = structlog.get_logger(__name__)


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # tokens of the request run through the model this step (>= 1)
    start: int  # their first position: num_computed_tokens before the step
    sample: bool  # start + num_new_tokens == num_tokens: this step produces the next token
    # Physical block ids this step adds to the end of the request's table (usually none for a
    # decode). With `new_table` they are the whole table: the request was (re)admitted.
    new_block_ids: tuple[int, ...]
    new_table: bool


@dataclass(slots=True)
class SchedulerOutput:
    # Requests that run this step: running decodes, running prefills (admission order within
    # each), then newly admitted ones.
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    # Requests preempted this step (blocks freed, back in the waiting queue in arrival order).
    preempted: list[Request] = field(default_factory=list)
    # Sum of num_new_tokens over `scheduled`; at most max_num_batched_tokens.
    num_batched_tokens: int = 0
    # Requests finished (or aborted) since the last output that scheduled anything: their tables
    # are gone. (An output with nothing scheduled is not run, so it passes these on.)
    finished_ids: list[str] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class BlockTables:
    """A consumer's copy of every scheduled request's block table, kept current from the changes
    each SchedulerOutput carries (the runner's view; the block manager's lists are never shared).
    Apply every output that schedules something, in order."""

    def __init__(self) -> None:
        self._tables: dict[str, list[int]] = {}

    def apply(self, out: SchedulerOutput) -> list[list[int]]:
        """Takes in the step's changes; returns the tables of `out.scheduled`, in order."""
        tables = self._tables
        for request_id in out.finished_ids:
            tables.pop(request_id, None)
        for request in out.preempted:
            tables.pop(request.request_id, None)
        rows = []
        for s in out.scheduled:
            rid = s.request.request_id
            if s.new_table:
                table = tables[rid] = list(s.new_block_ids)
            else:
                table = tables[rid]
                if s.new_block_ids:
                    table.extend(s.new_block_ids)
            rows.append(table)
        return rows

    def __len__(self) -> int:
        return len(self._tables)

    def __getitem__(self, request_id: str) -> list[int]:
        return self._tables[request_id]


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        *,
        max_num_seqs: int,  # requests running at once (batch rows of a decode step)
        max_num_batched_tokens: int,  # tokens per step across all requests (bounds step latency)
        max_model_len: int,  # prompt + output tokens of one request at most
    ) -> None:
        if min(max_num_seqs, max_num_batched_tokens, max_model_len) < 1:
            raise ValueError("max_num_seqs, max_num_batched_tokens and max_model_len must be >= 1")
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()  # FIFO; preempted requests re-enter by arrival time
        self.running: list[Request] = []  # admission order; the latest arrival is preempted first
        self.requests: dict[str, Request] = {}  # every unfinished request, waiting or running
        self._finished_ids: list[str] = []  # finished since the last output that scheduled anything
        self.num_preemptions = 0  # cumulative, for stats

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add_request(self, request: Request) -> None:
        """Queue a new request (ValueError for a duplicate id). Whether it can ever fit is the
        engine's check before this (engine.validation.check_request): prompt + max_tokens within
        max_model_len and within the whole pool."""
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_ids=self._finished_ids)
        self._finished_ids = []
        budget = self.max_num_batched_tokens
        scheduled: dict[str, ScheduledRequest] = {}

        # 1. Running requests: decodes first (one token each, so every stream advances each step),
        # then prefills (their chunks take what is left of the budget), admission order within each.
        # When blocks run out, preempt the latest arrival until this one fits (or it is the latest).
        # (A length-capped request only waits for its last id to be read back: async scheduling.)
        # (This loop runs for every running request each step: counts are read inline.)
        decodes, prefills = [], []
        for r in self.running:
            remaining = (len(r.prompt_token_ids) + len(r.output_token_ids) + r.num_output_placeholders
                         - r.num_computed_tokens)
            if remaining > 1:
                prefills.append((r, remaining))
            elif remaining == 1 and not r.length_capped:
                decodes.append((r, 1))
        allocate = self.block_manager.allocate_slots
        for request, remaining in decodes + prefills if prefills else decodes:
            if budget <= 0:
                break
            if request.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this step
            num_new = min(remaining, budget)
            while (new_blocks := allocate(request, num_new)) is None:
                victim = self._pick_victim()
                if victim is not request and victim.request_id in scheduled:
                    # Already given tokens this step: take them back.
                    s = scheduled.pop(victim.request_id)
                    out.scheduled.remove(s)
                    out.num_batched_tokens -= s.num_new_tokens
                    budget += s.num_new_tokens
                self.running.remove(victim)
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is request:
                    break
            if new_blocks is None:  # it was the latest arrival: preempted itself
                continue
            scheduled[request.request_id] = self._schedule(out, request, num_new, new_blocks, False)
            budget -= num_new

        # 2. Admit waiting requests in FIFO order; none after a preemption (memory is short), and
        # none past the first that does not fit (head-of-line, so big requests are not starved).
        # Samples 2..n of a prompt are skipped while sample 0 still computes that prompt.
        i = 0
        while (not out.preempted and i < len(self.waiting) and budget > 0
               and len(self.running) < self.max_num_seqs):
            request = self.waiting[i]
            if self._held_back(request):
                i += 1
                continue
            cached = None
            if request.num_computed_tokens == 0:
                cached = self.block_manager.find_cached_prefix(request)
            num_cached = 0 if cached is None else cached.num_blocks * self.block_manager.block_size
            num_new = min(request.num_remaining_tokens - num_cached, budget)
            new_blocks = self.block_manager.allocate_slots(request, num_new, cached)
            if new_blocks is None:
                break
            del self.waiting[i]
            request.num_computed_tokens += num_cached
            request.status = RequestStatus.RUNNING
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
                request.num_cached_tokens = min(num_cached, request.num_prompt_tokens)
            self.running.append(request)
            self._schedule(out, request, num_new, new_blocks, True)
            budget -= num_new
        if not out.scheduled:  # not run: the next output that is carries these
            self._finished_ids[:0] = out.finished_ids
        return out

    def _held_back(self, request: Request) -> bool:
        """True while the request waits for its sample 0 to compute the shared prompt."""
        leader = request.wait_for
        if leader is None:
            return False
        if (not self.block_manager.enable_caching or leader.finished
                or leader.num_computed_tokens >= leader.num_prompt_tokens):
            request.wait_for = None
            return False
        return True

    def _pick_victim(self) -> Request:
        """The running request that arrived last (ties: admitted last). Preempting by arrival, not
        admission, means a re-admitted old request is never the victim of newer ones: nothing
        starves."""
        return max(enumerate(self.running), key=lambda ir: (ir[1].arrival_time, ir[0]))[1]

    def _schedule(self, out: SchedulerOutput, request: Request, num_new: int, new_blocks: tuple[int, ...],
                  admitted: bool) -> ScheduledRequest:
        start = request.num_computed_tokens
        s = ScheduledRequest(request, num_new, start, start + num_new == request.num_tokens, new_blocks, admitted)
        out.scheduled.append(s)
        out.num_batched_tokens += num_new
        return s

    def _preempt(self, request: Request) -> None:
        self.block_manager.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        # Back into the waiting queue in arrival order (ahead of everything that came later).
        pos = next((j for j, w in enumerate(self.waiting) if w.arrival_time > request.arrival_time),
                   len(self.waiting))
        self.waiting.insert(pos, request)
        log.info("preempted", request_id=request.request_id,
                 num_preemptions=request.num_preemptions, num_tokens=request.num_tokens)

    def update_after_step(self, out: SchedulerOutput) -> None:
        """Mark the scheduled tokens as computed. The engine then appends the sampled token of
        each request with `sample` and calls `finish` for those that are done."""
        for s in out.scheduled:
            if not s.request.finished:  # aborted while the step ran
                s.request.num_computed_tokens += s.num_new_tokens
                self.block_manager.cache_full_blocks(s.request)

    def finish(self, request: Request, status: RequestStatus) -> None:
        """End a request (status must be a FINISHED_* one) and give back its blocks."""
        assert status.finished, f"{status.name} is not a finished status"
        if self.requests.pop(request.request_id, None) is None:
            return  # already finished
        request.status = status
        if request in self.running:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self.block_manager.free(request)
        self._finished_ids.append(request.request_id)

    def abort(self, request_id: str) -> Request | None:
        """Finish the request as FINISHED_ABORTED wherever it is; None if it is unknown or done."""
        request = self.requests.get(request_id)
        if request is not None:
            self.finish(request, RequestStatus.FINISHED_ABORTED)
        return request
