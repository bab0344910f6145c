"""One generation request as the engine sees it.

Progress is two counters, not a mode: `num_computed_tokens` (tokens whose K/V are in the cache) and
`num_tokens` (prompt + generated). A step schedules some of the `num_tokens - num_computed_tokens`
remaining tokens; prefill, chunked prefill, decode and recompute after preemption are all the same
rule. The request samples a new token only in the step that brings it to `num_tokens`.

Everything the engine keeps about one request lives on it: its seed, its detokenizer, its block
table and the chain hashes of its full blocks, the group of samples it belongs to (n > 1), and its
structured output's matcher (engine/sample/structured.py). No
component keeps a map keyed by request id beside it (each such map was one more place to clean up
on finish, abort and preemption); the scheduler's table of groups is the one lookup by id.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from ..messages import RequestOutput, RequestStatus, SampledToken
from ..sampling_params import SamplingParams

if TYPE_CHECKING:
    from ..sample.structured import GrammarState
    from .adapters import Adapter
    from .detokenizer import IncrementalDetokenizer


class SampleGroup:
    """The n samples of one engine request (n = 1 usually): the id their outputs carry and their
    caller's stream ends on, and how many are still unfinished."""

    __slots__ = ("request_id", "samples", "num_unfinished")

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id  # the engine request id (what the client minted)
        self.samples: list[Request] = []  # sample i at index i
        self.num_unfinished = 0

    def __repr__(self) -> str:
        return f"SampleGroup({self.request_id!r}, {len(self.samples)} samples, {self.num_unfinished} unfinished)"


class Request:
    __slots__ = (
        "request_id", "prompt_token_ids", "sampling", "output_token_ids", "num_output_placeholders",
        "num_computed_tokens",
        "status", "arrival_time", "max_model_len", "eos_token_ids", "num_preemptions",
        "first_scheduled_time", "stop_reason", "parent_id", "index", "wait_for", "num_cached_tokens",
        "seed", "detokenizer", "block_ids", "block_hashes", "group", "priority", "streamed", "num_stalls", "prompt_logprobs",
        "grammar", "adapter", "holds_adapter",
        "spec_token_ids", "ngram", "draft_computed", "num_drafts", "num_draft_tokens", "num_accepted_tokens",
        "kv_load",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        *,
        eos_token_ids: tuple[int, ...] = (),
        max_model_len: int,
        arrival_time: float | None = None,
        parent_id: str | None = None,
        index: int = 0,
        wait_for: Request | None = None,
        seed: int = 0,
        detokenizer: IncrementalDetokenizer | None = None,
        group: SampleGroup | None = None,
        priority: int = 0,
        streamed: bool = False,
        grammar: GrammarState | None = None,
        adapter: Adapter | None = None,
    ) -> None:
        if not prompt_token_ids:
            raise ValueError("prompt_token_ids must not be empty")
        self.request_id = request_id
        self.prompt_token_ids: list[int] = list(prompt_token_ids)
        self.sampling = sampling
        self.output_token_ids: list[int] = []  # sampled ids read back so far
        # Async scheduling: tokens sampled on the device and not read back yet (0 or 1). They count
        # in num_tokens (the next step runs them, taking their ids from the device); their ids join
        # output_token_ids when read back.
        self.num_output_placeholders = 0
        self.num_computed_tokens = 0  # tokens of all_token_ids whose K/V are in the cache
        self.status = RequestStatus.WAITING
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.max_model_len = max_model_len  # prompt + output may not exceed this
        self.eos_token_ids = eos_token_ids
        self.num_preemptions = 0
        self.first_scheduled_time: float | None = None
        self.stop_reason: int | str | None = None  # the stop token id or stop string that ended it
        # n > 1: the caller's request id and this sample's index (the id itself is internal).
        self.parent_id = request_id if parent_id is None else parent_id
        self.index = index
        # Sample 0 of the same prompt: this sample is not admitted before that one's prompt is
        # computed (so its full blocks are in the prefix cache); cleared once that holds.
        self.wait_for = wait_for
        self.num_cached_tokens = 0  # prompt tokens taken from the prefix cache on first admission
        self.priority = priority  # lower is scheduled first (admission, and the last to be preempted)
        # Its caller reads the tokens as they are made (a stream), so a step that stalls its decode
        # is a gap someone sees: the stall bound protects these decodes alone. A request read whole
        # (a unary call, offline work) waits for its last token, which whole budgets bring soonest.
        self.streamed = streamed
        self.num_stalls = 0  # its gaps in steps let past the stall bound (StallBudget)
        self.seed = seed  # of this sample's random stream (engine.sample.sampler: the same tokens in any batch)
        self.detokenizer = detokenizer  # its text deltas and stop strings (None: ids only, in tests)
        # Block table: logical block i -> physical block id, owned by the block manager (which
        # appends on allocation and empties it on free); the runner stages it as it is.
        self.block_ids: list[int] = []
        self.block_hashes: list[int] = []  # chain hash of each full block, in order (prefix caching)
        # Prompt logprobs (sample 0 of a request that asks): entries 1..P-1 as they are computed,
        # chunk by chunk (entry i: prompt token i given tokens 0..i-1); handed over with the first
        # output token, then None. While a list, the request computes its prompt in full: no
        # prefix-cache hit on admission (cached positions have no logits).
        self.prompt_logprobs: list[SampledToken] | None = (
            [] if sampling.prompt_logprobs is not None and index == 0 else None)
        # Structured output: this sample's matcher (None: free text). Not admitted before its
        # constraint is compiled; it advances with every token appended (Scheduler.update_from_output).
        self.grammar = grammar
        # LoRA (engine/scheduling/adapters.py): the adapter its tokens run through (None: the base model), and
        # whether it holds the adapter's slot now (from admission until it leaves the running set).
        self.adapter = adapter
        self.holds_adapter = False
        # Speculative decoding (engine/spec_decode/speculator.py): the ids proposed after the newest token in
        # the step in flight (empty otherwise; they are not outputs until verified), the n-gram
        # proposer's index of this request's tokens, and how many of its tokens the draft model's
        # cache holds (0 after a preemption).
        self.spec_token_ids: list[int] = []
        self.ngram: Any = None  # engine.spec_decode.speculator.NgramIndex, made on the first lookup
        self.draft_computed = 0
        self.num_drafts = 0  # verify steps of this request that carried proposals
        self.num_draft_tokens = 0  # proposals verified
        self.num_accepted_tokens = 0  # of those, accepted
        # A read-back of its prefix from the host or disk tier in flight (engine/offload/tiers.py):
        # it waits, unadmitted, until the blocks have landed in the pool. None: no read-back.
        self.kv_load: Any = None
        if group is None:
            group = SampleGroup(self.parent_id)
        self.group = group
        group.samples.append(self)
        group.num_unfinished += 1

    @property
    def cache_salt(self) -> int | None:
        """The parent hash of its first KV block (prefix caching): its adapter's, None for the
        base model, so no two adapters share a block."""
        return None if self.adapter is None else self.adapter.salt

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Tokens sampled so far, those still on the device included."""
        return len(self.output_token_ids) + self.num_output_placeholders

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_output_placeholders

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt and output ids known on the host (placeholders not included)."""
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """Ids of tokens [start, end) of prompt + output, without concatenating the whole sequence;
        a placeholder's id is not known here and reads as 0 (its reader takes it from the device)."""
        p = len(self.prompt_token_ids)
        if start >= p:
            ids = self.output_token_ids[start - p:end - p]
        elif end <= p:
            ids = self.prompt_token_ids[start:end]
        else:
            ids = self.prompt_token_ids[start:] + self.output_token_ids[:end - p]
        missing = end - start - len(ids)
        return ids + [0] * missing if missing > 0 else ids

    def collect_prompt_logprobs(self, first: int, entries: list[SampledToken]) -> None:
        """A step's prompt logprobs of this request, entries from prompt position `first` on, less
        those already collected (a request preempted while a step of its was in flight computes
        those positions again)."""
        collected = self.prompt_logprobs
        if collected is None or self.finished:
            return
        have = len(collected) + 1  # entry 0 (the first prompt token) has none
        if first <= have < first + len(entries):
            collected.extend(entries[have - first:])

    def input_slice(self, start: int, end: int) -> list[int]:
        """`token_slice` going on into the proposals in flight (`spec_token_ids`): the input ids of
        a step's row (a placeholder still reads as 0)."""
        known = len(self.prompt_token_ids) + len(self.output_token_ids)
        if end <= known or not self.spec_token_ids:
            return self.token_slice(start, end)
        return self.token_slice(start, known) + self.spec_token_ids[max(start - known, 0):end - known]

    @property
    def num_remaining_tokens(self) -> int:
        """Tokens still to be run through the model before the next sample."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def length_capped(self) -> bool:
        """No token may follow: max_tokens or the context length is reached. Known from the count
        alone, so async scheduling stops such a request before its newest id is read back."""
        n = len(self.output_token_ids) + self.num_output_placeholders
        return n >= self.sampling.max_tokens or n + len(self.prompt_token_ids) >= self.max_model_len

    @property
    def finished(self) -> bool:
        return self.status.finished

    def append_tokens(self, tokens: list[SampledToken]) -> tuple[list[SampledToken], str, RequestStatus | None]:
        """The one way sampled tokens join the request: one, or a verify step's accepted proposals
        and the token after them. Each in turn is appended, taken by the structured output's
        matcher (all but the first: the step's first tokens go to the matchers together,
        StructuredOutputs.consume), detokenized, and checked for a stop string, a stop id or EOS,
        the length, and a complete constraint; the first that ends the request drops the rest.
        Returns the tokens that joined, their text, and the end found (None: the request goes on);
        FINISHED_ERROR when the matcher refused a token (`grammar.error` says why: the caller
        fails the request). (Runs for every running request each step: plain attribute reads.)"""
        detok, grammar = self.detokenizer, self.grammar
        text = ""
        n = 0
        for token in tokens:
            token_id = token.token_id
            self.output_token_ids.append(token_id)
            n += 1
            if grammar is not None:
                matcher = grammar.matcher
                if n > 1 and grammar.error is None and matcher is not None and not matcher.consume_token(token_id):
                    grammar.error = (f"the structured output's matcher refused token {token_id}: "
                                     f"{matcher.get_error() or 'not allowed here'}")
                if grammar.error is not None:
                    return tokens[:n], text, RequestStatus.FINISHED_ERROR
            if detok is not None:
                text += detok.step((token_id,))
                if detok.stopped:
                    return tokens[:n] if n < len(tokens) else tokens, text, RequestStatus.FINISHED_STOPPED
            status = self.check_token_stop()
            if grammar is not None and grammar.finished:
                status = RequestStatus.FINISHED_STOPPED  # the constraint is complete: nothing may follow
            if status is not None:
                return tokens[:n] if n < len(tokens) else tokens, text, status
        return tokens, text, None

    def check_token_stop(self) -> RequestStatus | None:
        """Finish status implied by the last generated token, if any (stop strings are the
        detokenizer's job, since they are found in text)."""
        out, sp = self.output_token_ids, self.sampling
        last = out[-1]
        if last in sp.stop_token_ids:  # asked for: it is the stop reason, an EOS id too
            self.stop_reason = last
            return RequestStatus.FINISHED_STOPPED
        if not sp.ignore_eos and last in self.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED  # the end of sequence: no stop reason (generate.proto)
        if len(out) >= sp.max_tokens or len(out) + len(self.prompt_token_ids) >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def output(self, emitted: list[SampledToken], text: str) -> RequestOutput:
        """What the caller sees of new tokens `emitted` that joined the request (`text`: their
        text); the prompt logprobs go out with the first token. Not finished: the scheduler marks
        the request's end on it."""
        num_out = len(self.output_token_ids)
        o = RequestOutput(
            request_id=self.parent_id, new_token_ids=[t.token_id for t in emitted], new_text=text,
            new_logprobs=emitted if emitted[0].top or self.sampling.logprobs else [],
            num_prompt_tokens=len(self.prompt_token_ids), num_output_tokens=num_out,
            num_cached_tokens=self.num_cached_tokens, index=self.index, all_finished=False)
        if num_out == len(emitted) and self.first_scheduled_time is not None:
            o.queue_time_s = self.first_scheduled_time - self.arrival_time
        if self.prompt_logprobs is not None:  # all computed by now: its first token is out
            o.prompt_logprobs, self.prompt_logprobs = self.prompt_logprobs, None
        return o

    def error_output(self, error: str, *, out_of_memory: bool, all_finished: bool) -> RequestOutput:
        """What the caller sees of the request failed by an engine fault."""
        return RequestOutput(
            request_id=self.parent_id, new_token_ids=[], new_text="", finished=True,
            status=RequestStatus.FINISHED_ERROR, num_prompt_tokens=self.num_prompt_tokens,
            num_output_tokens=self.num_output_tokens, error=error, out_of_memory=out_of_memory,
            index=self.index, num_cached_tokens=self.num_cached_tokens, all_finished=all_finished)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.name}, "
                f"computed={self.num_computed_tokens}/{self.num_tokens})")
