"""Prompt logprobs: each prompt token's log-probability given the tokens before it, and the most
likely tokens at its position (SamplingParams.prompt_logprobs), computed on the device from the
hidden states of the steps that run the prompt.

A step normally turns only each sequence's last token into logits. For a request collecting prompt
logprobs, the scheduler lists its chunk (`SchedulerOutput.prompt_logprobs`), and this module picks
out the hidden rows of its prompt positions. Position j's logits predict prompt token j + 1, so a
prompt of P tokens has entries 1..P-1 (entry 0, the first token, has nothing before it); position
P - 1 predicts the first output token and is the sampler's. A long prompt prefilled in chunks
yields its entries chunk by chunk:

    prompt      p0  p1  p2  p3 | p4  p5  p6        (P = 7; two chunks of 4 and 3 tokens)
    positions    0   1   2   3 |  4   5   6
    entries          1   2   3 |  4   5   6?       entry j + 1 from position j; 6 -> the sampler
    step 1: rows 0..3 -> entries 1..4 ; step 2: rows 4..5 -> entries 5..6, row 6 samples

Only steps that hold such a chunk do any of this (a host check of one list); the logits of their
positions are made in slices of at most `LOGITS_ELEMENTS` values, so a 2,048-token chunk over a
150k vocabulary never holds more than one slice's (rows, V) at once. Values are log_softmax of the
raw fp32 logits, whatever the server's logprobs mode. Under tensor parallelism the LM head is a
collective, so the workers run the same slices on the same rows (engine/runner/tensor_parallel.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch

from ..device import to_device
from ..messages import SampledToken
from ..scheduling.request import Request
from ..scheduling.step import SchedulerOutput

# Logit values (rows x vocabulary) made at once: 64 MiB of fp32.
LOGITS_ELEMENTS = 1 << 24


def slices(num_rows: int, vocab_size: int) -> Iterator[slice]:
    """The row slices the logits of `num_rows` prompt positions are made in (rank 0 and the
    tensor-parallel workers cut them alike: each is one collective LM-head call)."""
    step = max(1, LOGITS_ELEMENTS // vocab_size)
    for start in range(0, num_rows, step):
        yield slice(start, min(start + step, num_rows))


@dataclass(slots=True)
class PromptLogprobRows:
    """The prompt positions of one step whose logprobs are asked for, and (once the forward pass
    ran) their logprobs on the device. M positions; n = `top` alternatives each."""

    spans: list[tuple[Request, int, int, int]]  # (request, its first entry, entries, top-n it asked for)
    index: torch.Tensor  # (M,) int64 on the device: each position's token index in the step
    targets: torch.Tensor  # (M,) int64 on the device: the prompt token each position predicts
    top: int  # the most alternatives one of them asked for
    # (M, 1 + 2 * top) float64 on the device: the target's logprob, then `top` ids and `top`
    # logprobs, most likely first; set by `compute` during the forward pass.
    packed: torch.Tensor | None = None

    @classmethod
    def plan(cls, out: SchedulerOutput, device: torch.device) -> PromptLogprobRows | None:
        """The rows of `out.prompt_logprobs`' chunks (None when it is empty: the usual step)."""
        if not out.prompt_logprobs:
            return None
        wanted = {id(s) for s in out.prompt_logprobs}
        spans, index, targets = [], [], []
        offset = 0  # token index in the step of the scheduled request's first token
        for s in out.scheduled:
            if id(s) in wanted:
                request = s.request
                prompt = request.prompt_token_ids
                end = min(s.start + s.num_new_tokens, len(prompt) - 1)  # positions s.start .. end-1
                count = end - s.start
                spans.append((request, s.start + 1, count, request.sampling.prompt_logprobs or 0))
                index.append(np.arange(offset, offset + count, dtype=np.int64))
                targets.append(np.asarray(prompt[s.start + 1:end + 1], dtype=np.int64))
            offset += s.num_new_tokens
        rows = to_device(torch.from_numpy(np.stack([np.concatenate(index), np.concatenate(targets)])), device)  # (2, M)
        return cls(spans, rows[0], rows[1], max(span[3] for span in spans))

    @property
    def num_rows(self) -> int:
        return self.index.shape[0]

    def compute(self, hidden: torch.Tensor, logits_of: Callable[[torch.Tensor], torch.Tensor],
                vocab_size: int) -> None:
        """From the step's hidden states (T, hidden) and the LM head (rows -> (rows, V) fp32):
        `packed`, slice by slice (`slices(M, vocab_size)`: the workers cut theirs alike)."""
        parts = []
        for part in slices(self.num_rows, vocab_size):
            logits = logits_of(hidden.index_select(0, self.index[part]))  # (m, V) fp32
            logsumexp = torch.logsumexp(logits, dim=-1, keepdim=True)  # (m, 1)
            cols = [logits.gather(1, self.targets[part, None]) - logsumexp]  # (m, 1)
            if self.top:
                top, ids = logits.topk(self.top, dim=-1)  # (m, top), descending
                cols += [ids, top - logsumexp]
            parts.append(torch.cat([c.double() for c in cols], dim=1))  # ids are exact in float64
        self.packed = torch.cat(parts)

    def entries(self, rows: list[list[float]]) -> list[tuple[Request, int, list[SampledToken]]]:
        """`packed` read back (as lists) -> (request, first entry, entries) per span, for
        Scheduler.update_from_output; each entry names the prompt token it is about."""
        out = []
        row = 0
        top = self.top
        for request, first, count, n in self.spans:
            prompt = request.prompt_token_ids
            entries = []
            for i in range(count):
                values = rows[row + i]
                entries.append(SampledToken(prompt[first + i], values[0],
                                            [(int(t), lp) for t, lp in zip(values[1:1 + n], values[1 + top:1 + top + n])]))
            out.append((request, first, entries))
            row += count
        return out


def run_on_worker(hidden: torch.Tensor, index: torch.Tensor, vocab_size: int,
                  logits_of: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """A tensor-parallel worker's share: the same LM-head calls as rank 0's `compute` (each one a
    collective), whose results are rank 0's to use."""
    for part in slices(index.shape[0], vocab_size):
        logits_of(hidden.index_select(0, index[part]))
