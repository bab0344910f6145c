"""The Triton cache write against `kernels.reference.write_kv_cache`: same bits for int8 values
and scales, padding slots skipped, the rest of a poisoned cache untouched.

Runs in Triton's CPU interpreter when there is no GPU. Fresh random inputs every run, drawn from
the `gen` fixture (tests/kernels/conftest.py) on the CPU and moved to the device.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any @triton.jit runs

import pytest  # noqa: E402

from pie.kernels import reference as ref  # noqa: E402
from pie.kernels.triton_cache_write import write_kv_cache  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def poisoned_cache(num_blocks: int, block_size: int, hkv: int, d: int, dtype: torch.dtype):
    """A cache full of values no write produces: 99 for int8 (values are within +-127 but the
    NaN scales are), NaN for float caches."""
    shape = (num_blocks, block_size, hkv, d)
    if dtype == torch.int8:
        scale_shape = (num_blocks, hkv, block_size)
        return (torch.full(shape, 99, dtype=dtype, device=DEVICE),
                torch.full(shape, 99, dtype=dtype, device=DEVICE),
                torch.full(scale_shape, float("nan"), dtype=torch.float16, device=DEVICE),
                torch.full(scale_shape, float("nan"), dtype=torch.float16, device=DEVICE))
    return (torch.full(shape, float("nan"), dtype=dtype, device=DEVICE),
            torch.full(shape, float("nan"), dtype=dtype, device=DEVICE), None, None)


def clone(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.clone()


def assert_same(got: torch.Tensor, want: torch.Tensor, ulps: int = 0) -> None:
    """Equal, with NaN exactly where the other is NaN; float caches may differ by `ulps` units in
    the last place (the interpreter's cast to bf16 truncates instead of rounding)."""
    assert got.shape == want.shape and got.dtype == want.dtype
    if not got.is_floating_point():
        assert torch.equal(got, want), f"{int((got != want).sum())} elements differ"
        return
    assert torch.equal(got.isnan(), want.isnan())
    ok = ~got.isnan()
    if ulps == 0:
        assert torch.equal(got[ok], want[ok]), f"{int((got[ok] != want[ok]).sum())} differ"
        return
    bits = torch.int32 if got.dtype == torch.float32 else torch.int16
    diff = (got.view(bits).long() - want.view(bits).long()).abs()
    assert int(diff[ok].max()) <= ulps


@pytest.mark.parametrize("cache_dtype,src_dtype", [
    (torch.int8, torch.float32),
    (torch.int8, torch.float16),
    (torch.int8, torch.bfloat16),
    (torch.float16, torch.float32),
    (torch.bfloat16, torch.float32),
    (torch.float32, torch.float16),
])
@pytest.mark.parametrize("hkv,d,block_size", [(2, 64, 16), (3, 128, 32), (8, 64, 16)])
def test_write_matches_reference(cache_dtype, src_dtype, hkv, d, block_size, gen) -> None:
    num_blocks, num_tokens = 5, 23
    kc, vc, ks, vs = poisoned_cache(num_blocks, block_size, hkv, d, cache_dtype)
    # k, v as views into a fused (T, (2 Hkv + 1) D) buffer: row stride past Hkv*D.
    fused = torch.randn(num_tokens, (2 * hkv + 1) * d, generator=gen).to(DEVICE) * 3
    fused = fused.to(src_dtype)
    k = fused[:, : hkv * d].view(num_tokens, hkv, d)
    v = fused[:, hkv * d: 2 * hkv * d].view(num_tokens, hkv, d)
    k[3] = 0  # an all-zero vector: scale eps / 127, values 0
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens].to(DEVICE)
    slots[torch.randperm(num_tokens, generator=gen)[:5]] = -1  # padding tokens
    slots = slots.to(torch.int32 if hkv % 2 else torch.int64)

    want = [clone(t) for t in (kc, vc, ks, vs)]
    ref.write_kv_cache(k, v, *want, slots)
    write_kv_cache(k, v, kc, vc, ks, vs, slots)

    ulps = 1 if cache_dtype == torch.bfloat16 and DEVICE == "cpu" else 0
    assert_same(kc, want[0], ulps)
    assert_same(vc, want[1], ulps)
    if cache_dtype == torch.int8:
        assert_same(ks, want[2])  # the same fp32 bits
        assert_same(vs, want[3])
        # Untouched slots keep their poison; written ones are valid.
        written = torch.zeros(num_blocks * block_size, dtype=torch.bool, device=DEVICE)
        written[slots[slots >= 0].long()] = True
        flat_scale = ks.transpose(1, 2).reshape(-1, hkv)  # (slots, Hkv)
        assert bool(flat_scale[~written].isnan().all())
        assert not bool(flat_scale[written].isnan().any())


def test_round_half_away_from_zero_at_ties() -> None:
    """Exact .5 ties round away from zero in both kernel and reference (torch.round would give
    half to even): x / scale = +-0.5, +-1.5, +-2.5 with absmax 127 makes scale exactly 1."""
    ties = torch.tensor([127.0, 0.5, -0.5, 1.5, -1.5, 2.5, -2.5, 126.5], device=DEVICE)
    x = torch.zeros(1, 1, 32, device=DEVICE)
    x[0, 0, : ties.numel()] = ties
    kc, vc, ks, vs = poisoned_cache(2, 16, 1, 32, torch.int8)
    slots = torch.tensor([17], device=DEVICE)
    write_kv_cache(x, -x, kc, vc, ks, vs, slots)
    got = kc[1, 1, 0, : ties.numel()].tolist()
    assert got == [127, 1, -1, 2, -2, 3, -3, 127]
    assert vc[1, 1, 0, : ties.numel()].tolist() == [-g for g in got]
    assert float(ks[1, 0, 1]) == 1.0
    q, _ = ref.quantize_per_token_head(x)
    assert q[0, 0, : ties.numel()].tolist() == got


def test_all_padding_and_empty_are_no_ops(gen) -> None:
    kc, vc, ks, vs = poisoned_cache(2, 16, 2, 64, torch.int8)
    before = [t.clone() for t in (kc, vc)]
    k = torch.randn(4, 2, 64, generator=gen).to(DEVICE)
    write_kv_cache(k, k, kc, vc, ks, vs, torch.full((4,), -1, device=DEVICE))
    write_kv_cache(k[:0], k[:0], kc, vc, ks, vs, torch.zeros(0, dtype=torch.long, device=DEVICE))
    assert torch.equal(kc, before[0]) and torch.equal(vc, before[1])
    assert bool(ks.isnan().all()) and bool(vs.isnan().all())


def test_rejects_bad_inputs(gen) -> None:
    kc, vc, ks, vs = poisoned_cache(2, 16, 2, 64, torch.int8)
    k = torch.randn(4, 2, 64, generator=gen).to(DEVICE)
    slots = torch.arange(4, device=DEVICE)
    with pytest.raises(AssertionError):  # D not unit-stride
        write_kv_cache(k.transpose(1, 2).contiguous().transpose(1, 2), k, kc, vc, ks, vs, slots)
    with pytest.raises(AssertionError):  # missing scales
        write_kv_cache(k, k, kc, vc, None, None, slots)
    with pytest.raises(AssertionError):  # wrong head count
        write_kv_cache(k[:, :1], k[:, :1], kc, vc, ks, vs, slots)


@pytest.mark.gpu
@pytest.mark.parametrize("cache_dtype", [torch.int8, torch.bfloat16])
def test_write_large_gpu(cache_dtype, gen) -> None:
    num_tokens, hkv, d, block_size = 4096, 8, 128, 16
    num_blocks = num_tokens // block_size + 8
    kc, vc, ks, vs = poisoned_cache(num_blocks, block_size, hkv, d, cache_dtype)
    qkv = torch.randn(num_tokens, 48 * d, generator=gen).to(DEVICE, torch.bfloat16)
    k = qkv[:, 32 * d: 40 * d].view(num_tokens, hkv, d)
    v = qkv[:, 40 * d:].view(num_tokens, hkv, d)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens].to(DEVICE)
    want = [clone(t) for t in (kc, vc, ks, vs)]
    ref.write_kv_cache(k, v, *want, slots)
    write_kv_cache(k, v, kc, vc, ks, vs, slots)
    for got, exp in zip((kc, vc, ks, vs), want):
        if got is not None:
            assert_same(got, exp)
