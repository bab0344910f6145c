"""Speculative decoding's verification (engine/spec_decode/speculator.py) on the device functions alone: the
n-gram proposer's index, and the rule that keeps the output distribution, tested statistically.

The statistical tests simulate a model whose next-token distribution depends on the previous
token only (a random bigram table over a 6-token vocabulary), so the exact distribution of every
output sequence is known: p(t1 | c) p(t2 | t1) p(t3 | t2). Each seeded sample decodes 3 tokens
by verify steps (K proposals each, until 3 tokens are out), and the counts of the 216 sequences
are compared with the exact probabilities by a chi-square test, and with the same number of
samples of plain decoding (the batched sampler, one token per step) by a chi-square test of
homogeneity. Significance: each test fails a correct sampler with probability ALPHA = 1e-4 (fresh
random tables and seeds every run). A wrong rule is far outside that: checked by mutation (the
residual drawn from p instead of max(0, p - q), acceptance with probability p(d) instead of
p(d) / q(d), n-gram proposals accepted with a uniform of their own): statistics in the thousands.
"""

from __future__ import annotations

import random

import pytest
import torch

from pie.engine.sample.rejection import DraftProbs, draft_distribution, draft_draw, verify
from pie.engine.sample.sampler import sample
from pie.engine.sample.tensors import SamplingTensors
from pie.engine.sampling_params import SamplingParams
from pie.engine.spec_decode.speculator import NgramIndex

ALPHA = 1e-4
V = 6
K = 3
LENGTH = 3  # output tokens per sample whose joint distribution is tested


def _brute_force_proposal(tokens: list[int], n_min: int, n_max: int, k: int) -> list[int]:
    """The longest suffix (n_max down to n_min tokens) with an earlier occurrence; the tokens that
    followed its latest one."""
    for n in range(min(n_max, len(tokens) - 1), n_min - 1, -1):
        suffix = tokens[len(tokens) - n:]
        for end in range(len(tokens) - 2, n - 2, -1):  # an occurrence ending before the last token
            if tokens[end - n + 1:end + 1] == suffix:
                return tokens[end + 1:end + 1 + k]
    return []


def test_ngram_index_finds_the_latest_longest_earlier_suffix(rng):
    """Grown token by token (as a request's output grows), the index proposes what a brute-force
    search of the whole sequence finds, never the suffix itself."""
    for _ in range(20):
        alphabet = rng.randint(2, 6)
        n_min = rng.randint(1, 3)
        n_max = rng.randint(n_min, 5)
        index = NgramIndex(n_min, n_max)
        tokens = [rng.randrange(alphabet) for _ in range(rng.randint(1, 8))]
        for _ in range(40):
            k = rng.randint(1, 6)
            assert index.propose(tokens, k) == _brute_force_proposal(tokens, n_min, n_max, k), (tokens, n_min, n_max)
            tokens += [rng.randrange(alphabet) for _ in range(rng.randint(1, 3))]


def test_ngram_index_examples():
    index = NgramIndex(1, 3)
    assert index.propose([5], 3) == []  # nothing earlier
    assert index.propose([5, 6, 7, 5, 6], 3) == [7, 5, 6]  # "5 6" occurred: what followed it
    # The latest occurrence of the longest suffix: "1 2" after "9 1 2" wins over the older "1 2".
    assert index.propose([5, 6, 7, 5, 6, 1, 2, 3, 9, 1, 2, 4, 0, 9, 1, 2], 2) == [4, 0]
    assert NgramIndex(2, 2).propose([1, 2, 3, 4, 2], 2) == []  # a 1-token match is below n_min


def _tensors(n: int, seeds: torch.Tensor, steps: torch.Tensor, temperature: float) -> SamplingTensors:
    sp = SamplingParams(temperature=temperature)
    return SamplingTensors.build([sp] * n, seeds.tolist(), steps.tolist(), [[0]] * n, [[] for _ in range(n)], V, "cpu")


def _chi_square_p(observed: torch.Tensor, expected: torch.Tensor) -> tuple[float, float]:
    """(statistic, p-value) of observed counts against expected ones, cells with an expectation
    below 5 pooled into one."""
    small = expected < 5
    obs = torch.cat([observed[~small], observed[small].sum()[None]]) if small.any() else observed
    exp = torch.cat([expected[~small], expected[small].sum()[None]]) if small.any() else expected
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    df = int(keep.sum()) - 1
    return stat, float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                               torch.tensor(stat / 2, dtype=torch.float64)))


def _homogeneity_p(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """Chi-square test that two count vectors over the same cells come from one distribution."""
    keep = (a + b) > 0
    a, b = a[keep].double(), b[keep].double()
    total = a.sum() + b.sum()
    cells = torch.stack([a, b])  # (2, C)
    expected = cells.sum(1, keepdim=True) * cells.sum(0, keepdim=True) / total
    stat = float(((cells - expected) ** 2 / expected).sum())
    df = int(keep.sum()) - 1
    return stat, float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                               torch.tensor(stat / 2, dtype=torch.float64)))


def _sequence_index(seqs: torch.Tensor) -> torch.Tensor:
    """(N, LENGTH) token sequences -> their cell index in V ** LENGTH."""
    idx = torch.zeros(seqs.shape[0], dtype=torch.int64)
    for i in range(LENGTH):
        idx = idx * V + seqs[:, i]
    return idx


def _plain(target: torch.Tensor, context: int, seeds: torch.Tensor, temperature: float) -> torch.Tensor:
    """LENGTH tokens per seed, one sampler step at a time: plain decoding. (N, LENGTH)"""
    n = seeds.shape[0]
    prev = torch.full((n,), context, dtype=torch.int64)
    out = []
    for m in range(LENGTH):
        t = _tensors(n, seeds, torch.full((n,), m), temperature)
        prev = sample(target[prev], t).token_ids
        out.append(prev)
    return torch.stack(out, 1)


def _speculative(target: torch.Tensor, draft: torch.Tensor | None, context: int, seeds: torch.Tensor,
                 temperature: float, gen: torch.Generator) -> tuple[torch.Tensor, float]:
    """LENGTH tokens per seed by verify steps of K proposals: from the draft table `draft` (its
    own draws, q for the rule), or n-gram-like point masses (None: the target's argmax chain or a
    random token, half and half). Returns (N, LENGTH) and the acceptance rate."""
    n = seeds.shape[0]
    tokens = [[] for _ in range(n)]
    prev = torch.full((n,), context, dtype=torch.int64)
    m = torch.zeros(n, dtype=torch.int64)
    proposed = accepted_total = 0
    live = torch.arange(n)
    while live.numel():
        b = live.numel()
        s, base = seeds[live], m[live]
        # Proposals d_1..d_K and the draft's q_0..q_{K-1}, chained through its own choices.
        props, qs = [], []
        ctx = prev[live]
        for j in range(K):
            if draft is not None:
                t = _tensors(b, s, base + j, temperature)
                q = draft_distribution(draft[ctx], t)
                d = draft_draw(q, t)
                qs.append(q)
            else:
                greedy = target[ctx].argmax(-1)
                d = torch.where(torch.rand(b, generator=gen) < 0.5, greedy, torch.randint(0, V, (b,), generator=gen))
            props.append(d)
            ctx = d
        d = torch.stack(props, 1)  # (b, K)
        contexts = torch.cat([prev[live][:, None], d], 1)  # row j's previous token: (b, K + 1)
        logits = target[contexts.reshape(-1)]  # (b * (K + 1), V)
        steps = (base[:, None] + torch.arange(K + 1)).reshape(-1)
        t = _tensors(b * (K + 1), s.repeat_interleave(K + 1), steps, temperature)
        next_ids = torch.cat([d, torch.full((b, 1), -1)], 1).reshape(-1)
        rows = (torch.arange(b)[:, None] * (K + 1) + torch.arange(K)).reshape(-1)
        dp = DraftProbs(torch.stack(qs, 1).reshape(b * K, V)) if draft is not None else None
        out, acc = verify(logits, t, next_ids, rows if dp is not None else None, dp)
        tok, acc = out.token_ids.view(b, K + 1), acc.view(b, K + 1)
        a = acc[:, :K].long().cumprod(1).sum(1)  # leading accepted proposals
        proposed += b * K
        accepted_total += int(a.sum())
        for i in range(b):
            row = int(live[i])
            tokens[row] += tok[i, :int(a[i]) + 1].tolist()
            prev[row] = tokens[row][-1]
            m[row] += int(a[i]) + 1
        live = torch.tensor([i for i in range(n) if len(tokens[i]) < LENGTH], dtype=torch.int64)
    return torch.tensor([t[:LENGTH] for t in tokens]), accepted_total / proposed


def _exact(target: torch.Tensor, context: int, temperature: float) -> torch.Tensor:
    """Probability of every LENGTH-token sequence, in `_sequence_index` order."""
    p = torch.softmax(target.double() / temperature, -1)  # (V, V): row = previous token
    seq = torch.cartesian_prod(*[torch.arange(V)] * LENGTH)
    out = p[context, seq[:, 0]]
    for i in range(1, LENGTH):
        out = out * p[seq[:, i - 1], seq[:, i]]
    return out


@pytest.mark.parametrize("proposer", ["draft", "ngram"])
def test_speculation_keeps_the_output_distribution(proposer, rng):
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    temperature = rng.choice([0.7, 1.0, 1.3])
    target = torch.randn(V, V, generator=gen) * 1.5
    draft = target + torch.randn(V, V, generator=gen) if proposer == "draft" else None  # a related, worse model
    context = rng.randrange(V)
    n = 30_000
    seeds = torch.tensor(random.Random(rng.random()).sample(range(2**40), n), dtype=torch.int64)
    spec, rate = _speculative(target, draft, context, seeds, temperature, gen)
    assert 0.1 < rate < 0.95, f"acceptance {rate:.2f}: the test should see both outcomes often"
    counts = torch.bincount(_sequence_index(spec), minlength=V ** LENGTH).double()
    stat, p = _chi_square_p(counts, n * _exact(target, context, temperature))
    assert p > ALPHA, f"speculative samples differ from the exact distribution: chi2 {stat:.1f}, p {p:.2e}"
    plain = _plain(target, context, seeds, temperature)
    plain_counts = torch.bincount(_sequence_index(plain), minlength=V ** LENGTH).double()
    stat, p = _homogeneity_p(counts, plain_counts)
    assert p > ALPHA, f"speculative and plain samples differ: chi2 {stat:.1f}, p {p:.2e}"
    if proposer == "ngram":
        # Stronger: point-mass proposals are judged by the sampler's own race, so each seed
        # decodes exactly what plain decoding decodes.
        assert torch.equal(spec, plain)


def test_greedy_rows_accept_the_argmax_only(rng):
    """Temperature 0 beside sampled rows in one verify: a greedy row accepts a proposal iff it is
    the argmax, and emits the argmax where it stops, with or without a draft distribution."""
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    n, vocab = 64, 11
    logits = torch.randn(n, vocab, generator=gen)
    greedy = torch.rand(n, generator=gen) < 0.5
    params = [SamplingParams(temperature=0.0 if g else 1.0) for g in greedy.tolist()]
    t = SamplingTensors.build(params, list(range(n)), [0] * n, [[0]] * n, [[] for _ in range(n)], vocab, "cpu")
    argmax = logits.argmax(-1)
    next_ids = torch.where(torch.rand(n, generator=gen) < 0.5, argmax, torch.randint(0, vocab, (n,), generator=gen))
    q = torch.softmax(torch.randn(n, vocab, generator=gen), -1)
    for dp, rows in ((None, None), (DraftProbs(q), torch.arange(n))):
        out, acc = verify(logits, t, next_ids, rows, dp)
        assert torch.equal(acc[greedy], (next_ids == argmax)[greedy])
        assert torch.equal(out.token_ids[greedy], argmax[greedy])
