"""Triton gather: the paged K/V of B sequences, read as stored (int8 pages dequantized), packed
into contiguous (sum of seq_lens, Hkv, D) tensors, sequence after sequence.

The twin of `kernels.reference.gather_pages`. It feeds attention kernels that want contiguous
keys (kernels/flash_prefill.py): a prefill reads its prefix and its own new tokens from the pages,
so it attends to exactly what a later step reading the cache would, and the copy costs one pass
over those tokens' K/V against the prefill's quadratic attention.

Grid: one program per (sequence, page slot of the longest sequence); a program whose page lies
past its sequence's end returns after one load. A page is block_size x Hkv contiguous rows of D
values in the cache, and the same rows, in the same order, in the output: the program copies it
as one [rows, D] tile, multiplying each row by its scale (head-major per page: row r is token
r // Hkv of the page and head r % Hkv, its scale at head * block_size + token).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .reference import _check_cache
from .triton_tile import cdiv, next_pow2


@triton.jit
def _copy_tile(cache_ptr, scale_ptr, out_ptr, src, dst, at, mask, row_ok, QUANT: tl.constexpr):
    x = tl.load(cache_ptr + src, mask=mask, other=0)
    if QUANT:
        scale = tl.load(scale_ptr + at, mask=row_ok, other=0.0).to(tl.float32)
        x = x.to(tl.float32) * scale[:, None]
    tl.store(out_ptr + dst, x.to(out_ptr.dtype.element_ty), mask=mask)


# One compiled variant for every step: the block tables and lengths are slices of the step's
# staging buffers (their alignment moves with the step's shape), and a kernel first compiled
# while serving stalls the step that meets it for as long as the compile takes.
@triton.jit(do_not_specialize=["stride_table"], do_not_specialize_on_alignment=["tables_ptr", "seq_lens_ptr"])
def _gather_kernel(k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, tables_ptr, seq_lens_ptr,
                   cu_ptr, k_out_ptr, v_out_ptr, stride_table,
                   HKV: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                   ROWS_PAD: tl.constexpr, QUANT: tl.constexpr):
    seq = tl.program_id(0)
    page = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    first = page * BLOCK_SIZE  # the page's first token position in its sequence
    if first >= seq_len:
        return
    block = tl.load(tables_ptr + seq.to(tl.int64) * stride_table + page).to(tl.int64)
    rows = tl.arange(0, ROWS_PAD)
    dims = tl.arange(0, D_PAD)
    token = rows // HKV
    row_ok = (rows < BLOCK_SIZE * HKV) & (first + token < seq_len)
    mask = row_ok[:, None] & (dims < D)[None, :]
    src = block * (BLOCK_SIZE * HKV * D) + rows[:, None] * D + dims[None, :]
    dst_row = (tl.load(cu_ptr + seq).to(tl.int64) + first) * HKV + rows
    dst = dst_row[:, None] * D + dims[None, :]
    at = block * (HKV * BLOCK_SIZE) + (rows % HKV) * BLOCK_SIZE + token  # the rows' scales, if any
    _copy_tile(k_cache_ptr, k_scale_ptr, k_out_ptr, src, dst, at, mask, row_ok, QUANT)
    _copy_tile(v_cache_ptr, v_scale_ptr, v_out_ptr, src, dst, at, mask, row_ok, QUANT)


def gather_pages(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seq_lens: torch.Tensor,
    *,
    num_tokens: int,
    max_seq_len: int,
    dtype: torch.dtype,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of B sequences as stored, packed: (num_tokens, Hkv, D) each in `dtype`.

    block_tables (B, max_blocks) int32; seq_lens (B,) int32; cu_seq_lens (B + 1,) their cumulative
    sums from 0 (where each sequence starts in the output); num_tokens = sum(seq_lens) and
    max_seq_len >= max(seq_lens), host ints (no device-to-host sync). An int8 cache's values come
    out as q * scale, rounded once to `dtype` (the reference's bits). `out`: the two tensors to
    write, else new ones."""
    _check_cache(k_cache, k_scale)
    _check_cache(v_cache, v_scale)
    _, block_size, hkv, d = k_cache.shape
    b = seq_lens.shape[0]
    assert block_tables.dim() == 2 and block_tables.shape[0] == b and block_tables.stride(1) == 1
    assert cu_seq_lens.shape == (b + 1,) and seq_lens.is_contiguous() and cu_seq_lens.is_contiguous()
    if out is None:
        k = torch.empty(num_tokens, hkv, d, dtype=dtype, device=k_cache.device)
        v = torch.empty_like(k)
    else:
        k, v = out
        assert k.shape == v.shape == (num_tokens, hkv, d) and k.dtype == v.dtype == dtype
        assert k.is_contiguous() and v.is_contiguous()
    pages = cdiv(max_seq_len, block_size)
    if num_tokens == 0 or b == 0 or pages == 0:
        return k, v
    quant = k_cache.dtype == torch.int8
    rows_pad, d_pad = next_pow2(block_size * hkv), next_pow2(d)
    _gather_kernel[(b, pages)](
        k_cache, v_cache, k_scale if quant else k_cache, v_scale if quant else v_cache,
        block_tables, seq_lens, cu_seq_lens, k, v, block_tables.stride(0),
        HKV=hkv, D=d, D_PAD=d_pad, BLOCK_SIZE=block_size, ROWS_PAD=rows_pad, QUANT=quant,
        num_warps=8 if rows_pad * d_pad >= 16384 else 4 if rows_pad * d_pad >= 4096 else 2,
    )
    return k, v
