"""The torch reference ops against a naive dense attention over un-paged float32 K/V.

Inputs are fresh random tensors each run, drawn from the `gen` fixture (seeded from `rng`): the
tolerances must hold for any draw.
"""

from __future__ import annotations

import math

import pytest
import torch

from pie.kernels import reference as ref
from pie.kernels.reference import (
    dequantize,
    paged_attention,
    paged_attention_decode,
    quantize_per_token_head,
    write_kv_cache,
)

D = 32


def make_cache(num_blocks: int, block_size: int, hkv: int, dtype: torch.dtype,
               poison: bool = False):
    shape = (num_blocks, block_size, hkv, D)
    if dtype == torch.int8:
        fill = 99 if poison else 0
        k = torch.full(shape, fill, dtype=dtype)
        v = torch.full(shape, fill, dtype=dtype)
        scale_shape = (num_blocks, hkv, block_size)  # head-major per page
        ks = torch.full(scale_shape, math.nan if poison else 0.0, dtype=ref.SCALE_DTYPE)
        vs = torch.full(scale_shape, math.nan if poison else 0.0, dtype=ref.SCALE_DTYPE)
        return k, v, ks, vs
    fill = math.nan if poison else 0.0
    return torch.full(shape, fill, dtype=dtype), torch.full(shape, fill, dtype=dtype), None, None


def dense_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                 window: int | None = None) -> torch.Tensor:
    """q (L, Hq, D) the last L of S tokens; k, v (S, Hkv, D) -> (L, Hq, D), float64 throughout.
    window: each query sees only its last `window` keys (itself included)."""
    q_len, hq, _ = q.shape
    seq_len, hkv, _ = k.shape
    k = k.double().repeat_interleave(hq // hkv, dim=1)  # (S, Hq, D)
    v = v.double().repeat_interleave(hq // hkv, dim=1)
    scores = torch.einsum("lhd,shd->hls", q.double(), k) * scale  # (Hq, L, S)
    pos = torch.arange(seq_len - q_len, seq_len)[:, None]
    keys = torch.arange(seq_len)[None, :]
    hidden = keys > pos
    if window is not None:
        hidden |= keys <= pos - window
    scores = scores.masked_fill(hidden, -math.inf)
    return torch.einsum("hls,shd->lhd", scores.softmax(-1), v)


class Case:
    """B sequences written into a paged cache with shuffled block tables, plus packed queries."""

    def __init__(self, seq_lens: list[int], q_lens: list[int], *, gen: torch.Generator, block_size: int,
                 hkv: int, group: int, dtype: torch.dtype, pad_value: int = -1):
        self.seq_lens, self.q_lens = seq_lens, q_lens
        self.block_size, self.hkv, self.hq = block_size, hkv, hkv * group
        blocks_per_seq = [-(-s // block_size) for s in seq_lens]
        num_blocks = sum(blocks_per_seq) + 3  # a few blocks nobody owns
        self.k_cache, self.v_cache, self.k_scale, self.v_scale = make_cache(
            num_blocks, block_size, hkv, dtype)
        perm = torch.randperm(num_blocks, generator=gen).tolist()
        max_blocks = max(blocks_per_seq) + 2  # padding columns past every sequence's blocks
        self.block_tables = torch.full((len(seq_lens), max_blocks), pad_value, dtype=torch.int32)
        self.k, self.v = [], []
        for i, (s, n) in enumerate(zip(seq_lens, blocks_per_seq)):
            table = [perm.pop() for _ in range(n)]
            self.block_tables[i, :n] = torch.tensor(table, dtype=torch.int32)
            k, v = torch.randn(s, hkv, D, generator=gen), torch.randn(s, hkv, D, generator=gen)
            slots = torch.tensor([table[p // block_size] * block_size + p % block_size
                                  for p in range(s)])
            write_kv_cache(k, v, self.k_cache, self.v_cache, self.k_scale, self.v_scale, slots)
            self.k.append(k)
            self.v.append(v)
        self.q = torch.randn(sum(q_lens), self.hq, D, generator=gen)
        self.query_start_loc = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).int()
        self.seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)
        self.scale = D ** -0.5

    def run(self, **kw) -> torch.Tensor:
        return paged_attention(self.q, self.k_cache, self.v_cache, self.k_scale, self.v_scale,
                               self.block_tables, self.seq_lens_t, self.query_start_loc,
                               self.scale, **kw)

    def new_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The new tokens' own K/V, packed like q (T, Hkv, D): what the caller just wrote."""
        k = torch.cat([k[s - lq:] for k, s, lq in zip(self.k, self.seq_lens, self.q_lens)])
        v = torch.cat([v[s - lq:] for v, s, lq in zip(self.v, self.seq_lens, self.q_lens)])
        return k, v

    def expected(self, from_cache: bool, *, new_exact: bool = False, window: int | None = None) -> torch.Tensor:
        """Dense attention over the original K/V, or (from_cache) over what the cache holds; with
        new_exact, the new tokens' own K/V are the original ones even then."""
        outs = []
        for i, (s, lq) in enumerate(zip(self.seq_lens, self.q_lens)):
            k, v = self.k[i], self.v[i]
            if from_cache:
                if self.k_cache.dtype == torch.int8:
                    kc = dequantize(*quantize_per_token_head(k))
                    vc = dequantize(*quantize_per_token_head(v))
                else:
                    kc, vc = k.to(self.k_cache.dtype).float(), v.to(self.v_cache.dtype).float()
                if new_exact:
                    kc, vc = torch.cat((kc[:s - lq], k[s - lq:])), torch.cat((vc[:s - lq], v[s - lq:]))
                k, v = kc, vc
            lo = int(self.query_start_loc[i])
            outs.append(dense_causal(self.q[lo:lo + lq], k, v, self.scale, window))
        return torch.cat(outs)


def rel_err(out: torch.Tensor, expected: torch.Tensor) -> float:
    return float((out.double() - expected).abs().max() / expected.abs().max())


# (seq_lens, q_lens): block-size multiples and not, prefill from scratch, chunked prefill with
# cached context, decode, and all of them mixed in one call.
SHAPES = {
    "prefill": ([7, 13], [7, 13]),
    "chunked": ([21, 40], [5, 8]),
    "decode": ([1, 9, 16, 33], [1, 1, 1, 1]),
    "mixed": ([17, 5, 30, 8, 1], [1, 5, 12, 1, 1]),
}


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("block_size", [4, 16])
def test_paged_attention_fp32_matches_dense(shape: str, group: int, block_size: int, gen) -> None:
    case = Case(*SHAPES[shape], gen=gen, block_size=block_size, hkv=2, group=group, dtype=torch.float32)
    out = case.run()
    assert out.shape == case.q.shape and out.dtype == torch.float32
    assert rel_err(out, case.expected(from_cache=False)) <= 1e-5


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("group", [1, 2, 4])
def test_paged_attention_int8(shape: str, group: int, gen) -> None:
    case = Case(*SHAPES[shape], gen=gen, block_size=8, hkv=2, group=group, dtype=torch.int8)
    out = case.run()
    # Exact up to float32 rounding against what the cache holds ...
    assert rel_err(out, case.expected(from_cache=True)) <= 1e-5
    # ... and close to the unquantized attention: each K/V element is off by at most absmax/254.
    # Worst seen over 2,400 draws: 0.032.
    assert float((out.double() - case.expected(from_cache=False)).abs().max()) <= 0.06


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.int8, torch.bfloat16])
def test_paged_attention_new_kv_exact(shape: str, dtype: torch.dtype, gen) -> None:
    """With the new tokens' K/V given, they are used as computed; earlier tokens come from the
    cache (as it rounded them)."""
    case = Case(*SHAPES[shape], gen=gen, block_size=8, hkv=2, group=2, dtype=dtype)
    k_new, v_new = case.new_kv()
    out = case.run(k_new=k_new, v_new=v_new)
    assert rel_err(out, case.expected(from_cache=True, new_exact=True)) <= 1e-5
    if shape == "prefill":  # nothing came from the cache: exact
        assert rel_err(out, case.expected(from_cache=False)) <= 1e-5


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("window", [1, 3, 8, 100])
@pytest.mark.parametrize("new_kv", [False, True])
def test_paged_attention_sliding_window(shape: str, window: int, new_kv: bool, gen) -> None:
    case = Case(*SHAPES[shape], gen=gen, block_size=4, hkv=2, group=2, dtype=torch.float32)
    kw = dict(zip(("k_new", "v_new"), case.new_kv())) if new_kv else {}
    out = case.run(window=window, **kw)
    assert rel_err(out, case.expected(from_cache=False, window=window)) <= 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_paged_attention_half_caches(dtype: torch.dtype, gen) -> None:
    case = Case(*SHAPES["mixed"], gen=gen, block_size=4, hkv=2, group=2, dtype=dtype)
    assert rel_err(case.run(), case.expected(from_cache=True)) <= 1e-5
    case.q = case.q.to(dtype)  # output follows q's dtype
    out = case.run()
    assert out.dtype == dtype
    assert rel_err(out, case.expected(from_cache=True)) <= 2e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.int8])
@pytest.mark.parametrize("pad_value", [0, -1])
def test_decode_fast_path_equals_general_path(dtype: torch.dtype, pad_value: int, monkeypatch, gen) -> None:
    """The batched decode path (paged_attention_decode) against the per-sequence loop that
    prefills take, and against dense attention; paged_attention sends decode batches down it."""
    case = Case([3, 8, 27, 1, 12], [1] * 5, gen=gen, block_size=4, hkv=2, group=4, dtype=dtype,
                pad_value=pad_value)
    fast = paged_attention_decode(case.q, case.k_cache, case.v_cache, case.k_scale,
                                  case.v_scale, case.block_tables, case.seq_lens_t, case.scale)
    general = torch.cat([
        ref._attend_sequence(case.q[i:i + 1], case.k_cache, case.v_cache, case.k_scale,
                             case.v_scale, case.block_tables[i], s, case.scale)
        for i, s in enumerate(case.seq_lens)])
    torch.testing.assert_close(fast, general, rtol=1e-5, atol=1e-6)
    assert rel_err(fast, case.expected(from_cache=True)) <= 1e-5

    calls = []

    def spy(*args, **kwargs):
        calls.append(1)
        return paged_attention_decode(*args, **kwargs)

    monkeypatch.setattr(ref, "paged_attention_decode", spy)
    for kw in ({}, {"max_query_len": 1}):
        calls.clear()
        assert torch.equal(case.run(**kw), fast) and calls == [1], kw


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_write_kv_cache_skips_padding_slots(dtype: torch.dtype, gen) -> None:
    num_blocks, block_size, hkv = 4, 4, 2
    k_cache, v_cache, k_scale, v_scale = make_cache(num_blocks, block_size, hkv, dtype, poison=True)
    t = 9
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:t]
    pad = torch.tensor([0, 3, 4, 8])
    slots[pad] = -1
    k, v = torch.randn(t, hkv, D, generator=gen), torch.randn(t, hkv, D, generator=gen)
    write_kv_cache(k, v, k_cache, v_cache, k_scale, v_scale, slots.int())

    written = slots[slots >= 0]
    keep = slots >= 0
    for x, cache, scale in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        flat = cache.view(-1, hkv, D)
        if dtype == torch.int8:
            q, s = quantize_per_token_head(x[keep])
            assert torch.equal(flat[written], q)
            by_slot = scale.transpose(1, 2).reshape(-1, hkv)  # (num_slots, Hkv)
            assert torch.equal(by_slot[written], s)
            untouched = torch.isnan(by_slot).all(-1)
            assert bool((flat[untouched] == 99).all())
        else:
            assert torch.equal(flat[written], x[keep].to(dtype))
            untouched = torch.isnan(flat.float()).all(-1).all(-1)
        # Exactly the valid slots were written; the -1 tokens went nowhere.
        assert int((~untouched).sum()) == written.numel()
        assert not bool(untouched[written].any())


def test_write_kv_cache_all_padding_is_a_no_op(gen) -> None:
    k_cache, v_cache, _, _ = make_cache(2, 4, 1, torch.float32, poison=True)
    k = torch.randn(3, 1, D, generator=gen)
    write_kv_cache(k, k, k_cache, v_cache, None, None, torch.full((3,), -1))
    assert bool(torch.isnan(k_cache).all()) and bool(torch.isnan(v_cache).all())


def test_quantize_error_bound(gen) -> None:
    # Magnitudes spread over several orders, plus one all-zero (token, head) vector.
    x = torch.randn(64, 4, D, generator=gen) * torch.logspace(-3, 3, 64)[:, None, None]
    x[5, 2] = 0.0
    q, scale = quantize_per_token_head(x)
    assert q.dtype == torch.int8 and scale.dtype == torch.float16 and scale.shape == (64, 4)
    assert int(q.abs().max()) <= 127
    # The largest element of each vector maps to +-127 (above the scale's floor).
    assert bool((q.abs().amax(-1)[scale > ref.SCALE_MIN] == 127).all())
    # The scale is the fp16 nearest to absmax / 127 (or the floor), and values are within half a
    # step of it, but where fp16's rounding put the scale below absmax / 127 and clamped the max.
    absmax = x.abs().amax(-1)
    assert torch.equal(scale, (absmax / 127).clamp_min(ref.SCALE_MIN).half())
    deq = dequantize(q, scale)
    bound = scale.float()[..., None] / 2 * (1 + 1e-5) + (absmax - 127 * scale.float()).clamp_min(0)[..., None]
    assert bool(((x - deq).abs() <= bound).all())
    assert bool((deq[5, 2] == 0).all())
