"""A launched step between the device and the host: its logits once the forward pass is queued
(`StepLogits`), then what it sampled on its way back (`PendingStep`), read as one `StepOutput`.

Everything a step samples comes back in one device->host copy, packed as float64 columns (token
ids are exact in float64): per row, id, logprob, then n top ids and n top logprobs; a step that
verified proposals has 1 + k rows per request, each with an `accepted` column after the logprob.
`PendingStep.result()` waits for that copy, the step's one host synchronization.
"""

from __future__ import annotations

import torch

from ..messages import SampledToken
from ..scheduling.request import Request
from ..scheduling.step import SchedulerOutput, StepOutput
from .prompt_logprobs import PromptLogprobRows


class StepLogits:
    """A step's forward pass, queued on the device: the rows that sample and their logits."""

    __slots__ = ("out", "rows", "logits", "prompt")

    def __init__(self, out: SchedulerOutput, rows: list[int], logits: torch.Tensor | None,
                 prompt: PromptLogprobRows | None) -> None:
        self.out = out
        self.rows = rows  # indices into out.scheduled of the rows that sample
        # (R, V) fp32; None when no row samples. In a step with proposals (out.num_spec_tokens),
        # 1 + num_spec rows per sampling row: its newest token's position, then each proposal's.
        self.logits = logits
        self.prompt = prompt  # the prompt positions whose logprobs this step computes, if any


class PendingStep:
    """What one launched step sampled (and the prompt logprobs it computed), on its way to the host."""

    def __init__(self, requests: list[Request], host: torch.Tensor, n_top: int,
                 done: torch.cuda.Event | None, prompt: tuple[PromptLogprobRows, torch.Tensor] | None = None,
                 num_spec: list[int] | None = None) -> None:
        self.requests = requests  # the rows' requests, in row order (none: a step of prompt chunks only)
        self._host = host  # (R, 2 + 2 * n_top) float64, pinned on CUDA; with num_spec (N, 3 + 2 * n_top)
        self._n_top = n_top
        self._done = done  # recorded after the device->host copies (timed); None on the CPU
        self._prompt = prompt  # the step's prompt-logprob rows and their (M, 1 + 2 * top) values on the host
        self._num_spec = num_spec  # proposals of each row (a step that verified some), else None

    @property
    def done(self) -> torch.cuda.Event | None:
        """The event recorded after the step's last work on the device (None on the CPU)."""
        return self._done

    @property
    def speculative(self) -> bool:
        """The step verified proposals: the next one cannot be scheduled before it is read back."""
        return self._num_spec is not None

    @property
    def all_requests(self) -> list[Request]:
        """Every request the step produced something for: its rows', then prompt chunks' (when they
        fail, all of these fail)."""
        if self._prompt is None:
            return self.requests
        return self.requests + [span[0] for span in self._prompt[0].spans if span[0] not in self.requests]

    def result(self) -> StepOutput:
        """Waits for the copy (the step's one host synchronization) and reads it: each row's new
        tokens (Scheduler.update_from_output takes them) and the prompt logprobs."""
        if self._done is not None:
            self._done.synchronize()
        prompt = []
        if self._prompt is not None:
            rows, host = self._prompt
            prompt = rows.entries(host.tolist())
        if not self.requests:
            return StepOutput(prompt_logprobs=prompt)
        values = self._host.tolist()
        tokens = self._verified(values) if self._num_spec is not None else self._sampled(values)
        return StepOutput(self.requests, tokens, proposed=self._num_spec, prompt_logprobs=prompt)

    def _sampled(self, rows: list[list[float]]) -> list[list[SampledToken]]:
        """One token per row."""
        n_top = self._n_top
        if not n_top:
            return [[SampledToken(int(row[0]), row[1], [])] for row in rows]
        sampled = []
        for r, row in zip(self.requests, rows):
            n = min(r.sampling.logprobs, n_top)
            top = [(int(t), lp) for t, lp in zip(row[2:2 + n], row[2 + n_top:2 + n_top + n])]
            sampled.append([SampledToken(int(row[0]), row[1], top)])
        return sampled

    def _verified(self, rows: list[list[float]]) -> list[list[SampledToken]]:
        """A verify step's rows: each request's tokens up to its first rejected proposal (the
        token drawn there instead) or its bonus token."""
        assert self._num_spec is not None
        n_top = self._n_top
        verified = []
        at = 0
        for r, k in zip(self.requests, self._num_spec):
            n = min(r.sampling.logprobs, n_top)
            tokens = []
            for row in rows[at:at + k + 1]:
                top = [(int(t), lp) for t, lp in zip(row[3:3 + n], row[3 + n_top:3 + n_top + n])] if n else []
                tokens.append(SampledToken(int(row[0]), row[1], top))
                if not row[2]:  # its proposal rejected (always so on the last row: nothing to judge)
                    break
            verified.append(tokens)
            at += k + 1
        return verified
