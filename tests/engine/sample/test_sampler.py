"""Sampler tests on CPU (and on CUDA when present): exact selection rules, seeded determinism
independent of the batch, distribution of the exponential race, penalties against a plain
per-row reference, and raw logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from pie.engine.sample.sampler import _apply_top_k_top_p, apply_penalties, hash_uniform, sample
from pie.engine.sample.tensors import SamplingTensors, apply_logit_adds
from pie.engine.sampling_params import SamplingParams

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def build(params, *, seeds=None, steps=None, prompts=None, outputs=None, vocab=32, device="cpu"):
    n = len(params)
    return SamplingTensors.build(
        params,
        seeds if seeds is not None else list(range(n)),
        steps if steps is not None else [0] * n,
        prompts if prompts is not None else [[0]] * n,
        outputs if outputs is not None else [[]] * n,
        vocab, device)


def rand_logits(b, v, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, v, generator=g) * 3).to(device)


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_is_argmax(device):
    logits = rand_logits(8, 50, device=device)
    t = build([SamplingParams(temperature=0.0)] * 8, vocab=50, device=device)
    assert t.all_greedy
    out = sample(logits, t)
    assert torch.equal(out.token_ids, logits.argmax(-1))
    assert out.token_ids.dtype == torch.int64 and out.top_ids is None and out.top_logprobs is None


@pytest.mark.parametrize("device", DEVICES)
def test_top_k_1_equals_greedy_in_mixed_batch(device):
    logits = rand_logits(6, 40, seed=1, device=device)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.5, top_k=1)] * 3
    t = build(params, seeds=[11, 12, 13, 14, 15, 16], vocab=40, device=device)
    assert not t.all_greedy and t.any_greedy and t.any_top_k
    assert torch.equal(sample(logits, t).token_ids, logits.argmax(-1))


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_row_independent_of_batch_and_position(device):
    v = 64
    target = rand_logits(1, v, seed=2, device=device)
    p = SamplingParams(temperature=1.0, top_p=0.95)
    alone = sample(target, build([p], seeds=[1234], steps=[7], vocab=v, device=device)).token_ids[0]
    others = rand_logits(5, v, seed=3, device=device)
    for row in range(6):
        logits = torch.cat([others[:row], target, others[row:]])
        params = [SamplingParams(temperature=0.7, top_k=5)] * 6
        params[row] = p
        seeds = [99 + i for i in range(6)]
        seeds[row] = 1234
        steps = [3] * 6
        steps[row] = 7
        got = sample(logits, build(params, seeds=seeds, steps=steps, vocab=v, device=device))
        assert got.token_ids[row] == alone


def test_different_steps_and_seeds_give_different_draws():
    v = 16
    logits = torch.zeros(1, v)  # uniform: every draw is informative
    p = [SamplingParams(temperature=1.0)]
    by_step = {int(sample(logits, build(p, seeds=[5], steps=[s], vocab=v)).token_ids[0])
               for s in range(40)}
    by_seed = {int(sample(logits, build(p, seeds=[s], steps=[0], vocab=v)).token_ids[0])
               for s in range(40)}
    assert len(by_step) >= 8 and len(by_seed) >= 8
    u = hash_uniform(torch.tensor([5, 5, 6]), torch.tensor([0, 1, 0]), 1000)
    assert not torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2])
    assert torch.equal(u, hash_uniform(torch.tensor([5, 5, 6]), torch.tensor([0, 1, 0]), 1000))


def test_hash_uniform_is_open_unit_interval_and_uniform():
    seeds = torch.tensor([0, 1, 2**62, 2**63 - 1, 123456789], dtype=torch.int64)
    steps = torch.tensor([0, 1, 5, 2**40, 3], dtype=torch.int64)
    u = hash_uniform(seeds, steps, 200_000).double()
    assert u.min() > 0 and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 2e-3
    assert abs(u.var().item() - 1 / 12) < 1e-3
    hist = torch.histc(u.flatten(), bins=10, min=0, max=1)
    assert (hist / u.numel() - 0.1).abs().max() < 3e-3
    # Neighbouring vocab entries are not correlated.
    flat = u[0]
    corr = torch.corrcoef(torch.stack([flat[:-1], flat[1:]]))[0, 1]
    assert abs(corr.item()) < 0.02


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_empirical_distribution_matches_softmax(temperature):
    v, n = 6, 20_000
    logits = torch.tensor([[1.0, 0.5, 0.0, -0.5, 2.0, -1.0]])
    params = [SamplingParams(temperature=temperature)] * n
    t = build(params, seeds=list(range(n)), vocab=v)
    counts = torch.bincount(sample(logits.expand(n, v), t).token_ids, minlength=v).double()
    expected = torch.softmax(logits[0].double() / temperature, -1) * n
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    assert chi2 < 25.0, (counts, expected)  # 5 dof: p(chi2 > 25) ~ 1e-4


def test_filters_never_pick_excluded_tokens():
    b, v = 400, 50
    logits = rand_logits(b, v, seed=4)
    params = []
    for i in range(b):
        kind = i % 4
        params.append([SamplingParams(temperature=1.3, top_k=4),
                       SamplingParams(temperature=0.8, top_p=0.5),
                       SamplingParams(temperature=1.0, min_p=0.2),
                       SamplingParams(temperature=1.0, top_k=10, top_p=0.7, min_p=0.05)][kind])
    t = build(params, seeds=[1000 + i for i in range(b)], steps=[i % 7 for i in range(b)], vocab=v)
    tokens = sample(logits, t).token_ids.tolist()
    for i, (p, tok) in enumerate(zip(params, tokens)):
        row = logits[i].double()
        probs = torch.softmax(row / p.temperature, -1)
        order = torch.argsort(row, descending=True).tolist()
        allowed = set(order)
        if p.min_p > 0:
            allowed &= {j for j in range(v) if probs[j] >= p.min_p * probs.max()}
        if p.top_k:
            allowed &= set(order[:p.top_k])
        if p.top_p < 1:
            # Smallest prefix of the sorted (already filtered) distribution reaching top_p.
            kept = [j for j in order if j in allowed]
            pk = probs[kept] / probs[kept].sum()
            cum, prefix = 0.0, []
            for j, q in zip(kept, pk.tolist()):
                prefix.append(j)
                cum += q
                if cum >= p.top_p - 1e-6:
                    break
            allowed = set(prefix)
        assert tok in allowed, (i, p, tok, sorted(allowed))
    # The filters leave room for randomness: not every row took its argmax.
    assert sum(tok != logits[i].argmax().item() for i, tok in enumerate(tokens)) > b // 10


@pytest.mark.parametrize("params, kept", [
    (SamplingParams(top_k=3), {0, 1, 2}),
    (SamplingParams(top_p=0.6), {0, 1}),  # 0.4 + 0.25 reaches 0.6 at the second token
    (SamplingParams(top_p=0.35), {0}),
    (SamplingParams(top_p=0.66), {0, 1, 2}),
    (SamplingParams(min_p=0.45), {0, 1, 2}),  # 0.2 / 0.4 = 0.5 >= 0.45
    (SamplingParams(min_p=0.55), {0, 1}),
    (SamplingParams(top_k=4, top_p=0.85, min_p=0.2), {0, 1, 2}),  # min_p drops 4, top_p then 3
    (SamplingParams(), set(range(5))),
])
def test_filters_keep_exactly_the_allowed_set(params, kept):
    probs = torch.tensor([[0.4, 0.25, 0.2, 0.1, 0.05]], dtype=torch.float64)
    logits = probs.log().float()
    n = 3000
    t = build([params] * n, seeds=list(range(n)), vocab=5)
    seen = set(sample(logits.expand(n, 5), t).token_ids.tolist())
    assert seen == kept


def test_partial_sort_matches_full_sort():
    b, v = 64, 300
    logits = rand_logits(b, v, seed=9)
    g = torch.Generator().manual_seed(9)
    top_k = torch.randint(1, 20, (b,), generator=g)
    top_p = torch.rand(b, generator=g) * 0.9 + 0.1
    top_p[::5] = 1.0
    full = _apply_top_k_top_p(logits, top_k, top_p, v)
    part = _apply_top_k_top_p(logits, top_k, top_p, int(top_k.max()))
    assert torch.equal(full, part)
    assert ((part > float("-inf")).sum(-1) <= top_k).all()
    t = build([SamplingParams(top_k=int(k), top_p=float(p)) for k, p in zip(top_k, top_p)]
              + [SamplingParams(temperature=0.0)], vocab=v, seeds=list(range(b + 1)))
    assert t.max_top_k == int(top_k.max())
    tokens = sample(torch.cat([logits, logits[:1]]), t).token_ids
    assert (full.gather(1, tokens[:b, None]) > float("-inf")).all()


def test_top_p_keeps_at_least_one_token():
    logits = torch.tensor([[10.0, 0.0, 0.0, 0.0]])
    params = [SamplingParams(temperature=1.0, top_p=1e-6)] * 50
    t = build(params, seeds=list(range(50)), vocab=4)
    assert (sample(logits.expand(50, 4), t).token_ids == 0).all()


def reference_penalties(row, p, prompt, output):
    row = row.tolist()
    for tok in set(prompt) | set(output):
        if p.repetition_penalty != 1.0:
            row[tok] = row[tok] / p.repetition_penalty if row[tok] > 0 else row[tok] * p.repetition_penalty
    for tok in set(output):
        row[tok] -= p.frequency_penalty * output.count(tok) + p.presence_penalty
    return torch.tensor(row)


@pytest.mark.parametrize("device", DEVICES)
def test_penalties_match_reference(device):
    v = 30
    g = torch.Generator().manual_seed(5)
    params = [
        SamplingParams(repetition_penalty=1.3),
        SamplingParams(repetition_penalty=0.7, frequency_penalty=0.5),
        SamplingParams(presence_penalty=1.2),
        SamplingParams(frequency_penalty=-0.4, presence_penalty=0.3, repetition_penalty=2.0),
        SamplingParams(),  # untouched row in a penalized batch
    ]
    prompts = [torch.randint(0, v, (int(n),), generator=g).tolist() for n in (3, 10, 1, 7, 4)]
    outputs = [torch.randint(0, v, (int(n),), generator=g).tolist() for n in (5, 0, 12, 9, 6)]
    logits = rand_logits(len(params), v, seed=6)
    t = build(params, prompts=prompts, outputs=outputs, vocab=v, device=device)
    assert t.any_penalties
    got = apply_penalties(logits.to(device), t).cpu()
    for i, p in enumerate(params):
        ref = reference_penalties(logits[i], p, prompts[i], outputs[i])
        torch.testing.assert_close(got[i], ref, rtol=1e-6, atol=1e-6)


def test_penalties_apply_to_greedy_and_skip_when_off():
    logits = torch.tensor([[3.0, 2.9, 0.0, -1.0]])
    p = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    t = build([p], prompts=[[0]], outputs=[[]], vocab=4)
    assert sample(logits, t).token_ids.item() == 1  # 3.0 / 2 < 2.9
    t = build([SamplingParams(temperature=0.0, frequency_penalty=2.0)], prompts=[[0]],
              outputs=[[1, 1, 0, 0]], vocab=4)
    assert sample(logits, t).token_ids.item() == 2  # 3-4=-1, 2.9-4=-1.1, 0
    plain = build([SamplingParams(temperature=0.0)], vocab=4)
    assert not plain.any_penalties and plain.output_counts is None and plain.seen_mask is None


@pytest.mark.parametrize("device", DEVICES)
def test_logprobs_are_raw_log_softmax(device):
    v = 40
    logits = rand_logits(4, v, seed=7, device=device)
    params = [SamplingParams(temperature=0.0, logprobs=3),
              SamplingParams(temperature=0.5, repetition_penalty=1.5, logprobs=5),
              SamplingParams(temperature=2.0, top_k=3),
              SamplingParams(temperature=1.0, frequency_penalty=1.0, logprobs=1)]
    t = build(params, prompts=[[1, 2]] * 4, outputs=[[3, 3]] * 4, vocab=v, device=device)
    out = sample(logits, t)
    ref = torch.log_softmax(logits, -1)
    assert out.top_ids.shape == (4, 5) and out.top_logprobs.shape == (4, 5)
    torch.testing.assert_close(out.logprobs, ref.gather(1, out.token_ids[:, None]).squeeze(1))
    torch.testing.assert_close(out.top_logprobs, ref.gather(1, out.top_ids))
    ref_top = ref.topk(5, -1)
    assert torch.equal(out.top_ids, ref_top.indices)
    assert (out.top_logprobs[:, :-1] >= out.top_logprobs[:, 1:]).all()


@pytest.mark.parametrize("device", DEVICES)
def test_no_logprobs_asked_no_pass_over_the_vocabulary(device, monkeypatch):
    """A batch where no row asks for logprobs skips log_softmax's passes over (B, V): its logprobs
    are zeros (never sent), and its tokens are those of the same batch with logprobs asked."""
    logits = rand_logits(4, 40, seed=3, device=device)
    plain = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_k=10)] * 2
    calls = []
    logsumexp = torch.logsumexp
    monkeypatch.setattr(torch, "logsumexp", lambda *a, **k: calls.append(1) or logsumexp(*a, **k))
    out = sample(logits, build(plain, vocab=40, device=device))
    assert calls == [] and out.top_ids is None and out.top_logprobs is None
    assert torch.equal(out.logprobs, torch.zeros(4, device=device))
    asked = [SamplingParams(temperature=0.0, logprobs=1)] + plain[1:]
    with_logprobs = sample(logits, build(asked, vocab=40, device=device))
    assert calls and torch.equal(with_logprobs.token_ids, out.token_ids)
    torch.testing.assert_close(with_logprobs.logprobs,
                               torch.log_softmax(logits, -1).gather(1, out.token_ids[:, None]).squeeze(1))


def test_input_logits_unchanged():
    logits = rand_logits(3, 20, seed=8)
    before = logits.clone()
    params = [SamplingParams(temperature=0.9, top_k=5, top_p=0.9, min_p=0.1, repetition_penalty=1.2,
                             presence_penalty=0.5, logprobs=2)] * 3
    sample(logits, build(params, prompts=[[1]] * 3, outputs=[[2]] * 3, vocab=20))
    assert torch.equal(logits, before)


def test_build_flags_and_shapes():
    params = [SamplingParams(temperature=0.0, top_k=5, top_p=0.5),  # filters ignored when greedy
              SamplingParams(temperature=1.0, top_k=0, logprobs=4)]
    t = build(params, seeds=[2**63 - 1, 0], steps=[0, 9], vocab=10)
    assert t.top_k.tolist() == [5, 10]
    assert t.temperature.tolist() == [1.0, 1.0] and t.greedy.tolist() == [True, False]
    assert not (t.any_top_k or t.any_top_p or t.any_min_p or t.all_greedy or t.any_penalties)
    assert t.max_top_k == 10 and t.max_logprobs == 4 and t.seed.dtype == torch.int64 and t.seed[0].item() == 2**63 - 1
    with pytest.raises(ValueError):
        SamplingTensors.build(params, [1], [0, 0], [[0], [0]], [[], []], 10, "cpu")


def test_large_vocab_distribution_sanity():
    # A peaked distribution over a big vocabulary: the race still favours the mode at the
    # right rate (p(mode) = e^4 / (e^4 + 999)).
    v, n = 1000, 4000
    logits = torch.zeros(1, v)
    logits[0, 17] = 4.0
    t = build([SamplingParams()] * n, seeds=list(range(n)), vocab=v)
    hits = (sample(logits.expand(n, v), t).token_ids == 17).double().mean().item()
    p = math.exp(4) / (math.exp(4) + v - 1)
    assert abs(hits - p) < 4 * math.sqrt(p * (1 - p) / n)


def test_pending_ids_on_the_device_count_like_listed_ones(rng):
    """Async scheduling: a newest output id still on the device (a placeholder, not in the host
    list) feeds the penalty tables exactly as if it were listed."""
    vocab = 50
    params = [SamplingParams(repetition_penalty=1.5, frequency_penalty=0.7, presence_penalty=0.3),
              SamplingParams(frequency_penalty=1.0), SamplingParams(), SamplingParams(repetition_penalty=2.0)]
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(1, 8))] for _ in params]
    outputs = [[rng.randrange(vocab) for _ in range(rng.randint(1, 8))] for _ in params]
    newest = [o[-1] for o in outputs]
    listed = SamplingTensors.build(params=params, seeds=[1] * 4, steps=[len(o) for o in outputs],
                                   prompt_ids=prompts, output_ids=outputs, vocab_size=vocab, device="cpu")
    held = [o[:-1] for o in outputs]
    pending = SamplingTensors.build(params=params, seeds=[1] * 4, steps=[len(o) for o in outputs],
                                    prompt_ids=prompts, output_ids=held, vocab_size=vocab, device="cpu",
                                    pending_ids=([0, 1, 2, 3], [3, 2, 1, 0], torch.tensor(newest[::-1])))
    assert torch.equal(listed.output_counts, pending.output_counts)
    assert torch.equal(listed.seen_mask, pending.seen_mask)


# ---- logit_bias, min_tokens, processed logprobs ---------------------------------------------------

def reference_adjust(row: torch.Tensor, p: SamplingParams, step: int, eos: tuple[int, ...]) -> torch.Tensor:
    """Per-row reference of logit_bias and min_tokens: a plain loop over the row's entries."""
    row = row.clone()
    for token, bias in p.logit_bias.items():
        row[token] += bias
    if step < p.min_tokens:
        for token in set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos)):
            row[token] = float("-inf")
    return row


@pytest.mark.parametrize("device", DEVICES)
def test_logit_bias_and_min_tokens_match_reference(device, rng):
    v, eos = 40, (2, 7)
    params = [
        SamplingParams(logit_bias={3: 5.0, 9: -100.0, 39: 0.5}),
        SamplingParams(min_tokens=4, stop_token_ids=[11]),
        SamplingParams(min_tokens=4, stop_token_ids=[11], ignore_eos=True),
        SamplingParams(min_tokens=2, logit_bias={2: 100.0, 5: -3.0}),  # bias on an EOS it still holds back
        SamplingParams(),  # untouched row in a batch that uses both
        SamplingParams(min_tokens=1, logit_bias={0: 1.0}),  # past its min_tokens: bias only
    ]
    steps = [rng.randrange(10), 1, 3, 0, 5, 1]
    logits = rand_logits(len(params), v, seed=rng.randrange(1000), device=device)
    t = SamplingTensors.build(params, list(range(len(params))), steps, [[0]] * len(params), [[]] * len(params),
                              v, device, eos_token_ids=[eos] * len(params))
    assert t.logit_adds is not None
    got = apply_logit_adds(logits, t.logit_adds, t.step).cpu()
    for i, p in enumerate(params):
        assert torch.equal(got[i], reference_adjust(logits[i].cpu(), p, steps[i], eos)), i


def test_min_tokens_lifts_itself_in_steady_decode():
    """The suppression is decided on the device from the step counter: the tensors reused by
    next_step (no rebuild) let EOS through exactly from step == min_tokens on."""
    v, eos = 8, (2,)
    logits = torch.full((1, v), -5.0)
    logits[0, 2] = 5.0  # EOS is by far the most likely token
    p = SamplingParams(temperature=0.0, min_tokens=3)
    t = SamplingTensors.build([p], [0], [0], [[0]], [[]], v, "cpu", eos_token_ids=[eos])
    picks = []
    for _ in range(5):
        picks.append(int(sample(logits, t).token_ids[0]))
        t = t.next_step()
    assert 2 not in picks[:3] and picks[3:] == [2, 2]


def test_unused_options_cost_nothing():
    params = [SamplingParams(temperature=0.7, top_k=5), SamplingParams(min_tokens=2)]
    t = SamplingTensors.build(params, [0, 1], [0, 2], [[0], [0]], [[], []], 16, "cpu", eos_token_ids=[(2,), (2,)])
    assert t.logit_adds is None  # row 1 has reached its min_tokens already


def test_logit_bias_moves_the_sampled_distribution():
    v, n = 6, 8000
    logits = torch.zeros(1, v)
    p = SamplingParams(temperature=1.0, logit_bias={4: math.log(5.0)})  # token 4: 5x as likely
    t = build([p] * n, seeds=list(range(n)), vocab=v)
    counts = torch.bincount(sample(logits.expand(n, v), t).token_ids, minlength=v).double()
    expected = torch.tensor([1, 1, 1, 1, 5, 1], dtype=torch.float64) / 10 * n
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    assert chi2 < 25.0, counts
    greedy = build([SamplingParams(temperature=0.0, logit_bias={1: 100.0})], vocab=v)
    assert sample(rand_logits(1, v), greedy).token_ids.item() == 1


def reference_processed(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The logits a row's token is chosen from, by the documented order, one row at a time."""
    row = reference_adjust(row, p, 0, ())
    row = reference_penalties(row, p, [1, 2], [3, 3])
    if p.temperature == 0.0:
        return row
    row = row / p.temperature
    probs = torch.softmax(row, -1)
    if p.min_p > 0:
        row = row.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    if p.top_k:
        kth = row.topk(p.top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    return row


@pytest.mark.parametrize("device", DEVICES)
def test_processed_logprobs_are_of_the_logits_sampled_from(device):
    v = 40
    logits = rand_logits(4, v, seed=11, device=device)
    params = [SamplingParams(temperature=0.0, repetition_penalty=1.5, logprobs=3),
              SamplingParams(temperature=0.5, logit_bias={5: 2.0}, frequency_penalty=0.5, logprobs=5),
              SamplingParams(temperature=2.0, top_k=3, logprobs=5),
              SamplingParams(temperature=1.0, min_p=0.2, logprobs=1)]
    t = build(params, prompts=[[1, 2]] * 4, outputs=[[3, 3]] * 4, vocab=v, device=device)
    raw = sample(logits, t)
    out = sample(logits, t, processed_logprobs=True)
    assert torch.equal(raw.token_ids, out.token_ids)  # the mode changes what is reported, not what is drawn
    for i, p in enumerate(params):
        ref = torch.log_softmax(reference_processed(logits[i].cpu(), p), -1)
        tok = int(out.token_ids[i])
        assert math.isfinite(out.logprobs[i].item())
        torch.testing.assert_close(out.logprobs[i].cpu(), ref[tok], rtol=1e-5, atol=1e-5)
        top = out.top_logprobs[i].cpu()
        torch.testing.assert_close(top, ref.topk(5).values, rtol=1e-5, atol=1e-5)
    assert out.top_logprobs[2, 3:].eq(float("-inf")).all()  # top_k=3: the rest were filtered out
