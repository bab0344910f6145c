"""Triton paged extend (prefill / chunked prefill) attention over the paged KV cache.

The twin of `kernels.reference.paged_attention`: packed queries of B sequences, each the last
q_len_i tokens of its sequence, attending causally to everything in the cache (its prefix and its
own new tokens, whose K/V the cache write stored first).

Grid: one program per (q-block, kv head), flattened to 1-D. A q-block is BLOCK_Q consecutive
query tokens of one sequence; sequence i owns the block indices
    [qsl[i] // BLOCK_Q + i,  qsl[i+1] // BLOCK_Q + i + 1)
which cover its cdiv(q_len_i, BLOCK_Q) blocks plus at most one spare, so T // BLOCK_Q + B programs
cover every batch of T tokens: the grid needs no device-to-host sync (CUDA graphs), wastes at most
B programs (a rectangular (B, cdiv(max_q, BLOCK_Q)) grid wastes most of itself on mixed batches)
and a program finds its sequence by a binary search over query_start_loc. Programs run in reverse
block order so that the longest (last, most causal work) q-blocks start first.

GQA packed into M: the BLOCK_M rows of a program are BLOCK_Q tokens x G_PAD query heads of one kv
head (row r = token r // G_PAD, head r % G_PAD), so each K/V tile is read once per kv head and
q-block, and BLOCK_M = 64/128 puts the dots on wgmma on Hopper.

Two phases over the keys: keys below ctx + first_token + 1 are visible to every row of the block,
so whole tiles there run without masks (the cached prefix and the part of the new tokens before
the block); the remaining tiles up to the block's diagonal apply the causal mask and the seq_len
bound. The loop stops at the diagonal.

int8 caches use the scale trick: int8 K/V cast straight to the dot dtype (exact: |q| <= 127),
k_scale folded into the score columns, v_scale into P before the PV dot, the softmax denominator
from unscaled P. Online softmax in fp32 with exp2 (log2 e folded into the score scale).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels.reference import _check_cache

_LOG2E = 1.4426950408889634


@triton.jit
def _find_sequence(qsl_ptr, block_idx, num_seqs, BLOCK_Q: tl.constexpr):
    """The sequence owning flattened q-block `block_idx`: the largest i with
    qsl[i] // BLOCK_Q + i <= block_idx (binary search, log2(B) scalar loads)."""
    lo = block_idx * 0
    hi = lo + num_seqs
    while lo + 1 < hi:
        mid = (lo + hi) // 2
        first = tl.load(qsl_ptr + mid) // BLOCK_Q + mid
        go_right = first <= block_idx
        lo = tl.where(go_right, mid, lo)
        hi = tl.where(go_right, hi, mid)
    return lo


@triton.jit
def _attend_tile(acc, m_i, l_i, q, start, pos, kv_end, bt_row, k_cache_ptr, v_cache_ptr,
                 k_scale_ptr, v_scale_ptr, kv_head_off, scale_head_off, qk_scale,
                 stride_cb, stride_ct,
                 HKV: tl.constexpr, D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                 BLOCK_N: tl.constexpr, QUANT: tl.constexpr, MASKED: tl.constexpr,
                 DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr):
    """One BLOCK_N tile of keys starting at `start`; returns the updated (acc, m, l)."""
    offs_n = start + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, D)
    if MASKED:
        n_ok = offs_n < kv_end
        page = tl.load(bt_row + offs_n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
    else:
        page = tl.load(bt_row + offs_n // BLOCK_SIZE).to(tl.int64)
    in_page = offs_n % BLOCK_SIZE
    row = page * stride_cb + in_page * stride_ct + kv_head_off  # (BLOCK_N,) int64
    kv_ptrs = row[:, None] + dims[None, :]
    if MASKED:
        k = tl.load(k_cache_ptr + kv_ptrs, mask=n_ok[:, None], other=0)
    else:
        k = tl.load(k_cache_ptr + kv_ptrs)
    s = tl.dot(q, tl.trans(k.to(DOT_DTYPE)), input_precision=PRECISION)  # (BLOCK_M, BLOCK_N)
    if QUANT:
        scale_off = page * (HKV * BLOCK_SIZE) + scale_head_off + in_page
        if MASKED:
            k_s = tl.load(k_scale_ptr + scale_off, mask=n_ok, other=0.0)
        else:
            k_s = tl.load(k_scale_ptr + scale_off)
        s = s * (k_s * qk_scale)[None, :]
    else:
        s = s * qk_scale
    if MASKED:
        visible = (offs_n[None, :] <= pos[:, None]) & n_ok[None, :]
        s = tl.where(visible, s, float("-inf"))
    # Every row sees key 0 in its first tile, so m_new is finite: no exp2(-inf + inf).
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if MASKED:
        v = tl.load(v_cache_ptr + kv_ptrs, mask=n_ok[:, None], other=0)
    else:
        v = tl.load(v_cache_ptr + kv_ptrs)
    if QUANT:
        if MASKED:
            v_s = tl.load(v_scale_ptr + scale_off, mask=n_ok, other=0.0)
        else:
            v_s = tl.load(v_scale_ptr + scale_off)
        p = p * v_s[None, :]
    acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE),
                                        input_precision=PRECISION)
    return acc, m_new, l_i


# Counts that change every step are not specialized on (== 1, divisible by 16): each new
# combination would be a fresh compile (~1 s) in the middle of serving.
@triton.jit(do_not_specialize=["num_seqs", "num_q_blocks"])
def _extend_kernel(q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, bt_ptr,
                   seq_lens_ptr, qsl_ptr, out_ptr, qk_scale, num_seqs, num_q_blocks,
                   stride_qt, stride_qh, stride_ot, stride_oh, stride_bt, stride_cb, stride_ct,
                   HKV: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr,
                   BLOCK_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, QUANT: tl.constexpr, DOT_DTYPE: tl.constexpr,
                   PRECISION: tl.constexpr):
    pid = tl.program_id(0)
    kv_head = pid % HKV
    block_idx = num_q_blocks - 1 - pid // HKV  # longest q-blocks first
    seq = _find_sequence(qsl_ptr, block_idx, num_seqs, BLOCK_Q)
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    first_tok = (block_idx - (q_start // BLOCK_Q + seq)) * BLOCK_Q  # local index in the sequence
    if first_tok >= q_len:  # the spare block of this sequence
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx = seq_len - q_len  # tokens cached before this chunk

    rows = tl.arange(0, BLOCK_M)
    tok = first_tok + rows // G_PAD  # (BLOCK_M,) local token of each row
    head = rows % G_PAD
    row_ok = (tok < q_len) & (head < G)
    q_head = kv_head * G + head
    dims = tl.arange(0, D)
    q_rows = (q_start + tok).to(tl.int64) * stride_qt + q_head.to(tl.int64) * stride_qh
    q = tl.load(q_ptr + q_rows[:, None] + dims[None, :], mask=row_ok[:, None], other=0.0)
    q = q.to(DOT_DTYPE)
    pos = ctx + tok  # position of each row's query; a padding row's is past its block's keys

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
    kv_head_off = kv_head.to(tl.int64) * D
    scale_head_off = kv_head * BLOCK_SIZE
    # Keys < ctx + first_tok + 1 are visible to every row: whole tiles there need no mask.
    free_end = (ctx + first_tok + 1) // BLOCK_N * BLOCK_N
    kv_end = tl.minimum(seq_len, ctx + first_tok + BLOCK_Q)  # past the block's last key
    for start in range(0, free_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, start, pos, kv_end, bt_row,
                                     k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
                                     kv_head_off, scale_head_off, qk_scale, stride_cb, stride_ct,
                                     HKV, D, BLOCK_SIZE, BLOCK_N, QUANT, False, DOT_DTYPE,
                                     PRECISION)
    for start in range(free_end, kv_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, start, pos, kv_end, bt_row,
                                     k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
                                     kv_head_off, scale_head_off, qk_scale, stride_cb, stride_ct,
                                     HKV, D, BLOCK_SIZE, BLOCK_N, QUANT, True, DOT_DTYPE,
                                     PRECISION)
    out = acc / l_i[:, None]
    o_rows = (q_start + tok).to(tl.int64) * stride_ot + q_head.to(tl.int64) * stride_oh
    tl.store(out_ptr + o_rows[:, None] + dims[None, :], out.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None])


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _default_config(d: int, quant: bool, interpret: bool) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages). BLOCK_M 128 puts the dots on wgmma (M % 64 == 0,
    warps a multiple of 4). Measured on an H200 at D=128, 4k-token prompts (benchmarks/
    extend_check.py): 16-bit caches best at (128, 32, 4, 3); int8 caches at (128, 128, 8, 2),
    whose wider tile spreads the int8 -> bf16 conversion (not pipelined into shared memory like
    a 16-bit tile) over more keys. D=64 reuses them unmeasured."""
    if interpret:
        return 64, 32, 4, 1  # fewer, larger programs: the interpreter pays per op, not per flop
    if quant:
        return (128, 128, 8, 2) if d > 64 else (128, 128, 4, 2)
    return 128, 32, 4, 3


def paged_extend(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    softmax_scale: float,
    *,
    max_query_len: int,
    out: torch.Tensor | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """Causal attention of packed queries over the paged cache; contract of
    `kernels.reference.paged_attention`.

    q (T, Hq, D) fp32/fp16/bf16 with unit stride along D; caches (num_blocks, block_size, Hkv, D)
    int8 (with fp32 scales (num_blocks, Hkv, block_size)) or float; block_tables (B, max_blocks)
    int32; seq_lens (B,) int32 tokens in the cache incl. the new ones; query_start_loc (B+1,)
    int32; max_query_len: the largest q_len (a host int: it only sizes BLOCK_M, no sync here).
    Returns `out` (T, Hq, D) in q.dtype (written into `out` when given).
    block_m/block_n/num_warps/num_stages override the tile configuration (tests, benchmarks).
    """
    _check_cache(k_cache, k_scale)
    _check_cache(v_cache, v_scale)
    assert q.dim() == 3 and q.stride(2) == 1, "q must be (T, Hq, D) with unit stride along D"
    assert q.dtype in (torch.float32, torch.float16, torch.bfloat16), f"q dtype {q.dtype}"
    num_tokens, hq, d = q.shape
    _, block_size, hkv, d_cache = k_cache.shape
    assert v_cache.shape == k_cache.shape and v_cache.dtype == k_cache.dtype
    assert d_cache == d and hq % hkv == 0, f"q {tuple(q.shape)} vs cache {tuple(k_cache.shape)}"
    assert d >= 16 and d & (d - 1) == 0, f"head dim {d} must be a power of two >= 16"
    num_seqs = seq_lens.shape[0]
    assert block_tables.dim() == 2 and block_tables.shape[0] == num_seqs
    assert block_tables.stride(1) == 1 and block_tables.dtype in (torch.int32, torch.int64)
    assert seq_lens.dtype == torch.int32 and seq_lens.is_contiguous()
    assert query_start_loc.shape == (num_seqs + 1,) and query_start_loc.dtype == torch.int32
    assert query_start_loc.is_contiguous()
    assert max_query_len >= 1, "max_query_len must be positive"
    devices = {t.device for t in (q, k_cache, v_cache, block_tables, seq_lens, query_start_loc)}
    assert len(devices) == 1, f"all tensors must be on one device, got {devices}"
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    assert out.shape == q.shape and out.dtype == q.dtype and out.stride(2) == 1
    if num_tokens == 0 or num_seqs == 0:
        return out

    interpret = _interpreting()
    quant = k_cache.dtype == torch.int8
    cfg_m, cfg_n, cfg_warps, cfg_stages = _default_config(d, quant, interpret)
    group = hq // hkv
    g_pad = triton.next_power_of_2(group)
    block_m = block_m or cfg_m
    # Short chunks: shrink M so padding rows stay few (keeping the 16 rows a dot needs).
    block_m = max(g_pad, 16, min(block_m, g_pad * triton.next_power_of_2(max_query_len)))
    block_q = block_m // g_pad
    block_n = block_n or cfg_n
    if interpret:
        dot_dtype, precision = tl.float32, "ieee"  # interpreter bf16 math is wrong; fp32 exact
    elif q.dtype == torch.float32:
        dot_dtype, precision = tl.float32, "ieee"
    else:
        dot_dtype = tl.bfloat16 if q.dtype == torch.bfloat16 else tl.float16
        precision = None  # only matters for fp32 operands
    num_q_blocks = num_tokens // block_q + num_seqs
    grid = (num_q_blocks * hkv,)
    _extend_kernel[grid](
        q, k_cache, v_cache,
        k_scale if quant else k_cache, v_scale if quant else v_cache,  # unused unless int8
        block_tables, seq_lens, query_start_loc, out,
        softmax_scale * _LOG2E, num_seqs, num_q_blocks,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1),
        HKV=hkv, G=group, G_PAD=g_pad, D=d, BLOCK_SIZE=block_size, BLOCK_Q=block_q,
        BLOCK_M=block_m, BLOCK_N=block_n, QUANT=quant, DOT_DTYPE=dot_dtype, PRECISION=precision,
        num_warps=num_warps or cfg_warps, num_stages=num_stages or cfg_stages,
    )
    return out


__all__ = ["paged_extend"]
