"""Triton cache write: store the K/V of T new tokens at their slots of the paged cache.

The twin of `kernels.reference.write_kv_cache`, with the same contract and, for int8 caches, the
same bits: the scale is fp16(max(absmax / 127, SCALE_MIN)) and the value
round-half-away-from-zero(x / scale) clamped to +-127, both divisions IEEE-rounded (`tl.div_rn`),
so kernel and reference agree exactly.

One program per token writes K and V of all its kv heads as one [Hkv, D] tile each (Hkv and D
padded to powers of two); padding tokens (slot -1) return at once, so a CUDA graph can carry them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .reference import CACHE_DTYPES, INT8_MAX, SCALE_MIN, _check_cache
from .triton_tile import next_pow2


@triton.jit
def _store_tile(src_ptr, stride_t, stride_h, cache_ptr, scale_ptr, token, slot,
                HKV: tl.constexpr, HKV_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
                BLOCK_SIZE: tl.constexpr, QUANT: tl.constexpr, SCALE_MIN: tl.constexpr,
                QMAX: tl.constexpr):
    """Copy (or quantize) the [Hkv, D] vectors of one token into its cache slot."""
    heads = tl.arange(0, HKV_PAD)
    dims = tl.arange(0, D_PAD)
    head_ok = heads < HKV
    mask = head_ok[:, None] & (dims < D)[None, :]
    src = src_ptr + token * stride_t + heads[:, None].to(tl.int64) * stride_h + dims[None, :]
    x = tl.load(src, mask=mask, other=0.0)
    # The cache is contiguous (num_blocks, block_size, Hkv, D): slot * Hkv * D is its row.
    dst = cache_ptr + slot * (HKV * D) + heads[:, None] * D + dims[None, :]
    if QUANT:
        xf = x.to(tl.float32)
        absmax = tl.max(tl.abs(xf), axis=1)  # (HKV_PAD,)
        scale16 = tl.maximum(tl.div_rn(absmax, QMAX), SCALE_MIN).to(tl.float16)  # round to nearest
        scale = scale16.to(tl.float32)  # the values are quantized against the stored scale
        y = tl.div_rn(xf, scale[:, None])
        r = tl.minimum(tl.floor(tl.abs(y) + 0.5), QMAX)  # half away from zero, then clamp
        qv = tl.where(y < 0, -r, r).to(tl.int8)
        tl.store(dst, qv, mask=mask)
        # Scales are head-major per page: (num_blocks, Hkv, block_size).
        block = slot // BLOCK_SIZE
        offset = slot % BLOCK_SIZE
        tl.store(scale_ptr + block * (HKV * BLOCK_SIZE) + heads * BLOCK_SIZE + offset, scale16,
                 mask=head_ok)
    else:
        tl.store(dst, x.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize_on_alignment=["slot_ptr"])  # a staging-buffer slice: its alignment moves
def _write_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, slot_ptr,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     HKV: tl.constexpr, HKV_PAD: tl.constexpr, D: tl.constexpr,
                     D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, QUANT: tl.constexpr,
                     SCALE_MIN: tl.constexpr, QMAX: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:  # padding token
        return
    _store_tile(k_ptr, stride_kt, stride_kh, k_cache_ptr, k_scale_ptr, token, slot,
                HKV, HKV_PAD, D, D_PAD, BLOCK_SIZE, QUANT, SCALE_MIN, QMAX)
    _store_tile(v_ptr, stride_vt, stride_vh, v_cache_ptr, v_scale_ptr, token, slot,
                HKV, HKV_PAD, D, D_PAD, BLOCK_SIZE, QUANT, SCALE_MIN, QMAX)


def write_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    slot_mapping: torch.Tensor,
) -> None:
    """Store the K/V of T tokens at their slots, in place; slots equal to -1 are skipped.

    k, v (T, Hkv, D) any float dtype, unit stride along D (row strides free: slices of a fused
    qkv output are fine); slot_mapping (T,) int32/int64; caches as in `kernels.reference`.
    """
    _check_cache(k_cache, k_scale)
    _check_cache(v_cache, v_scale)
    num_blocks, block_size, hkv, d = k_cache.shape
    assert v_cache.shape == k_cache.shape and v_cache.dtype == k_cache.dtype
    assert k_cache.dtype in CACHE_DTYPES
    assert k.dim() == 3 and k.shape == v.shape and k.shape[1:] == (hkv, d), (
        f"k/v must be (T, {hkv}, {d}), got {tuple(k.shape)} and {tuple(v.shape)}")
    assert k.dtype.is_floating_point and v.dtype.is_floating_point
    assert k.stride(2) == 1 and v.stride(2) == 1, "k/v need a unit stride along D"
    assert slot_mapping.shape == (k.shape[0],), "one slot per token"
    assert slot_mapping.dtype in (torch.int32, torch.int64)
    assert slot_mapping.is_contiguous()
    devices = {t.device for t in (k, v, k_cache, v_cache, slot_mapping)}
    assert len(devices) == 1, f"all tensors must be on one device, got {devices}"
    num_tokens = k.shape[0]
    if num_tokens == 0:
        return
    quant = k_cache.dtype == torch.int8
    hkv_pad, d_pad = next_pow2(hkv), next_pow2(d)
    _write_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache,
        k_scale if quant else k_cache, v_scale if quant else v_cache,  # unused unless int8
        slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        HKV=hkv, HKV_PAD=hkv_pad, D=d, D_PAD=d_pad, BLOCK_SIZE=block_size, QUANT=quant,
        SCALE_MIN=SCALE_MIN, QMAX=INT8_MAX,
        num_warps=4 if hkv_pad * d_pad >= 1024 else 2,
    )
