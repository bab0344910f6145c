"""Verifying proposals on the device: rejection sampling that keeps plain decoding's tokens.

Row j of a request's 1 + k verify rows is sampled as its output token m + j would be, and judges
proposal j + 1: greedy rows accept the argmax, n-gram proposals (point masses) accept when the
sampler's race draws them, draft proposals with probability min(1, p/q), drawing from
max(0, p - q) where they fail. The proof that a seeded request so emits the tokens plain decoding
draws, and where proposals come from, are in engine/spec_decode/speculator.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .sampler import SamplerOutput, choose, hash_uniform, logprobs_of, race
from .tensors import SamplingTensors

# Salts of the random streams speculative decoding adds beside the sampler's (seed, step) stream.
ACCEPT_SALT = 0x5DEECE66D  # the acceptance uniform of a draft proposal
DRAFT_SALT = 0x2545F4914F6CDD1D  # the draft model's own draws


@dataclass(slots=True)
class DraftProbs:
    """The draft distributions of a step's proposals, on the device: row i is q of the i-th
    proposal in step order (sampling rows in order, each row's proposals in order)."""

    q: torch.Tensor  # (M, V) fp32


def verify(logits: torch.Tensor, t: SamplingTensors, next_ids: torch.Tensor, draft_rows: torch.Tensor | None,
           draft: DraftProbs | None, *, processed_logprobs: bool = False) -> tuple[SamplerOutput, torch.Tensor]:
    """One step's verification on the device (module docstring). N rows: each request's 1 + k rows
    in order. logits (N, V) fp32 with the masks applied; `t` the rows' sampling tensors (steps
    m + j, penalties counting the proposals before each row); next_ids (N,) int64: the proposal
    row j judges (proposal j + 1), -1 on a request's last row (nothing to judge: its bonus token).
    `draft_rows` (M,) int64: the rows whose proposal has a draft distribution, in DraftProbs order
    (None: n-gram, point masses). Returns the token of every row (the proposal where accepted,
    else what the row draws instead) with its logprobs, and (N,) bool: row j accepted its proposal.
    No host sync."""
    use_q = draft is not None and draft_rows is not None and not t.all_greedy
    token_ids, chosen_from, probs = choose(logits, t, processed_logprobs=processed_logprobs, keep_probs=use_q)
    accepted = token_ids == next_ids
    if use_q:
        assert probs is not None and draft is not None and draft_rows is not None
        p = probs.index_select(0, draft_rows)  # (M, V)
        q = draft.q
        d = next_ids.index_select(0, draft_rows)  # (M,)
        seed, step = t.seed.index_select(0, draft_rows), t.step.index_select(0, draft_rows)
        p_d = p.gather(1, d[:, None]).squeeze(1)
        q_d = q.gather(1, d[:, None]).squeeze(1)
        u = hash_uniform(seed ^ ACCEPT_SALT, step, 1)[:, 0]
        ok = u * q_d <= p_d  # u < p(d) / q(d), without dividing by a q(d) of 0
        # Rejected: a draw from max(0, p - q), renormalised (the race needs no normalising; where
        # p == q the proposal is always accepted and this draw is never used).
        instead = race((p - q).clamp_min_(0.0), seed, step)
        greedy = t.greedy.index_select(0, draft_rows)
        ok = torch.where(greedy, accepted.index_select(0, draft_rows), ok)  # greedy: argmax agrees
        tok = torch.where(greedy, token_ids.index_select(0, draft_rows), torch.where(ok, d, instead))
        token_ids = token_ids.index_copy(0, draft_rows, tok)
        accepted = accepted.index_copy(0, draft_rows, ok)
    return logprobs_of(chosen_from, token_ids, t.max_logprobs), accepted


def draft_draw(probs: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """The draft's proposals from its distributions `probs` (B, V), the rows' sampling tensors `t`
    (steps of the positions proposed): argmax for greedy rows, else a draw from its own stream."""
    greedy_ids = probs.argmax(dim=-1) if t.any_greedy else None
    if greedy_ids is not None and t.all_greedy:
        return greedy_ids
    drawn = race(probs.clone(), t.seed ^ DRAFT_SALT, t.step)
    return drawn if greedy_ids is None else torch.where(t.greedy, greedy_ids, drawn)


def draft_distribution(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """q: what the draft proposes from, its logits (B, V) processed as the target's are (bias,
    penalties, temperature, filters), through softmax."""
    _, _, probs = choose(logits, t, keep_probs=True)
    assert probs is not None
    return probs
