"""Triton paged extend (prefill / chunked prefill) attention over the paged KV cache.

The twin of `kernels.reference.paged_attention`: packed queries of B sequences, each the last
q_len_i tokens of its sequence, attending causally to everything before them and to each other.

Where the keys come from (`k_new`/`v_new` given, as the engine does):

    sequence i:  |<---- ctx: cached, read from the pages ---->|<-- q_len_i new: from k_new/v_new -->|

The new tokens' K/V were written to the cache too (later steps read them there), but this step
uses them as computed: an int8 cache's rounding touches only what earlier steps stored, a prompt
prefilled in one chunk attends exactly as an unquantized model would, and a prefill without a cached
prefix reads no page at all. Without k_new every key comes from the cache.

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

Keys visible to every row of the block run in unmasked whole tiles (the cached prefix; the new
keys before the block's first token); the rest, up to the block's diagonal, apply the causal mask
and the bounds. A sliding window W (the query sees its last W keys) masks every tile from the
block's first visible key on. The tile update is triton_tile's, shared with decode.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .reference import _check_cache
from .triton_tile import (
    INT8_BIAS,
    accumulate_pv,
    dot_types,
    int8_pv,
    int8_query,
    int8_scores,
    load,
    next_pow2,
    online_softmax,
    pad_head_dim,
    paged_slots,
    tile_scores,
)

_LOG2E = 1.4426950408889634
MAX_HEAD_DIM = 256


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
def _visible(key_pos, key_ok, pos, WINDOW: tl.constexpr):
    """(BLOCK_M, BLOCK_N): key at key_pos is in range, not after the row's query, in its window."""
    vis = (key_pos[None, :] <= pos[:, None]) & key_ok[None, :]
    if WINDOW > 0:
        vis = vis & (key_pos[None, :] > pos[:, None] - WINDOW)
    return vis


@triton.jit
def _cache_tile(acc, m_i, l_i, q, q2, qa, qa2, pos, start, key_end, bt_row, k_cache_ptr, v_cache_ptr, k_scale_ptr,
                v_scale_ptr, kv_head_off, scale_head_off, stride_cb, stride_ct, offs_d, d_ok,
                HKV: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, QUANT: tl.constexpr,
                WINDOW: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
                MASKED: tl.constexpr, EVEN_D: tl.constexpr, K_MODE: tl.constexpr, V_MODE: tl.constexpr,
                QK_DTYPE: tl.constexpr, PV_DTYPE: tl.constexpr, ASM: tl.constexpr):
    """Cached keys [start, start + BLOCK_N) (those < key_end), read through the block table. int8
    pages with K_MODE / V_MODE > 0 take triton_tile's int8_scores / int8_pv paths (q, q2, qa, qa2
    prepared for K_MODE as the decode kernel does)."""
    offs_n = start + tl.arange(0, BLOCK_N)
    key_ok = offs_n < key_end
    page, slot = paged_slots(bt_row, offs_n, key_ok, BLOCK_SIZE, MASKED)
    row = page * stride_cb + slot * stride_ct + kv_head_off  # (BLOCK_N,) int64
    use_mask: tl.constexpr = MASKED or not EVEN_D
    kv_mask = key_ok[:, None] & d_ok[None, :]
    k = load(k_cache_ptr + row[:, None] + offs_d[None, :], kv_mask, 0.0, use_mask)
    scale_off = page * (HKV * BLOCK_SIZE) + scale_head_off + slot  # int8 only
    if QUANT and K_MODE > 0:
        s = int8_scores(q, q2, qa, qa2, tl.trans(k), K_MODE, QK_DTYPE, PRECISION, ASM)
        s = s * load(k_scale_ptr + scale_off, key_ok, 0.0, MASKED).to(tl.float32)[None, :]
        if MASKED:
            s = tl.where(_visible(offs_n, key_ok, pos, WINDOW), s, float("-inf"))
    else:
        s = tile_scores(q, k, k_scale_ptr + scale_off, key_ok, _visible(offs_n, key_ok, pos, WINDOW), False, QUANT,
                        MASKED, DOT_DTYPE, PRECISION)
    p, alpha, m_i, l_i = online_softmax(s, m_i, l_i, WINDOW > 0)
    v = load(v_cache_ptr + row[:, None] + offs_d[None, :], kv_mask, 0, use_mask)
    v_s = 0.0
    if QUANT:
        v_s = load(v_scale_ptr + scale_off, key_ok, 0.0, MASKED).to(tl.float32)
    if QUANT and V_MODE > 0:
        return acc * alpha[:, None] + int8_pv(p, v, v_s, V_MODE, PV_DTYPE, PRECISION, ASM, True), m_i, l_i
    return accumulate_pv(acc, alpha, p, v, v_s, QUANT, False, DOT_DTYPE, PRECISION), m_i, l_i


@triton.jit
def _new_tile(acc, m_i, l_i, q, pos, j_start, j_end, ctx, q_start, kn_base, vn_base, stride_kt, stride_vt,
              offs_d, d_ok,
              BLOCK_N: tl.constexpr, WINDOW: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
              MASKED: tl.constexpr, EVEN_D: tl.constexpr):
    """New keys j_start .. j_start + BLOCK_N - 1 of the chunk (those < j_end), from k_new/v_new."""
    offs_j = j_start + tl.arange(0, BLOCK_N)
    key_ok = offs_j < j_end
    tok = (q_start + offs_j).to(tl.int64)
    use_mask: tl.constexpr = MASKED or not EVEN_D
    kv_mask = key_ok[:, None] & d_ok[None, :]
    k = load(kn_base + (tok * stride_kt)[:, None] + offs_d[None, :], kv_mask, 0.0, use_mask)
    s = tile_scores(q, k, kn_base, key_ok, _visible(ctx + offs_j, key_ok, pos, WINDOW), False, False, MASKED,
                    DOT_DTYPE, PRECISION)
    p, alpha, m_i, l_i = online_softmax(s, m_i, l_i, WINDOW > 0)
    v = load(vn_base + (tok * stride_vt)[:, None] + offs_d[None, :], kv_mask, 0.0, use_mask)
    return accumulate_pv(acc, alpha, p, v, 0.0, False, False, DOT_DTYPE, PRECISION), m_i, l_i


# Counts that change every step are not specialized on (== 1, divisible by 16), nor the alignment
# of seq_lens and query_start_loc (slices of the runner's staging buffer at offsets that move with
# the step's token count): each new combination would be a fresh compile in the middle of
# serving, several of them in an engine's first minutes.
# bt_ptr too: a mixed step's prefill rows are the tables from row num_decodes on, whose alignment
# moves with it (each variant would compile while serving, stalling the step that meets it)
@triton.jit(do_not_specialize=["num_seqs", "num_q_blocks"],
            do_not_specialize_on_alignment=["seq_lens_ptr", "qsl_ptr", "bt_ptr"])
def _extend_kernel(q_ptr, kn_ptr, vn_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, bt_ptr,
                   seq_lens_ptr, qsl_ptr, out_ptr, qk_scale, num_seqs, num_q_blocks,
                   stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh, stride_bt,
                   stride_cb, stride_ct,
                   HKV: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
                   BLOCK_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, QUANT: tl.constexpr, NEW_KV: tl.constexpr, WINDOW: tl.constexpr,
                   DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr, K_MODE: tl.constexpr, V_MODE: tl.constexpr,
                   QK_DTYPE: tl.constexpr, PV_DTYPE: tl.constexpr, ASM: tl.constexpr):
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

    EVEN_D: tl.constexpr = D == D_PAD
    rows = tl.arange(0, BLOCK_M)
    tok = first_tok + rows // G_PAD  # (BLOCK_M,) local token of each row
    head = rows % G_PAD
    row_ok = (tok < q_len) & (head < G)
    q_head = kv_head * G + head
    offs_d = tl.arange(0, D_PAD)
    d_ok = offs_d < D
    q_rows = (q_start + tok).to(tl.int64) * stride_qt + q_head.to(tl.int64) * stride_qh
    q = tl.load(q_ptr + q_rows[:, None] + offs_d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    qf = q.to(tl.float32) * qk_scale  # log2(e) folded in: exp2 below
    # int8 score modes for the cached tiles (see triton_tile.int8_scores); K_MODE > 0 only without
    # new K/V, so every tile reads q in the one form
    qa = tl.zeros([BLOCK_M], dtype=tl.float32)
    qa2 = qa
    if K_MODE == 1:
        q = qf.to(QK_DTYPE)
        q2 = q
        qa = INT8_BIAS * tl.sum(q.to(tl.float32), axis=1)
    elif K_MODE >= 2:
        q, q2, qa, qa2 = int8_query(qf)
    else:
        q = qf.to(DOT_DTYPE)
        q2 = q
    pos = ctx + tok  # position of each row's query; a padding row's is past its block's keys

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
    bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
    kv_head_off = kv_head.to(tl.int64) * D
    scale_head_off = kv_head * BLOCK_SIZE
    key_lo = 0  # the block's first visible key
    if WINDOW > 0:
        key_lo = tl.maximum(ctx + first_tok - WINDOW + 1, 0)
    tile_lo = key_lo // BLOCK_N * BLOCK_N
    last_key = tl.minimum(seq_len, ctx + first_tok + BLOCK_Q)  # past the block's last visible key

    if NEW_KV:
        # Cached keys [key_lo, ctx): before every row's query.
        if WINDOW > 0:
            for start in range(tile_lo, ctx, BLOCK_N):
                acc, m_i, l_i = _cache_tile(acc, m_i, l_i, q, q2, qa, qa2, pos, start, ctx, bt_row, k_cache_ptr, v_cache_ptr,
                                            k_scale_ptr, v_scale_ptr, kv_head_off, scale_head_off, stride_cb,
                                            stride_ct, offs_d, d_ok, HKV, BLOCK_SIZE, BLOCK_N, QUANT, WINDOW,
                                            DOT_DTYPE, PRECISION, True, EVEN_D, K_MODE, V_MODE, QK_DTYPE, PV_DTYPE, ASM)
        else:
            full = ctx // BLOCK_N * BLOCK_N
            for start in range(0, full, BLOCK_N):
                acc, m_i, l_i = _cache_tile(acc, m_i, l_i, q, q2, qa, qa2, pos, start, ctx, bt_row, k_cache_ptr, v_cache_ptr,
                                            k_scale_ptr, v_scale_ptr, kv_head_off, scale_head_off, stride_cb,
                                            stride_ct, offs_d, d_ok, HKV, BLOCK_SIZE, BLOCK_N, QUANT, WINDOW,
                                            DOT_DTYPE, PRECISION, False, EVEN_D, K_MODE, V_MODE, QK_DTYPE, PV_DTYPE, ASM)
            if full < ctx:
                acc, m_i, l_i = _cache_tile(acc, m_i, l_i, q, q2, qa, qa2, pos, full, ctx, bt_row, k_cache_ptr, v_cache_ptr,
                                            k_scale_ptr, v_scale_ptr, kv_head_off, scale_head_off, stride_cb,
                                            stride_ct, offs_d, d_ok, HKV, BLOCK_SIZE, BLOCK_N, QUANT, WINDOW,
                                            DOT_DTYPE, PRECISION, True, EVEN_D, K_MODE, V_MODE, QK_DTYPE, PV_DTYPE, ASM)
        # New keys j in [0, j_end): key j sits at position ctx + j.
        kn_base = kn_ptr + kv_head.to(tl.int64) * stride_kh
        vn_base = vn_ptr + kv_head.to(tl.int64) * stride_vh
        j_end = last_key - ctx
        if WINDOW > 0:
            for j in range(tl.maximum(key_lo - ctx, 0) // BLOCK_N * BLOCK_N, j_end, BLOCK_N):
                acc, m_i, l_i = _new_tile(acc, m_i, l_i, q, pos, j, j_end, ctx, q_start, kn_base, vn_base,
                                          stride_kt, stride_vt, offs_d, d_ok, BLOCK_N, WINDOW, DOT_DTYPE, PRECISION,
                                          True, EVEN_D)
        else:
            j_free = (first_tok + 1) // BLOCK_N * BLOCK_N  # keys j <= first_tok: visible to every row
            for j in range(0, j_free, BLOCK_N):
                acc, m_i, l_i = _new_tile(acc, m_i, l_i, q, pos, j, j_end, ctx, q_start, kn_base, vn_base,
                                          stride_kt, stride_vt, offs_d, d_ok, BLOCK_N, WINDOW, DOT_DTYPE, PRECISION,
                                          False, EVEN_D)
            for j in range(j_free, j_end, BLOCK_N):
                acc, m_i, l_i = _new_tile(acc, m_i, l_i, q, pos, j, j_end, ctx, q_start, kn_base, vn_base,
                                          stride_kt, stride_vt, offs_d, d_ok, BLOCK_N, WINDOW, DOT_DTYPE, PRECISION,
                                          True, EVEN_D)
    else:
        # Every key from the cache: those < ctx + first_tok + 1 are visible to every row.
        free_end = tile_lo  # with a window every tile is masked
        if WINDOW == 0:
            free_end = (ctx + first_tok + 1) // BLOCK_N * BLOCK_N
            for start in range(0, free_end, BLOCK_N):
                acc, m_i, l_i = _cache_tile(acc, m_i, l_i, q, q2, qa, qa2, pos, start, last_key, bt_row, k_cache_ptr,
                                            v_cache_ptr, k_scale_ptr, v_scale_ptr, kv_head_off, scale_head_off,
                                            stride_cb, stride_ct, offs_d, d_ok, HKV, BLOCK_SIZE, BLOCK_N, QUANT,
                                            WINDOW, DOT_DTYPE, PRECISION, False, EVEN_D, K_MODE, V_MODE, QK_DTYPE, PV_DTYPE, ASM)
        for start in range(free_end, last_key, BLOCK_N):
            acc, m_i, l_i = _cache_tile(acc, m_i, l_i, q, q2, qa, qa2, pos, start, last_key, bt_row, k_cache_ptr, v_cache_ptr,
                                        k_scale_ptr, v_scale_ptr, kv_head_off, scale_head_off, stride_cb,
                                        stride_ct, offs_d, d_ok, HKV, BLOCK_SIZE, BLOCK_N, QUANT, WINDOW,
                                        DOT_DTYPE, PRECISION, True, EVEN_D, K_MODE, V_MODE, QK_DTYPE, PV_DTYPE, ASM)
    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    o_rows = (q_start + tok).to(tl.int64) * stride_ot + q_head.to(tl.int64) * stride_oh
    tl.store(out_ptr + o_rows[:, None] + offs_d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & d_ok[None, :])


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _default_config(d_pad: int, quant: bool, new_kv: bool, interpret: bool) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages). BLOCK_M 128 puts the dots on wgmma (M % 64 == 0,
    warps a multiple of 4). Measured at D=128 on 4k-token prompts (benchmarks/extend_check.py),
    every key from the cache: 16-bit caches are fastest at (128, 32, 4, 3); int8 caches at
    (128, 128, 8, 2) with K and V cast (int8_modes "cast"), ahead of (128, 64) with K on int8
    tensor cores and (128, 32) with the 1152 + x reads, although (128, 128) spills registers and
    (128, 32) does not.
    With the new keys read as computed (new_kv), a prefill without a cached prefix is 16-bit work:
    the 16-bit tiles. Head dims past 128 halve BLOCK_M so the accumulator keeps its register budget."""
    if interpret:
        return 64, 32, 4, 1  # fewer, larger programs: the interpreter pays per op, not per flop
    if d_pad > 128:
        return 64, 32, 8, 2
    if quant and not new_kv:
        return 128, 128, 8, 2
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
    k_new: torch.Tensor | None = None,
    v_new: torch.Tensor | None = None,
    window: int | None = None,
    out: torch.Tensor | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    int8_modes: tuple[str, str] | None = None,
    fp_fusion: bool = False,
) -> torch.Tensor:
    """Causal attention of packed queries over the paged cache; contract of
    `kernels.reference.paged_attention`.

    q (T, Hq, D) fp32/fp16/bf16 with unit stride along D, D even and <= 256; caches (num_blocks,
    block_size, Hkv, D) int8 (with fp16 scales (num_blocks, Hkv, block_size)) or float;
    block_tables (B, max_blocks) int32; seq_lens (B,) int32 tokens in the cache incl. the new
    ones; query_start_loc (B+1,) int32; max_query_len: a bound on the largest q_len (a host int: it
    only sizes BLOCK_M, no sync here; short chunks get fewer rows per program, so pass the same
    bound, e.g. the step's token budget, where outputs must not depend on the batch). k_new, v_new (T, Hkv, D), unit stride along D: the new
    tokens' K/V as computed, read instead of their cached copies. window: sliding-window width
    (each query sees its last `window` keys), None = all. Returns `out` (T, Hq, D) in q.dtype
    (written into `out` when given). block_m/block_n/num_warps/num_stages override the tile
    configuration (tests, benchmarks). int8_modes: (k_mode, v_mode) of the cached int8 tiles, as
    in triton_decode's DecodeConfig, without k_new only (default ("cast", "cast")). fp_fusion: let
    the compiler fuse multiplies into adds (FMA); off by default (below).

    Without k_new every key is read as stored, in tiles at fixed key positions (multiples of
    BLOCK_N from key 0), so a query's output does not depend on where its chunk starts (given the
    same max_query_len, hence the same tile shapes), to the bit. That needs the tiles a q-block
    reads whole and those it masks to round alike: with fusion on, an int8 tile's `s * k_scale - m`
    became one FMA in the whole tiles but not across the masked tiles' select, so a key's score
    rounded differently by the tile's kind and chunks differed from the whole prompt in the last
    bits of the output. Off, they are bit-equal in every int8 mode, for a little of the int8
    kernel's time and none of bf16's (benchmarks/extend_check.py section 4 measures it).
    """
    _check_cache(k_cache, k_scale)
    _check_cache(v_cache, v_scale)
    assert q.dim() == 3 and q.stride(2) == 1, "q must be (T, Hq, D) with unit stride along D"
    assert q.dtype in (torch.float32, torch.float16, torch.bfloat16), f"q dtype {q.dtype}"
    num_tokens, hq, d = q.shape
    _, block_size, hkv, d_cache = k_cache.shape
    assert v_cache.shape == k_cache.shape and v_cache.dtype == k_cache.dtype
    assert d_cache == d and hq % hkv == 0, f"q {tuple(q.shape)} vs cache {tuple(k_cache.shape)}"
    assert d % 2 == 0 and d <= MAX_HEAD_DIM, f"head dim {d} must be even and <= {MAX_HEAD_DIM}"
    num_seqs = seq_lens.shape[0]
    assert block_tables.dim() == 2 and block_tables.shape[0] == num_seqs
    assert block_tables.stride(1) == 1 and block_tables.dtype in (torch.int32, torch.int64)
    assert seq_lens.dtype == torch.int32 and seq_lens.is_contiguous()
    assert query_start_loc.shape == (num_seqs + 1,) and query_start_loc.dtype == torch.int32
    assert query_start_loc.is_contiguous()
    assert max_query_len >= 1, "max_query_len must be positive"
    assert window is None or window >= 1, f"window {window} must be >= 1"
    new_kv = k_new is not None
    if new_kv:
        assert v_new is not None and k_new.shape == v_new.shape == (num_tokens, hkv, d), (
            f"k_new/v_new must be ({num_tokens}, {hkv}, {d})")
        assert k_new.stride(2) == 1 and v_new.stride(2) == 1, "k_new/v_new need a unit stride along D"
        assert k_new.dtype == v_new.dtype and k_new.dtype.is_floating_point
    devices = {t.device for t in (q, k_cache, v_cache, block_tables, seq_lens, query_start_loc)}
    assert len(devices) == 1, f"all tensors must be on one device, got {devices}"
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    assert out.shape == q.shape and out.dtype == q.dtype and out.stride(2) == 1
    if num_tokens == 0 or num_seqs == 0:
        return out

    interpret = _interpreting()
    quant = k_cache.dtype == torch.int8
    d_pad = pad_head_dim(d)
    cfg_m, cfg_n, cfg_warps, cfg_stages = _default_config(d_pad, quant, new_kv, interpret)
    group = hq // hkv
    g_pad = next_pow2(group)
    block_m = block_m or cfg_m
    # Short chunks: shrink M so padding rows stay few (keeping the 16 rows a dot needs).
    block_m = max(g_pad, 16, min(block_m, g_pad * next_pow2(max_query_len)))
    block_q = block_m // g_pad
    block_n = block_n or cfg_n
    on_gpu = not interpret and q.is_cuda
    dot_dtype, precision = dot_types(q.dtype, on_gpu=on_gpu)
    if int8_modes is None:
        int8_modes = ("cast", "cast")  # measured fastest with the default tiles (_default_config)
    k_mode, v_mode = int8_modes
    assert not (new_kv and int8_modes != ("cast", "cast")), "int8 modes apply without k_new only"
    assert k_mode in ("cast", "bias", "imma") and v_mode in ("cast", "bias"), f"int8 modes {int8_modes}"
    half = tl.float16 if on_gpu else dot_dtype
    num_q_blocks = num_tokens // block_q + num_seqs
    grid = (num_q_blocks * hkv,)
    kn, vn = (k_new, v_new) if new_kv else (q, q)  # unused unless new_kv
    _extend_kernel[grid](
        q, kn, vn, k_cache, v_cache,
        k_scale if quant else k_cache, v_scale if quant else v_cache,  # unused unless int8
        block_tables, seq_lens, query_start_loc, out,
        softmax_scale * _LOG2E, num_seqs, num_q_blocks,
        q.stride(0), q.stride(1), kn.stride(0), kn.stride(1), vn.stride(0), vn.stride(1), out.stride(0), out.stride(1),
        block_tables.stride(0), k_cache.stride(0), k_cache.stride(1),
        HKV=hkv, G=group, G_PAD=g_pad, D=d, D_PAD=d_pad, BLOCK_SIZE=block_size, BLOCK_Q=block_q,
        BLOCK_M=block_m, BLOCK_N=block_n, QUANT=quant, NEW_KV=new_kv, WINDOW=window or 0,
        DOT_DTYPE=dot_dtype, PRECISION=precision,
        K_MODE={"cast": 0, "bias": 1, "imma": 2}[k_mode] if quant else 0, V_MODE=2 if quant and v_mode == "bias" else 0,
        QK_DTYPE=half, PV_DTYPE=half, ASM=on_gpu,
        num_warps=num_warps or cfg_warps, num_stages=num_stages or cfg_stages,
        enable_fp_fusion=fp_fusion,
    )
    return out


__all__ = ["paged_extend"]
