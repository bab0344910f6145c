"""A step's two ends: what the scheduler asks of it (`SchedulerOutput`) and what it produced, read
back from the device (`StepOutput`).

Every kind of step has these two shapes: prompt chunks, decodes, a mix of both, rows with a
structured output's masks, rows that verify speculative proposals, run at once or overlapped
with the next step. The runner turns one into the other (engine/runner/model_runner.py), and
`Scheduler.update_from_output` takes every StepOutput through one acceptance path
(`Request.append_tokens`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..messages import SampledToken
from .request import Request


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # tokens of the request run through the model this step (>= 1), proposals included
    start: int  # their first position: num_computed_tokens before the step
    sample: bool  # start + num_new_tokens - num_spec == num_tokens: this step produces the next token
    # Of num_new_tokens, the proposed ones after the newest token (Request.spec_token_ids, verified
    # this step; engine/spec_decode/speculator.py); 0 without speculative decoding.
    num_spec: int = 0

    @property
    def at_prompt(self) -> bool:
        """Its first token is a prompt token (else one the request sampled: a decode, or its
        recompute after preemption)."""
        return self.start < len(self.request.prompt_token_ids)


@dataclass(slots=True)
class SchedulerOutput:
    # Requests that run this step: running decodes, running prefills (admission order within
    # each), then newly admitted ones.
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    # Requests preempted this step (blocks freed, back in the waiting queue in arrival order).
    preempted: list[Request] = field(default_factory=list)
    # Sum of num_new_tokens over `scheduled`; at most max_num_batched_tokens.
    num_batched_tokens: int = 0
    # Of `scheduled`, those whose tokens include prompt positions whose logprobs their request
    # collects (Request.prompt_logprobs); empty in almost every step.
    prompt_logprobs: list[ScheduledRequest] = field(default_factory=list)
    # Sum of num_spec over `scheduled`: proposals this step verifies (0: no row speculates).
    num_spec_tokens: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def sampling_requests(self) -> list[Request]:
        """The requests whose next token this step samples, in row order (the runner's rows)."""
        return [s.request for s in self.scheduled if s.sample]

    def logits_positions(self, rows: list[int]) -> np.ndarray:
        """The step's token positions (in `scheduled` order) whose logits the sampling `rows`
        (indices into `scheduled`) read, int64: each row's last token; in a step that verifies
        proposals, every position of such a row (its newest token's, then each proposal's)."""
        ends = np.cumsum(np.fromiter((s.num_new_tokens for s in self.scheduled), dtype=np.int64,
                                     count=len(self.scheduled)))
        if not self.num_spec_tokens:
            return ends[rows] - 1
        return np.concatenate([np.arange(ends[i] - 1 - self.scheduled[i].num_spec, ends[i]) for i in rows])


@dataclass(slots=True)
class StepOutput:
    """What one step produced, on the host."""

    # The requests whose next token the step sampled, in row order (SchedulerOutput.sampling_requests).
    requests: list[Request] = field(default_factory=list)
    # Each row's new tokens, with their logprobs: one; in a row that verified k proposals, the
    # accepted ones and the token after them (1 to k + 1 tokens).
    tokens: list[list[SampledToken]] = field(default_factory=list)
    # In a step that verified proposals, each row's k (0 for a row without); None in other steps.
    # Row i accepted len(tokens[i]) - 1 of its proposed[i].
    proposed: list[int] | None = None
    # (request, index of its first entry, entries) of the prompt positions whose logprobs the step
    # computed (SchedulerOutput.prompt_logprobs).
    prompt_logprobs: list[tuple[Request, int, list[SampledToken]]] = field(default_factory=list)
