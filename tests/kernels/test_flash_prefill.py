"""The prefill path through FlashAttention (kernels/flash_prefill.py) and its gather
(kernels/triton_gather.py).

The gather against `kernels.reference.gather_pages`: the same bits, every row of poisoned outputs
written, pages past a sequence's end never read (they hold NaN). Runs in Triton's CPU interpreter
when there is no GPU. The whole path against `kernels.reference.paged_attention` (float32, fresh
random ragged batches with cached prefixes, GQA, sliding windows, every cache dtype) needs CUDA
with FlashAttention. Inputs are drawn from the `gen` fixture (tests/kernels/conftest.py).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any @triton.jit runs

import pytest  # noqa: E402

from pie.kernels import reference as ref  # noqa: E402
from pie.kernels.flash_prefill import paged_prefill, supported  # noqa: E402
from pie.kernels.triton_gather import gather_pages  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def paged_batch(seq_lens: list[int], hkv: int, d: int, block_size: int, dtype: torch.dtype,
                gen: torch.Generator, spare_blocks: int = 3):
    """A cache of shuffled pages holding random K/V for sequences of `seq_lens` tokens, and their
    block tables; every slot no sequence owns (the tails of last pages, spare pages) holds NaN
    (float caches) or NaN scales (int8), so reading one shows."""
    widths = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(widths) + spare_blocks
    shape = (num_blocks, block_size, hkv, d)
    if dtype == torch.int8:
        kc = torch.randint(-127, 128, shape, generator=gen, dtype=torch.int8)
        vc = torch.randint(-127, 128, shape, generator=gen, dtype=torch.int8)
        ks = (torch.rand(num_blocks, hkv, block_size, generator=gen) * 0.05 + 1e-3).to(ref.SCALE_DTYPE)
        vs = (torch.rand(num_blocks, hkv, block_size, generator=gen) * 0.05 + 1e-3).to(ref.SCALE_DTYPE)
    else:
        kc, vc = (torch.randn(shape, generator=gen).to(dtype) for _ in range(2))
        ks = vs = None
    order = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(seq_lens), max(widths), dtype=torch.int32)
    used = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    at = 0
    for i, (n, w) in enumerate(zip(seq_lens, widths)):
        tables[i, :w] = order[at:at + w].to(torch.int32)
        tables[i, w:] = order[-1]  # padding entries point at a spare page
        pos = torch.arange(n)
        used[tables[i, pos // block_size].long(), pos % block_size] = True
        at += w
    if dtype == torch.int8:
        ks[~used.unsqueeze(1).expand_as(ks)] = float("nan")
        vs[~used.unsqueeze(1).expand_as(vs)] = float("nan")
    else:
        kc[~used] = float("nan")
        vc[~used] = float("nan")
    move = (lambda t: None if t is None else t.to(DEVICE))
    return (move(kc), move(vc), move(ks), move(vs), tables.to(DEVICE),
            torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE))


@pytest.mark.parametrize("cache_dtype,out_dtype", [
    (torch.int8, torch.float32), (torch.int8, torch.float16), (torch.float16, torch.float16),
    (torch.float32, torch.float16), (torch.bfloat16, torch.float32),
])
@pytest.mark.parametrize("hkv,d,block_size", [(2, 64, 16), (5, 48, 16), (1, 96, 32)])
def test_gather_matches_reference(cache_dtype, out_dtype, hkv, d, block_size, gen) -> None:
    seq_lens = [int(x) for x in torch.randint(1, 3 * block_size, (4,), generator=gen)]
    seq_lens[1] = block_size  # exactly one page
    kc, vc, ks, vs, tables, lens = paged_batch(seq_lens, hkv, d, block_size, cache_dtype, gen)
    cu = torch.zeros(len(seq_lens) + 1, dtype=torch.int32, device=DEVICE)
    torch.cumsum(lens, 0, out=cu[1:])
    total = sum(seq_lens)
    poison = (torch.full((total, hkv, d), float("nan"), dtype=out_dtype, device=DEVICE),
              torch.full((total, hkv, d), float("nan"), dtype=out_dtype, device=DEVICE))
    k, v = gather_pages(kc, vc, ks, vs, tables, lens, cu, num_tokens=total, max_seq_len=max(seq_lens) + block_size,
                        dtype=out_dtype, out=poison)
    want_k, want_v = ref.gather_pages(kc, vc, ks, vs, tables, lens, out_dtype)
    assert not k.isnan().any() and not v.isnan().any(), "a row was left unwritten, or a foreign slot read"
    assert torch.equal(k, want_k) and torch.equal(v, want_v)


def test_gather_nothing(gen) -> None:
    kc, vc, ks, vs, tables, lens = paged_batch([5], 2, 64, 16, torch.int8, gen)
    cu = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    k, v = gather_pages(kc, vc, ks, vs, tables[:0], lens[:0], cu[:1], num_tokens=0, max_seq_len=0,
                        dtype=torch.float32)
    assert k.shape == v.shape == (0, 2, 64)


needs_flash = pytest.mark.skipif(
    not torch.cuda.is_available() or not supported(torch.empty(1, 1, 64, dtype=torch.bfloat16, device=DEVICE)),
    reason="needs CUDA with torch's FlashAttention")


@pytest.mark.gpu
@needs_flash
@pytest.mark.parametrize("cache_dtype", [torch.int8, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hq,hkv,d", [(8, 8, 64), (32, 8, 128), (12, 2, 80), (4, 1, 256), (28, 4, 96)])
@pytest.mark.parametrize("window", [None, 37])
@pytest.mark.parametrize("cold", [False, True])
def test_prefill_matches_reference(cache_dtype, hq, hkv, d, window, cold, gen) -> None:
    block_size = 16
    # (cached prefix, new tokens) per sequence: a cold prompt, chunks over cached prefixes, a
    # one-token query among them, a chunk that ends mid-page; or whole prompts only
    shapes = [(0, 300), (517, 64), (40, 1), (1000, 257), (3, 130)]
    if cold:
        shapes = [(0, 300), (0, 1), (0, 1000), (0, 131)]
    seq_lens = [c + n for c, n in shapes]
    kc, vc, ks, vs, tables, lens = paged_batch(seq_lens, hkv, d, block_size, cache_dtype, gen)
    q_lens = [n for _, n in shapes]
    qsl = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).to(torch.int32).to(DEVICE)
    q_dtype = torch.float16 if cache_dtype == torch.float16 else torch.bfloat16
    q = torch.randn(sum(q_lens), hq, d, generator=gen).to(DEVICE, q_dtype)
    scale = d ** -0.5
    # The reference on the cache without its poison (its decode rows weigh masked keys by 0, and
    # 0 x NaN is NaN); the path under test reads the poisoned cache.
    clean = (lambda t: None if t is None else (t.nan_to_num(0.0) if t.is_floating_point() else t))
    want = ref.paged_attention(q.float(), *map(clean, (kc, vc, ks, vs)), tables, lens, qsl, scale, window=window)
    out = torch.full_like(q, float("nan"))
    got = paged_prefill(q, kc, vc, ks, vs, tables, lens, qsl, scale, max_query_len=max(q_lens),
                        max_seq_len=max(seq_lens), kv_tokens=sum(seq_lens), window=window, out=out)
    assert got.data_ptr() == out.data_ptr() and not got.isnan().any()
    err = (got.float() - want).abs().max().item()
    assert err <= 2e-2 * want.abs().max().item(), f"max error {err}"


def test_a_large_gather_is_left_to_the_triton_kernel() -> None:
    """The gathered copy's size is the prefill sequences' whole contexts: past GATHER_MAX_BYTES
    (many requests over one long cached prefix) the engine reads the pages in place instead."""
    from pie.kernels.flash_prefill import GATHER_MAX_BYTES, fits

    per_token = 2 * 8 * 128 * 2  # K and V, 8 kv heads of 128, bf16
    assert fits(GATHER_MAX_BYTES // per_token, 8, 128, torch.bfloat16)
    assert not fits(GATHER_MAX_BYTES // per_token + 1, 8, 128, torch.bfloat16)
    assert not fits(200 * 6020, 8, 128, torch.bfloat16)  # 200 requests over a cached 6,000-token prompt
    assert fits(4 * 8192, 8, 128, torch.bfloat16)  # a few long prompts in an 8k-token step
