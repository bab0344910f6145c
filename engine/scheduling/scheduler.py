"""Which requests advance this step, and by how many tokens.

One rule, no prefill/decode modes: every request has `num_computed_tokens` (K/V in the cache) and
`num_tokens` (prompt + output); a step gives each request up to `num_tokens - num_computed_tokens`
tokens from a shared token budget. A decode is one token; a prompt longer than the budget is
prefilled in chunks over several steps; a batch can mix both.

The scheduler opens each step and closes it (as vLLM v1's `Scheduler.update_from_output`):

    out = scheduler.schedule()                       # which requests, how many tokens each
    pending = runner.launch(out)                     # the forward pass and the sample, queued
    scheduler.step_launched(out)                     # the tokens count as computed
    outputs = scheduler.update_from_output(pending.result())
                                                     # tokens appended, stops, blocks freed

With async scheduling (engine/core/engine_core.py) step N is launched before step N-1's tokens are read back:
`update_from_output` of N-1 comes first (so N-1's ids are known when N's full blocks are hashed),
then `step_launched(N)`, which gives each sampling row of N a placeholder token until it is read.

Order within a step: running decodes, then running prefills (chunked to what is left of the
budget), then admissions. So a long prompt arriving mid-stream never stalls the streams already
decoding: each step holds one decode per running stream and a chunk of the prompt.

Admission looks up the request's longest cached prefix (block_manager.py): those tokens count as
computed and are never scheduled. Where the host or disk tier holds more of it (engine/offload/), the
request waits for those blocks to be read back while the others run, and then hits them. A request collecting prompt logprobs skips that lookup (cached
positions have no logits) until it has them all; its chunks are listed in
`SchedulerOutput.prompt_logprobs` so the runner computes the logits of their prompt positions. For n > 1, samples 1..n-1 wait (skipped, not blocking the queue)
until sample 0 has computed the prompt; then they hit the cache for every full prompt block and
compute only the rest (at least one token, for the logits). Without prefix caching they prefill
independently. A request with structured output is skipped the same way until its constraint is
compiled (engine/sample/structured.py: compiling runs on a thread of its own, not in the step).

Priority: every request has one (lower first, 0 by default, as vLLM's). The waiting queue is kept
in (priority, arrival) order, so admission takes the most urgent first and requests of one
priority in arrival order.

When blocks run out, the running request of the least urgent priority that arrived last is
preempted (ties: admitted last): its blocks are freed (cached ones stay reusable) and it re-enters
the waiting queue in its (priority, arrival) place with `num_computed_tokens = 0`. It keeps its
output tokens; when it is admitted again its "prefill" recomputes prompt + outputs (hitting the
cache where the blocks survived) and then samples the next token. Choosing by arrival, not
admission, means an old request that was re-admitted is never the victim of newer ones of its
priority, so nothing starves within a priority. In the batch-invariant mode the recompute runs the
prompt in chunks and then the outputs one a step, each as the decode it first was (the decode
kernel), and a step's rows of a generated token come first, with the decodes: the same bits as
before the preemption.

Bounded stalls: with `stall_factor` > 0, the prompt tokens of a step with a streamed decode (one
whose caller reads tokens as they come, `Request.streamed`) are cut so that it is expected to take
at most `stall_factor` times the decode-only step of the batch it heads to (`_heading`;
engine/scheduling/stall.py), never below one block. A step whose decodes are all read whole (unary
calls, offline work) stalls nobody who watches: it takes the whole budget, as a step without
decodes does, so that throughput work pays nothing for the bound. With `stall_share` > 0 a step
the bound would cut may take the whole budget anyway while the streamed gaps it stalls stay within
that share of the streams' gaps (StallBudget): the few whole steps that admit most of a burst's
prompts while few streams decode buy back most of what the bound costs it.
"""

from __future__ import annotations

import itertools
import time
from concurrent.futures import Future
from typing import Protocol

import structlog

from ..messages import RequestOutput, RequestStatus, SampledToken
from ..sample.structured import StructuredOutputs
from .adapters import Adapters
from .block_manager import BlockManager
from .request import Request
from .request_table import RequestTable
from .stall import StallBound, StallBudget
from .step import ScheduledRequest, SchedulerOutput, StepOutput

log = structlog.get_logger(__name__)

_FAILED = RequestStatus.FINISHED_ERROR  # what Request.append_tokens returns for a refused token (a per-row test)


class Speculation(Protocol):
    """What the scheduler asks of speculative decoding (engine.spec_decode.speculator.Speculator, which
    imports this module: hence a protocol here, not an import)."""

    def active(self, num_decodes: int) -> bool: ...  # speculate in a step with this many decodes?

    def reserve(self, request: Request, budget: int) -> int: ...  # proposals for its decode (0..K)

    def record(self, k: int, accepted: int) -> None: ...  # a verified row: k proposed, `accepted` taken


def _invariant_rows(request: Request, computed: int) -> int:
    """The most tokens a row of `request` from position `computed` may take in the batch-invariant
    mode: the rest of its prompt (the extend kernel, whatever the chunk), else one. A generated
    token's K/V came from a decode step (the decode kernel, one query), so a request recomputed
    after preemption runs them again one a step, as decodes, and gets the same bits."""
    prompt = len(request.prompt_token_ids)
    return prompt - computed if computed < prompt else 1


class Scheduler(RequestTable):
    """Plans each step (`schedule`) and closes it (`step_launched`, `update_from_output`) over the
    engine's requests (RequestTable: where each one is, and how it leaves)."""

    def __init__(
        self,
        block_manager: BlockManager,
        *,
        max_num_seqs: int,  # requests running at once (batch rows of a decode step)
        max_num_batched_tokens: int,  # tokens per step across all requests (bounds step latency)
        max_model_len: int,  # prompt + output tokens of one request at most
        # A step with running decodes and prompt tokens: at most this many times a decode-only
        # step (StallBound; 0 = only max_num_batched_tokens bounds it).
        stall_factor: float = 0.0,
        # Share of the streams' inter-token gaps that steps past the bound may stall (StallBudget;
        # 0 = every step with a streamed decode is bounded).
        stall_share: float = 0.0,
        structured: StructuredOutputs | None = None,  # advances the matchers of structured outputs
        speculator: Speculation | None = None,  # speculative decoding's proposals (None: off)
        # The batch-invariant mode (EngineConfig.batch_invariant): a request recomputed after
        # preemption runs its generated tokens one a step, each as the decode it first was.
        batch_invariant: bool = False,
        adapters: Adapters | None = None,  # LoRA slots (engine/scheduling/adapters.py); None: no adapters
    ) -> None:
        if min(max_num_seqs, max_num_batched_tokens, max_model_len) < 1:
            raise ValueError("max_num_seqs, max_num_batched_tokens and max_model_len must be >= 1")
        super().__init__(block_manager, adapters)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.structured = structured
        self.speculator = speculator
        self.stall = StallBound(stall_factor, min_tokens=block_manager.block_size)
        self.stall_budget = StallBudget(stall_share)
        self.batch_invariant = batch_invariant

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        lower = self.block_manager.lower  # host and disk tiers (engine/offload/): read-backs land first
        if lower is not None:
            lower.poll()
        budget = self.max_num_batched_tokens
        scheduled: dict[str, ScheduledRequest] = {}

        # 1. Running requests: decodes first (one token each, so every stream advances each step),
        # then prefills (their chunks take what is left of the budget), admission order within each.
        # When blocks run out, preempt the latest arrival until this one fits (or it is the latest).
        # (A length-capped request only waits for its last id to be read back: async scheduling.)
        # (This loop runs for every running request each step: counts are read inline.)
        decodes, prefills = [], []
        context = 0  # the decodes' tokens of context (what their attention reads)
        streamed = 0  # decodes read as they come: a stall is a gap someone sees
        for r in self.running:
            remaining = (len(r.prompt_token_ids) + len(r.output_token_ids) + r.num_output_placeholders
                         - r.num_computed_tokens)
            if remaining > 1:
                prefills.append((r, remaining))
            elif remaining == 1 and not r.length_capped:
                decodes.append((r, 1))
                context += r.num_computed_tokens + 1
                streamed += r.streamed
        allocate = self.block_manager.allocate_slots
        # Prompt tokens (running prefills and admissions) beside this step's decodes, bounded by
        # the decode step of the batch the step heads to when a stream decodes in it.
        bound = self.stall.prompt_tokens(*self._heading(len(decodes), context, prefills)) if streamed else None
        cut = bound  # what the bound allows, kept when the stall budget lifts it
        if bound is not None and self.stall_budget.lifts(streamed, prefills, self.running, self.waiting,
                                                         self.max_num_batched_tokens):
            bound = None
        prompt_budget = budget if bound is None else bound
        speculator = self.speculator
        if speculator is not None and not speculator.active(len(decodes)):
            speculator = None  # too many decodes: verifying costs more than it saves
        for request, remaining in decodes + prefills if prefills else decodes:
            if budget <= 0:
                break
            if request.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this step
            num_new = min(remaining, budget) if remaining == 1 else min(remaining, budget, prompt_budget)
            if self.batch_invariant:
                num_new = min(num_new, _invariant_rows(request, request.num_computed_tokens))
            if num_new <= 0:
                break
            num_spec = 0
            if speculator is not None and remaining == 1:
                num_spec = speculator.reserve(request, budget - 1)
                if num_spec and allocate(request, 1 + num_spec) is None:
                    num_spec = 0  # no blocks for the proposals: a plain decode (speculation never preempts)
                    request.spec_token_ids = []
                num_new += num_spec
            while (new_blocks := allocate(request, num_new)) is None:
                victim = self._pick_victim()
                if victim is not request and victim.request_id in scheduled:
                    # Already given tokens this step: take them back.
                    s = scheduled.pop(victim.request_id)
                    out.scheduled.remove(s)
                    if s in out.prompt_logprobs:
                        out.prompt_logprobs.remove(s)
                    out.num_batched_tokens -= s.num_new_tokens
                    out.num_spec_tokens -= s.num_spec
                    budget += s.num_new_tokens
                self.running.remove(victim)
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is request:
                    break
            if new_blocks is None:  # it was the latest arrival: preempted itself
                continue
            scheduled[request.request_id] = self._schedule(out, request, num_new, num_spec)
            budget -= num_new
            if remaining > 1:
                prompt_budget -= num_new

        # 2. Admit waiting requests in (priority, arrival) order; none after a preemption (memory is
        # short), and none past the first that does not fit (head-of-line, so big requests are not
        # starved). Samples 2..n of a prompt are skipped while sample 0 still computes that prompt.
        i = 0
        budget = min(budget, prompt_budget)
        while (not out.preempted and i < len(self.waiting) and budget > 0
               and len(self.running) < self.max_num_seqs):
            request = self.waiting[i]
            if self._held_back(request) or not self._hold_adapter(request):
                i += 1
                continue
            cached = None
            if request.num_computed_tokens == 0 and request.prompt_logprobs is None:
                cached = self.block_manager.find_cached_prefix(request)
                if lower is not None and lower.fetch(request, cached):  # more of it below: read back first
                    self._release_adapter(request)
                    i += 1
                    continue
            num_cached = 0 if cached is None else cached.num_blocks * self.block_manager.block_size
            num_new = min(request.num_remaining_tokens - num_cached, budget)
            if self.batch_invariant:
                num_new = min(num_new, _invariant_rows(request, request.num_computed_tokens + num_cached))
            new_blocks = self.block_manager.allocate_slots(request, num_new, cached)
            if new_blocks is None:
                self._release_adapter(request)  # a waiting request holds no slot
                break
            del self.waiting[i]
            request.num_computed_tokens += num_cached
            request.status = RequestStatus.RUNNING
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
                request.num_cached_tokens = min(num_cached, request.num_prompt_tokens)
            self.running.append(request)
            self._schedule(out, request, num_new)
            budget -= num_new
        if self.batch_invariant:  # rows of a generated token first, with the decodes (StepStager)
            out.scheduled.sort(key=lambda s: s.at_prompt)
        if cut is not None and bound is None:  # let past the bound: its streamed decodes may stall
            self.stall_budget.charge(out, [r for r, _ in decodes], cut)
        if lower is not None:
            lower.flush()  # copies of blocks freed since, before this step may write them
        return out

    def _heading(self, num_decodes: int, context: int, prefills: list[tuple[Request, int]]) -> tuple[int, int]:
        """The decode batch this step heads to, as (rows, tokens of context): its decodes, the
        running prefills, and the waiting requests that rows (max_num_seqs) and free blocks would
        admit next, each at its length once computed. The stall bound measures a step against that
        batch's decode step, the inter-token time its streams will see, not the few rows decoding
        so far: bounded by the first rows of a burst, chunks would stay small while the batch
        builds up."""
        if not self.stall.factor:
            return num_decodes, context
        rows = num_decodes + len(prefills)
        context += sum(r.num_tokens for r, _ in prefills)
        free = self.block_manager.num_free_blocks
        needed = self.block_manager.blocks_needed
        for request in itertools.islice(self.waiting, max(0, self.max_num_seqs - len(self.running))):
            free -= needed(request.num_tokens)
            if free < 0:
                break
            rows += 1
            context += request.num_tokens
        return rows, context

    def _held_back(self, request: Request) -> bool:
        """True while the request waits for its constraint to compile, or for its sample 0 to
        compute the shared prompt."""
        if request.grammar is not None and not request.grammar.ready:
            return True
        leader = request.wait_for
        if leader is None:
            return False
        if (not self.block_manager.enable_caching or leader.finished
                or leader.num_computed_tokens >= leader.num_prompt_tokens):
            request.wait_for = None
            return False
        return True

    def compiling(self) -> list[Future]:
        """The compilations waiting requests wait for (the engine waits on them when a step finds
        nothing else to run)."""
        return [f for r in self.waiting if r.grammar is not None and (f := r.grammar.pending) is not None]

    def _schedule(self, out: SchedulerOutput, request: Request, num_new: int, num_spec: int = 0) -> ScheduledRequest:
        start = request.num_computed_tokens
        s = ScheduledRequest(request, num_new, start, start + num_new - num_spec == request.num_tokens, num_spec)
        out.scheduled.append(s)
        out.num_batched_tokens += num_new
        out.num_spec_tokens += num_spec
        if request.prompt_logprobs is not None and start < len(request.prompt_token_ids) - 1:
            out.prompt_logprobs.append(s)
        return s

    # ---- closing the step ------------------------------------------------------------------------
    def step_launched(self, out: SchedulerOutput) -> None:
        """The step is on its way (queued on the device, or run): its tokens count as computed, the
        blocks they filled are published to the prefix cache, and each row that samples holds a
        placeholder for its token until `update_from_output` reads it back.

        The hashes go out while a queued step may still be writing those blocks' K/V: a request that
        hits them reads them in a later step, queued behind those writes on the same stream."""
        for s in out.scheduled:
            request = s.request
            if request.finished:  # aborted or failed since it was scheduled
                continue
            # Proposals count as computed only once accepted (update_from_output), so blocks holding
            # them are hashed from accepted tokens alone.
            request.num_computed_tokens += s.num_new_tokens - s.num_spec
            self.block_manager.cache_full_blocks(request)
            if s.sample:
                request.num_output_placeholders += 1

    def update_from_output(self, step: StepOutput) -> list[RequestOutput]:
        """Closes a step, whatever kind it was: each row's new tokens join its request
        (`Request.append_tokens`), proposals it rejected are rolled back, and a request that
        stops ends (its blocks freed). Returns one output per row still running. A row whose
        request finished since its step was launched (aborted, failed, or stopped by the step
        before under async scheduling) is dropped with its tokens. The matchers of structured
        outputs take every row's first token at once, in parallel; one that refuses a token fails
        its request.

        The step's prompt logprobs are collected first, so that a request whose last prompt chunk
        samples its first token hands them all over with that token."""
        for request, first, entries in step.prompt_logprobs:
            request.collect_prompt_logprobs(first, entries)
        assert len(step.tokens) == len(step.requests) and (step.proposed is None or len(step.proposed) == len(step.requests))
        if self.structured is not None:
            self.structured.consume([(r.grammar, tokens[0].token_id) for r, tokens in zip(step.requests, step.tokens)
                                     if r.grammar is not None and not r.finished])
        outputs = []
        for request, tokens, k in zip(step.requests, step.tokens, step.proposed or itertools.repeat(0)):
            if request.finished:
                continue
            request.num_output_placeholders -= 1
            if k:
                self._settle_proposals(request, k, len(tokens) - 1)
            emitted, text, status = request.append_tokens(tokens)
            if status is _FAILED:  # a refused token, or a constraint that never compiled
                error = request.grammar.error if request.grammar is not None else None
                log.error("structured_output_failed", request_id=request.request_id, error=error)
                outputs += self.fail([request], error or "the structured output failed")
                continue
            outputs.append(self._output(request, emitted, text, status))
            if k and not request.finished:
                self.block_manager.trim(request)  # blocks only rejected proposals filled go back
                self.block_manager.cache_full_blocks(request)
                request.draft_computed = min(request.draft_computed, request.num_computed_tokens)
        return outputs

    def _settle_proposals(self, request: Request, k: int, accepted: int) -> None:
        """A row verified k proposals and accepted the first `accepted`: those count as computed
        (the newest token's K/V counted at launch); the rest are rolled back once the tokens
        joined (update_from_output), so blocks are hashed from accepted tokens only."""
        assert 0 <= accepted <= k, f"{request}: {accepted} of {k} proposals accepted"
        request.spec_token_ids = []
        request.num_drafts += 1
        request.num_draft_tokens += k
        request.num_accepted_tokens += accepted
        if self.speculator is not None:
            self.speculator.record(k, accepted)
        request.num_computed_tokens += accepted

    def _output(self, request: Request, emitted: list[SampledToken], text: str,
                status: RequestStatus | None) -> RequestOutput:
        """The output of a request's new tokens `emitted` (`text` their text so far, `status` the
        end `append_tokens` found), and the request's end when it ends here."""
        detok = request.detokenizer
        if detok is not None:
            if status is not None and not detok.stopped:
                # Ending for another reason: text held back (a possible stop string, a split
                # character) comes out now, and a stop string found in it still ends the request.
                text += detok.flush()
                if detok.stopped:
                    status = RequestStatus.FINISHED_STOPPED
            if detok.stopped:
                request.stop_reason = detok.stop_string
        o = request.output(emitted, text)
        if status is not None:
            if request.streamed:
                self.stall_budget.finished(request.num_output_tokens)
            o.all_finished = self.finish(request, status)
            o.finished, o.status, o.stop_reason = True, status, request.stop_reason
            if request.num_drafts:
                o.num_draft_tokens, o.num_accepted_tokens = request.num_draft_tokens, request.num_accepted_tokens
        return o
