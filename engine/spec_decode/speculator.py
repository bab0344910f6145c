"""Speculative decoding: proposals for a request's next tokens, verified in one forward pass.

Decoding one request reads every weight once per token. A step that runs the request's newest
token and K proposed tokens after it reads them once for K + 1 positions and, where the model
agrees with the proposals, emits up to K + 1 tokens. Off by default (`EngineConfig.speculative`
None: no Speculator exists, and each place below is one `is None` check).

Where things live:

- Proposals are state of the request: `Request.spec_token_ids`, the proposed ids of the step in
  flight (empty otherwise). The n-gram proposer keeps its index on the request too
  (`Request.ngram`); the draft model's K/V count is `Request.draft_computed`.
- The scheduler asks for them when it schedules a decode (`Speculator.reserve`): a decode with k
  proposals is a 1 + k token row (`ScheduledRequest.num_spec` = k), counted in the step's token
  budget and given slots for all 1 + k tokens; k is cut to what max_tokens and the context allow,
  and to 0 when the blocks for it are not free (speculation never preempts anyone). Above
  `speculative_max_batch` running decodes nobody speculates (verifying costs more than it saves
  once the step is no longer bound by reading the weights).
- The forward pass runs such a row through the extend kernel over the paged cache (int8 pages
  read as stored, as every step reads them) and makes the logits of all 1 + k positions, as it
  makes those of prompt positions for prompt logprobs. On CUDA a step whose rows are all decodes
  (at most speculative_max_batch of them) replays a verify graph captured at start, every row
  padded to 1 + K tokens (engine/runner/cuda_graphs.py); a step with prompt chunks runs eagerly.
- Verification (`verify`, on the device): row j (j = 0..k) of a request is sampled as the request's
  output token m + j would be if proposals 1..j were its outputs m..m+j-1: its logit bias and
  min_tokens at step m + j, penalties counting output + proposals 1..j, its structured-output mask
  after the matcher took proposals 1..j (llguidance advances a copy of the state and rolls back),
  and its random stream at (seed, m + j). Proposal j + 1 is accepted when row j agrees with it;
  the request emits the accepted proposals and row a's own token, where a is the first row that
  disagreed (or k: the bonus token). So every emitted token was sampled from exactly the logits
  plain decoding would have computed for it.
- "Agrees": greedy, the argmax. Sampled, with a draft distribution q (the draft model), the
  standard rule: accept d with probability min(1, p(d) / q(d)) and, rejecting it, draw from
  norm(max(0, p - q)); the output's distribution is p's. For an n-gram proposal q is a point mass
  at d: accept with probability p(d), and rejecting, draw from p without d, renormalised. The
  sampler's exponential race (engine/sample/sampler.py) does exactly that: its draw x at (seed, m + j)
  equals d with probability p(d), and given x != d, x is distributed as p without d. So an n-gram
  row accepts iff x == d and emits x where it stops: the same tokens plain decoding draws for
  that seed, whatever was proposed. A draft row's acceptance uniform and the draft's own draws
  come from streams of their own ((seed ^ salt, m + j)), independent of the target's race.
- Back on the host (`Scheduler.update_from_output`): the emitted tokens join the request one at a
  time (each checked for stop ids, stop strings, max_tokens, a complete constraint, as plain
  decoding does), and rejected proposals are rolled back: `num_computed_tokens` counts the newest
  token and the accepted proposals only, blocks past those the request's tokens need go back to
  the pool, and prefix-cache hashes are made from accepted tokens only (a block is hashed once
  it is full of computed tokens, and rejected positions never count as computed).
- Async scheduling: a step with proposals must be read back before the next step is scheduled
  (its positions depend on how many were accepted, and the n-gram proposer needs the tokens), so
  while speculation is on the engine reads the previous step back first and the host work no
  longer hides behind the device; steps without proposals keep running ahead.
- The per-row random streams are keyed by (seed, output index) only, so a seeded request draws
  the same tokens in any batch and whatever its acceptance pattern.

The draft model (engine/spec_decode/draft.py) keeps its K/V in its own small pool under the same block ids as
the target's (so it needs no block manager of its own), catches up on the tokens it has not seen,
then proposes K tokens autoregressively and hands q over for verification.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from ..sample.rejection import DraftProbs
from ..scheduling.request import Request
from ..scheduling.step import SchedulerOutput


class Proposer(Protocol):
    """Where proposals come from: `reserve` decides how many a request gets this step (and may set
    them), `propose` fills in those not set yet once the step is scheduled."""

    method: str

    def reserve(self, request: Request, k: int) -> int: ...

    def propose(self, out: SchedulerOutput) -> DraftProbs | None: ...


@dataclass(slots=True)
class SpecStats:
    """Cumulative counts, named like vLLM's spec_decode metrics."""

    num_drafts: int = 0  # verify rows that carried at least one proposal
    num_draft_tokens: int = 0  # proposals verified
    num_accepted_tokens: int = 0  # of those, accepted
    accepted_per_pos: list[int] = field(default_factory=list)  # [j]: times proposal j + 1 was accepted

    def record(self, k: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += k
        self.num_accepted_tokens += accepted
        per_pos = self.accepted_per_pos
        if len(per_pos) < k:
            per_pos.extend([0] * (k - len(per_pos)))
        for j in range(accepted):
            per_pos[j] += 1


class Speculator:
    """The scheduler's side of speculative decoding: who speculates, and how many proposals."""

    def __init__(self, proposer: Proposer, num_tokens: int, max_batch: int) -> None:
        self.proposer = proposer
        self.method = proposer.method
        self.num_tokens = num_tokens  # K: proposals per request and step at most
        self.max_batch = max_batch  # no speculation in steps with more running decodes than this
        self.stats = SpecStats()

    def active(self, num_decodes: int) -> bool:
        return num_decodes <= self.max_batch

    def reserve(self, request: Request, budget: int) -> int:
        """Proposals for `request`'s decode this step (0..K), at most `budget`: what max_tokens
        and the context leave after its next token. The n-gram proposer sets them now."""
        if request.sampling.disable_speculation or request.num_output_placeholders:
            return 0  # its newest id is still on the device (async scheduling): nothing to look up
        k = min(self.num_tokens, budget, request.sampling.max_tokens - request.num_output_tokens - 1,
                request.max_model_len - request.num_tokens - 1)
        if k <= 0:
            return 0
        return self.proposer.reserve(request, k)

    def propose(self, out: SchedulerOutput) -> DraftProbs | None:
        return self.proposer.propose(out)

    def record(self, k: int, accepted: int) -> None:
        self.stats.record(k, accepted)


class NgramIndex:
    """Prompt lookup over one request's tokens: for each n-gram (n in [n_min, n_max]) the end of its
    latest occurrence. Built on the first lookup, then kept up with the tokens as they grow; the
    n-grams ending at the newest token are indexed one token late, so a lookup of the current
    suffix finds an earlier occurrence, not itself."""

    __slots__ = ("n_min", "n_max", "ends", "indexed")

    def __init__(self, n_min: int, n_max: int) -> None:
        self.n_min = n_min
        self.n_max = n_max
        self.ends: dict[tuple[int, ...], int] = {}  # n-gram -> position of its last token
        self.indexed = 0  # n-grams ending before this position are in `ends`

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest suffix of
        `tokens` (n_max down to n_min tokens long) that occurred before; [] when none did."""
        n_tok = len(tokens)
        ends = self.ends
        for e in range(self.indexed, n_tok - 1):
            for n in range(self.n_min, min(self.n_max, e + 1) + 1):
                ends[tuple(tokens[e - n + 1:e + 1])] = e
        self.indexed = max(self.indexed, n_tok - 1)
        for n in range(min(self.n_max, n_tok - 1), self.n_min - 1, -1):
            end = ends.get(tuple(tokens[n_tok - n:]))
            if end is not None:
                return tokens[end + 1:end + 1 + k]
        return []


class NgramProposer:
    """Prompt lookup (no second model): proposals are the tokens that followed the longest recent
    suffix earlier in the prompt and output, cut where a structured output would refuse them."""

    method = "ngram"

    def __init__(self, n_min: int, n_max: int) -> None:
        self.n_min = n_min
        self.n_max = n_max

    def reserve(self, request: Request, k: int) -> int:
        index = request.ngram
        if index is None:
            index = request.ngram = NgramIndex(self.n_min, self.n_max)
        proposal = index.propose(request.all_token_ids, k)
        grammar = request.grammar
        if proposal and grammar is not None and grammar.matcher is not None:
            proposal = proposal[:grammar.matcher.validate_tokens(proposal)]
        request.spec_token_ids = proposal
        return len(proposal)

    def propose(self, out: SchedulerOutput) -> DraftProbs | None:
        return None  # set in reserve
