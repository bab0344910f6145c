"""Paged decode attention in Triton (flash-decoding): one query token per sequence.

    q        (B, Hq, D)                      bf16 | fp16 | fp32
    k_cache  (num_blocks, PAGE, Hkv, D)      int8 | bf16 | fp16 | fp32  (v_cache the same)
    k_scale  (num_blocks, Hkv, PAGE)         fp16, int8 caches only     (v_scale the same)
    out      (B, Hq, D)                      q.dtype

Stage 1, one program per (sequence, kv head, split):

    keys of sequence b:  |<- split 0 ->|<- split 1 ->| ... |<- split S-1 ->|     (whole tiles)
    tile of BLOCK_N keys: page = block_tables[b, n // PAGE], row = page*PAGE + n % PAGE

The G = Hq/Hkv query heads of the kv head are the M rows of `tl.dot` (the group padded to a power
of two; Triton pads the MMA's 16 rows without registers for them), so each K/V tile is read once per
kv head. Only the sequence's last tile is partial, so every other tile runs without masks. With one
split the program writes `out` directly; otherwise it writes the normalized partial output and its
base-2 log-sum-exp to an fp32 workspace, and stage 2 (one program per (sequence, query head)) merges
the splits in a fixed 64-row reduction, weighting each by 2^(lse - max lse); an empty split has
lse = -inf and weight 0. Splits share a sequence's tiles evenly (a count set by the batch), or with
`split_tokens` sit at fixed key positions (the same bits in any batch; what the engine runs): then a
sequence uses only the splits its length reaches, a sequence within one split writes `out` from
stage 1, and the programs of splits past its end write nothing; or (`programs`) a few persistent
programs per kv head take the (sequence, split) items from a work list instead of a program each.
With a sliding window W the keys start at seq_len - W (every tile masked then). The caches must be
contiguous (their strides are compile-time constants).

Sub-tiles (`DecodeConfig.sub_tiles`, a launch candidate, not yet in the table): a tile's keys cut
into one sub-tile per warp, each with its own running max, sum and accumulator, merged once per
split. The shipped layout spreads a tile's keys over the warps, so each tile's row max, row sum and
P cross warps through shared memory (sm_90 SASS: 14 barriers a tile; sub-tiles: 2), at the price
of a whole accumulator per warp (165 registers against 128).

int8 pages (`DecodeConfig.k_mode` / `v_mode`, triton_tile's int8_scores / int8_pv): QK^T on int8
tensor cores with q quantized per head in two int8 terms (K never converted), or K read as the fp16
number 1152 + K with 1152 * rowsum(q) taken off; V read as 1152 + V by 3 integer instructions per 4
values (inline PTX on the GPU) with 1152 * rowsum(P) taken off; the scales applied to the scores
and to P, never to the tiles.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .triton_tile import (
    INT8_BIAS,
    cdiv,
    dot_types,
    int8_biased,
    int8_pv,
    int8_query,
    int8_scores,
    int8_to_f16,
    load,
    next_pow2,
    online_softmax,
    pad_head_dim,
    paged_slots,
)

LOG2E = 1.4426950408889634
BLOCK_M = 16  # tl.dot needs M >= 16 on the GPU; G query heads are padded up to this
MAX_GROUP = 16
MAX_HEAD_DIM = 256
MIN_SPLIT_TOKENS = 256  # a split shorter than this costs more in stage 2 than it gains in overlap
MAX_SPLITS = 64
WAVES = 2  # stage-1 programs aimed at per SM: enough to keep loads in flight on every SM

_Q_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_CACHE_DTYPES = (torch.int8, torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _decode_tile(acc, m_i, l_i, q, q2, qa, qa2, k_base, v_base, ks_base, vs_base, bt_row, tile_start, lo, end,
                 offs_d, d_ok, HKV: tl.constexpr, D: tl.constexpr, K_T: tl.constexpr,
                 PAGE: tl.constexpr, BLOCK_N: tl.constexpr, IS_INT8: tl.constexpr, K_MODE: tl.constexpr,
                 V_MODE: tl.constexpr, DOT_DTYPE: tl.constexpr, QK_DTYPE: tl.constexpr, PV_DTYPE: tl.constexpr,
                 PRECISION: tl.constexpr, ASM: tl.constexpr, MASKED: tl.constexpr, EVEN_D: tl.constexpr):
    """Keys [tile_start, tile_start + BLOCK_N) of one sequence's pages; when MASKED, only those in
    [lo, end) count."""
    offs_n = tile_start + tl.arange(0, BLOCK_N)
    key_ok = (offs_n >= lo) & (offs_n < end)
    page, slot = paged_slots(bt_row, offs_n, key_ok, PAGE, MASKED)
    # contiguous caches: a page is PAGE rows of HKV * D elements; its scales HKV rows of PAGE
    row = page * (PAGE * HKV * D) + slot * (HKV * D)  # (BLOCK_N,) int64 element offset of each key
    use_mask: tl.constexpr = MASKED or not EVEN_D
    kv_off = row[:, None] + offs_d[None, :]  # (N, D): K and V share their offsets
    kv_ok = key_ok[:, None] & d_ok[None, :]
    if K_T:  # K loaded as (D, N) (a layout of its own)
        kt = load(k_base + row[None, :] + offs_d[:, None], key_ok[None, :] & d_ok[:, None], 0, use_mask)
    else:
        kt = tl.trans(load(k_base + kv_off, kv_ok, 0, use_mask))  # (D, N)
    srow = page * (HKV * PAGE) + slot  # (BLOCK_N,) offset into this kv head's scale pages (int8 only)
    if IS_INT8:
        s = int8_scores(q, q2, qa, qa2, kt, K_MODE, QK_DTYPE, PRECISION, ASM)
        # the scales are loaded after the dot: before it they stay live across it (registers)
        s = s * load(ks_base + srow, key_ok, 0.0, MASKED).to(tl.float32)[None, :]
    else:
        s = tl.dot(q, kt.to(DOT_DTYPE), input_precision=PRECISION)
    if MASKED:
        s = tl.where(key_ok[None, :], s, float("-inf"))
    p, alpha, m_i, l_i = online_softmax(s, m_i, l_i, False)  # every split's first tile shows a key
    v = load(v_base + kv_off, kv_ok, 0, use_mask)  # (N, D)
    acc = acc * alpha[:, None]
    if IS_INT8:
        v_s = load(vs_base + srow, key_ok, 0.0, MASKED).to(tl.float32)
        acc += int8_pv(p, v, v_s, V_MODE, PV_DTYPE, PRECISION, ASM, False)
    else:
        acc += tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision=PRECISION)
    return acc, m_i, l_i


@triton.jit
def _decode_keys(q, q2, qa, qa2, k_base, v_base, ks_base, vs_base, bt_row, start, full_end, end, lo, offs_d, d_ok,
                 HKV: tl.constexpr, D: tl.constexpr, K_T: tl.constexpr, WINDOW: tl.constexpr, PAGE: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D_PAD: tl.constexpr, IS_INT8: tl.constexpr,
                 K_MODE: tl.constexpr, V_MODE: tl.constexpr, DOT_DTYPE: tl.constexpr, QK_DTYPE: tl.constexpr,
                 PV_DTYPE: tl.constexpr, PRECISION: tl.constexpr, ASM: tl.constexpr, EVEN_D: tl.constexpr):
    """A split's keys [start, end) tile by tile (`_decode_tile`; unmasked up to full_end): its query
    rows' (acc, running max, running sum)."""
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, D_PAD), tl.float32)
    if WINDOW > 0:  # the window's first tile starts mid-tile: mask every tile (a rare model kind)
        for tile_start in range(start, end, BLOCK_N):
            acc, m_i, l_i = _decode_tile(
                acc, m_i, l_i, q, q2, qa, qa2, k_base, v_base, ks_base, vs_base, bt_row, tile_start, lo, end,
                offs_d, d_ok, HKV, D, K_T,
                PAGE, BLOCK_N, IS_INT8, K_MODE, V_MODE, DOT_DTYPE, QK_DTYPE, PV_DTYPE, PRECISION, ASM, True, EVEN_D)
    else:
        for tile_start in range(start, full_end, BLOCK_N):
            acc, m_i, l_i = _decode_tile(
                acc, m_i, l_i, q, q2, qa, qa2, k_base, v_base, ks_base, vs_base, bt_row, tile_start, lo, end,
                offs_d, d_ok, HKV, D, K_T,
                PAGE, BLOCK_N, IS_INT8, K_MODE, V_MODE, DOT_DTYPE, QK_DTYPE, PV_DTYPE, PRECISION, ASM, False, EVEN_D)
        if full_end < end:
            acc, m_i, l_i = _decode_tile(
                acc, m_i, l_i, q, q2, qa, qa2, k_base, v_base, ks_base, vs_base, bt_row, full_end, lo, end,
                offs_d, d_ok, HKV, D, K_T,
                PAGE, BLOCK_N, IS_INT8, K_MODE, V_MODE, DOT_DTYPE, QK_DTYPE, PV_DTYPE, PRECISION, ASM, True, EVEN_D)
    return acc, m_i, l_i


@triton.jit
def _warp_tile(acc, m_i, l_i, q, q2, qa, qa2, k_base, v_base, ks_base, vs_base, bt_row, tile_start, lo, end,
               offs_d, d_ok, HKV: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, W: tl.constexpr,
               NW: tl.constexpr, IS_INT8: tl.constexpr, K_MODE: tl.constexpr, V_MODE: tl.constexpr,
               DOT_DTYPE: tl.constexpr, QK_DTYPE: tl.constexpr, PV_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
               ASM: tl.constexpr, MASKED: tl.constexpr, EVEN_D: tl.constexpr):
    """`_decode_tile` with the tile's W * NW keys cut into W sub-tiles (key tile_start + w * NW + j in
    sub-tile w), each with a running max, sum and accumulator of its own: m_i, l_i (W, BLOCK_M),
    acc (W, BLOCK_M, D_PAD). The dots are batched over w, which Triton lays out one sub-tile per
    warp: a row's max and sum reduce within a warp, and P reaches the P V dot without crossing
    warps. `_merge_sub_tiles` combines the W states once per split."""
    offs_n = tile_start + tl.arange(0, W)[:, None] * NW + tl.arange(0, NW)[None, :]  # (W, NW)
    key_ok = (offs_n >= lo) & (offs_n < end)
    page, slot = paged_slots(bt_row, offs_n, key_ok, PAGE, MASKED)
    row = page * (PAGE * HKV * D) + slot * (HKV * D)  # (W, NW) element offset of each key
    use_mask: tl.constexpr = MASKED or not EVEN_D
    kv_off = row[:, :, None] + offs_d[None, None, :]  # (W, NW, D_PAD): K and V share their offsets
    kv_ok = key_ok[:, :, None] & d_ok[None, None, :]
    kt = tl.permute(load(k_base + kv_off, kv_ok, 0, use_mask), (0, 2, 1))  # (W, D_PAD, NW)
    srow = page * (HKV * PAGE) + slot
    if IS_INT8:
        if K_MODE >= 2:  # int8 tensor cores, q in one or two int8 terms (int8_scores)
            s = tl.dot(q, kt, out_dtype=tl.int32).to(tl.float32) * qa[None, :, None]
            if K_MODE == 2:
                s += tl.dot(q2, kt, out_dtype=tl.int32).to(tl.float32) * qa2[None, :, None]
        elif K_MODE == 1:
            s = tl.dot(q, int8_biased(kt, QK_DTYPE, ASM, True), input_precision=PRECISION) - qa[None, :, None]
        else:
            s = tl.dot(q, kt.to(QK_DTYPE), input_precision=PRECISION)
        s = s * load(ks_base + srow, key_ok, 0.0, MASKED).to(tl.float32)[:, None, :]
    else:
        s = tl.dot(q, kt.to(DOT_DTYPE), input_precision=PRECISION)
    if MASKED:  # a sub-tile may see no key: its row max stays -inf and its p must be 0 (the guard)
        s = tl.where(key_ok[:, None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=2))
    m_sub = tl.where(m_new == float("-inf"), 0.0, m_new) if MASKED else m_new
    alpha = tl.exp2(m_i - m_sub)
    p = tl.exp2(s - m_sub[:, :, None])
    l_i = l_i * alpha + tl.sum(p, axis=2)
    v = load(v_base + kv_off, kv_ok, 0, use_mask)  # (W, NW, D_PAD)
    if IS_INT8:
        v_s = load(vs_base + srow, key_ok, 0.0, MASKED).to(tl.float32)  # (W, NW)
        if V_MODE == 0:
            pv = tl.dot((p * v_s[:, None, :]).to(PV_DTYPE), v.to(PV_DTYPE), input_precision=PRECISION)
        else:  # P * v_s / c in [0, 1] for the fp16 dot, c = the sub-tile's largest scale, put back after
            vs_max = tl.maximum(tl.max(v_s, axis=1), 1e-30)  # (W,)
            p16 = (p * (v_s / vs_max[:, None])[:, None, :]).to(PV_DTYPE)
            if V_MODE == 1:
                pv = tl.dot(p16, int8_to_f16(v), input_precision=PRECISION)
            else:
                pv = tl.dot(p16, int8_biased(v, PV_DTYPE, ASM, False), input_precision=PRECISION)
                pv -= INT8_BIAS * tl.sum(p16.to(tl.float32), axis=2)[:, :, None]
            pv = pv * vs_max[:, None, None]
    else:
        pv = tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision=PRECISION)
    return acc * alpha[:, :, None] + pv, m_new, l_i


@triton.jit
def _merge_sub_tiles(acc, m_i, l_i):
    """The W sub-tile states of `_warp_tile` as one: acc (BLOCK_M, D_PAD), m, l (BLOCK_M,), each
    weighted by 2^(its max - the max); a sub-tile that saw no key (max -inf) weighs 0."""
    m = tl.max(m_i, axis=0)
    w = tl.exp2(m_i - tl.where(m == float("-inf"), 0.0, m)[None, :])
    return tl.sum(acc * w[:, :, None], axis=0), m, tl.sum(l_i * w, axis=0)


@triton.jit
def _key_tiles(seq_len, WINDOW: tl.constexpr, BLOCK_N: tl.constexpr):
    """A sequence's keys as tiles: the oldest key its query still sees (lo), the first tile's start
    (lo rounded down to a tile) and how many BLOCK_N-key tiles cover the keys from there."""
    lo = 0
    if WINDOW > 0:
        lo = tl.maximum(seq_len - WINDOW, 0)
    first = lo // BLOCK_N * BLOCK_N
    return lo, first, tl.cdiv(seq_len - first, BLOCK_N)


@triton.jit
def _used_splits(seq_len, num_splits, SPLIT_TOKENS: tl.constexpr, WINDOW: tl.constexpr, BLOCK_N: tl.constexpr,
                 MIN_TILES: tl.constexpr):
    """How many of the grid's num_splits hold keys of a sequence of seq_len, as stage 1 shares
    them out (stage 2 merges those): with fixed splits, those up to its end; on the batch-count
    path, all of them (MIN_TILES 1: an empty split writes an empty part) or, with MIN_TILES > 1,
    as many as its tiles fill at MIN_TILES or more each (0 for an empty sequence)."""
    used = num_splits
    if SPLIT_TOKENS > 0:
        used = tl.minimum(tl.cdiv(seq_len, SPLIT_TOKENS), num_splits)
    elif MIN_TILES > 1:
        _, _, num_tiles = _key_tiles(seq_len, WINDOW, BLOCK_N)
        used = tl.cdiv(num_tiles, tl.maximum(tl.cdiv(num_tiles, num_splits), MIN_TILES))
    return used


@triton.jit
def _decode_split(
    h, b, split, q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr, lens_ptr, out_ptr, part_ptr, lse_ptr,
    qk_scale, stride_qb, stride_qh, stride_btb, stride_ob, stride_oh, num_splits,
    G: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr, K_T: tl.constexpr, SPLIT_TOKENS: tl.constexpr,
    DIRECT: tl.constexpr, WINDOW: tl.constexpr, PAGE: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IS_INT8: tl.constexpr, K_MODE: tl.constexpr,
    V_MODE: tl.constexpr, DOT_DTYPE: tl.constexpr, QK_DTYPE: tl.constexpr, PV_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr, ASM: tl.constexpr, W: tl.constexpr, MIN_TILES: tl.constexpr,
):
    """Split `split` of sequence b for kv head h: its keys, then `out` or its workspace row. W > 0:
    each tile's keys in W sub-tiles of their own softmax state (`_warp_tile`). MIN_TILES: the
    fewest tiles a split of the batch-count path holds (`_used_splits`)."""
    seq_len = tl.load(lens_ptr + b)
    lo, first, num_tiles = _key_tiles(seq_len, WINDOW, BLOCK_N)
    tiles_per_split = tl.maximum(tl.cdiv(num_tiles, num_splits), MIN_TILES)  # (the batch-count path's)
    # The grid has room for the longest context the caller allows; a split past this sequence's
    # end (its programs are most of the grid for short contexts) exits here.
    run = True
    if SPLIT_TOKENS > 0:
        run = (split == 0) | (split * SPLIT_TOKENS < seq_len)
    elif MIN_TILES > 1:
        run = (split == 0) | (split * tiles_per_split < num_tiles)
    if run:
        if SPLIT_TOKENS > 0:  # splits at fixed key positions: the same for a sequence in any batch
            start = tl.maximum(split * SPLIT_TOKENS, first)
            end = tl.minimum((split + 1) * SPLIT_TOKENS, seq_len)
        else:  # the sequence's tiles shared out evenly over its splits
            start = first + split * tiles_per_split * BLOCK_N
            end = tl.minimum(start + tiles_per_split * BLOCK_N, seq_len)
        full_end = start + tl.maximum(end - start, 0) // BLOCK_N * BLOCK_N  # unmasked tiles stop here

        EVEN_D: tl.constexpr = D == D_PAD
        offs_m = tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, D_PAD)
        d_ok = offs_d < D
        row_ok = offs_m < G
        heads = h * G + offs_m  # query heads of this kv head, (BLOCK_M,)
        q = tl.load(q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # padded rows are 0: their scores are finite
        qf = q.to(tl.float32) * qk_scale  # (BLOCK_M, D_PAD), log2(e) folded in: exp2 below
        # Per-row terms of the int8 score modes (see _int8_scores); unused ones are placeholders.
        qa = tl.zeros((BLOCK_M,), tl.float32)
        qa2 = qa
        if IS_INT8 and K_MODE == 1:
            q = qf.to(QK_DTYPE)
            q2 = q
            qa = INT8_BIAS * tl.sum(q.to(tl.float32), axis=1)
        elif IS_INT8 and K_MODE >= 2:
            q, q2, qa, qa2 = int8_query(qf)  # per query head
        else:
            q = qf.to(QK_DTYPE)
            q2 = q

        k_base = k_ptr + h * D
        v_base = v_ptr + h * D
        ks_base = ks_ptr + h * PAGE
        vs_base = vs_ptr + h * PAGE
        bt_row = bt_ptr + b.to(tl.int64) * stride_btb

        if W > 0:
            NW: tl.constexpr = BLOCK_N // W
            q_w = tl.broadcast_to(q[None, :, :], (W, BLOCK_M, D_PAD))  # the same query rows for every sub-tile
            q2_w = tl.broadcast_to(q2[None, :, :], (W, BLOCK_M, D_PAD))
            m_w = tl.full((W, BLOCK_M), float("-inf"), tl.float32)
            l_w = tl.zeros((W, BLOCK_M), tl.float32)
            acc_w = tl.zeros((W, BLOCK_M, D_PAD), tl.float32)
            if WINDOW > 0:
                for tile_start in range(start, end, BLOCK_N):
                    acc_w, m_w, l_w = _warp_tile(
                        acc_w, m_w, l_w, q_w, q2_w, qa, qa2, k_base, v_base, ks_base, vs_base, bt_row, tile_start,
                        lo, end, offs_d, d_ok, HKV, D, PAGE, W, NW, IS_INT8, K_MODE, V_MODE, DOT_DTYPE, QK_DTYPE,
                        PV_DTYPE, PRECISION, ASM, True, EVEN_D)
            else:
                for tile_start in range(start, full_end, BLOCK_N):
                    acc_w, m_w, l_w = _warp_tile(
                        acc_w, m_w, l_w, q_w, q2_w, qa, qa2, k_base, v_base, ks_base, vs_base, bt_row, tile_start,
                        lo, end, offs_d, d_ok, HKV, D, PAGE, W, NW, IS_INT8, K_MODE, V_MODE, DOT_DTYPE, QK_DTYPE,
                        PV_DTYPE, PRECISION, ASM, False, EVEN_D)
                if full_end < end:
                    acc_w, m_w, l_w = _warp_tile(
                        acc_w, m_w, l_w, q_w, q2_w, qa, qa2, k_base, v_base, ks_base, vs_base, bt_row, full_end,
                        lo, end, offs_d, d_ok, HKV, D, PAGE, W, NW, IS_INT8, K_MODE, V_MODE, DOT_DTYPE, QK_DTYPE,
                        PV_DTYPE, PRECISION, ASM, True, EVEN_D)
            acc, m_i, l_i = _merge_sub_tiles(acc_w, m_w, l_w)
        else:
            acc, m_i, l_i = _decode_keys(
                q, q2, qa, qa2, k_base, v_base, ks_base, vs_base, bt_row, start, full_end, end, lo, offs_d, d_ok,
                HKV, D, K_T, WINDOW, PAGE, BLOCK_M, BLOCK_N, D_PAD, IS_INT8, K_MODE, V_MODE, DOT_DTYPE, QK_DTYPE,
                PV_DTYPE, PRECISION, ASM, EVEN_D)

        # An empty split (or a zero-length padding sequence) has l = 0: write 0 and lse = -inf.
        has = l_i > 0.0
        o = acc / tl.where(has, l_i, 1.0)[:, None]
        if DIRECT:  # one split: no stage 2
            o_ptrs = out_ptr + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
            tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
        else:
            # A sequence may use only its first splits (`_used_splits`): one split writes `out`
            # itself (what stage 2 would make of it: weight 2^0 = 1, the bits of acc / l), and
            # splits past the sequence's end write nothing (stage 2 reads only the used ones).
            used = _used_splits(seq_len, num_splits, SPLIT_TOKENS, WINDOW, BLOCK_N, MIN_TILES)
            if used <= 1:
                if split == 0:
                    o_ptrs = out_ptr + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
                    tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
            elif split < used:
                # workspace part (B, HQ, num_splits, D_PAD) and lse (B, HQ, num_splits), contiguous
                row = (b.to(tl.int64) * HQ + heads) * num_splits + split  # (BLOCK_M,)
                tl.store(part_ptr + row[:, None] * D_PAD + offs_d[None, :], o, mask=row_ok[:, None])
                lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
                tl.store(lse_ptr + row, lse, mask=row_ok)




@triton.jit
def _find_sequence(cum_ptr, num_seqs, item):
    """The sequence whose items hold `item`: the first b with cum[b] > item (cum: inclusive
    prefix sums of each sequence's item count), by binary search."""
    lo = tl.zeros((), tl.int32)
    hi = lo + num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        below = tl.load(cum_ptr + mid) <= item
        lo = tl.where(below, mid + 1, lo)
        hi = tl.where(below, hi, mid)
    return lo


# One compile whatever the split count, and whatever the alignment of seq_lens, a slice of the
# runner's staging buffer at an offset that moves with the step's token count.
@triton.jit(do_not_specialize=["num_splits", "num_seqs"], do_not_specialize_on_alignment=["lens_ptr", "cum_ptr"])
def _decode_stage1(
    q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr, lens_ptr, out_ptr, part_ptr, lse_ptr, cum_ptr,
    qk_scale,
    stride_qb, stride_qh,
    stride_btb,
    stride_ob, stride_oh,
    num_splits, num_seqs,
    G: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr, K_T: tl.constexpr, SPLIT_TOKENS: tl.constexpr, DIRECT: tl.constexpr, WINDOW: tl.constexpr,
    PAGE: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_INT8: tl.constexpr, K_MODE: tl.constexpr, V_MODE: tl.constexpr, DOT_DTYPE: tl.constexpr,
    QK_DTYPE: tl.constexpr, PV_DTYPE: tl.constexpr, PRECISION: tl.constexpr, ASM: tl.constexpr,
    WORKLIST: tl.constexpr, W: tl.constexpr, MIN_TILES: tl.constexpr,
):
    h = tl.program_id(0)  # kv head: a sequence's Hkv programs launch side by side
    if WORKLIST:
        # Persistent programs: program p takes items p, p + P, ... of the batch's (sequence, split)
        # items, in sequence order (cum_ptr: inclusive prefix sums of each sequence's splits).
        num_items = tl.load(cum_ptr + num_seqs - 1)
        for item in range(tl.program_id(1), num_items, tl.num_programs(1)):
            b = _find_sequence(cum_ptr, num_seqs, item)
            first_item = tl.load(cum_ptr + b - 1, mask=b > 0, other=0)
            _decode_split(h, b, item - first_item, q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr, lens_ptr, out_ptr,
                          part_ptr, lse_ptr, qk_scale, stride_qb, stride_qh, stride_btb, stride_ob, stride_oh,
                          num_splits, G, HQ, HKV, K_T, SPLIT_TOKENS, DIRECT, WINDOW, PAGE, D, D_PAD, BLOCK_M,
                          BLOCK_N, IS_INT8, K_MODE, V_MODE, DOT_DTYPE, QK_DTYPE, PV_DTYPE, PRECISION, ASM, W, MIN_TILES)
    else:
        _decode_split(h, tl.program_id(1), tl.program_id(2), q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr, lens_ptr,
                      out_ptr, part_ptr, lse_ptr, qk_scale, stride_qb, stride_qh, stride_btb, stride_ob, stride_oh,
                      num_splits, G, HQ, HKV, K_T, SPLIT_TOKENS, DIRECT, WINDOW, PAGE, D, D_PAD, BLOCK_M,
                      BLOCK_N, IS_INT8, K_MODE, V_MODE, DOT_DTYPE, QK_DTYPE, PV_DTYPE, PRECISION, ASM, W, MIN_TILES)


@triton.jit(do_not_specialize=["num_splits"], do_not_specialize_on_alignment=["lens_ptr"])
def _decode_stage2(
    part_ptr, lse_ptr, out_ptr, lens_ptr,
    stride_ob, stride_oh, num_splits,
    HQ: tl.constexpr, SPLIT_TOKENS: tl.constexpr, SPLITS_P2: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
    WINDOW: tl.constexpr, BLOCK_N: tl.constexpr, MIN_TILES: tl.constexpr,
):
    b = tl.program_id(0)
    hq = tl.program_id(1)
    # the splits the sequence reaches (stage 1 wrote `out` itself for one)
    used = num_splits
    if SPLIT_TOKENS > 0 or MIN_TILES > 1:
        used = _used_splits(tl.load(lens_ptr + b), num_splits, SPLIT_TOKENS, WINDOW, BLOCK_N, MIN_TILES)
    if used > 1:
        offs_s = tl.arange(0, SPLITS_P2)
        offs_d = tl.arange(0, D_PAD)
        s_ok = offs_s < used
        row = (b.to(tl.int64) * HQ + hq) * num_splits  # first split of this (sequence, head)
        lse = tl.load(lse_ptr + row + offs_s, mask=s_ok, other=float("-inf"))  # (SPLITS_P2,)
        m = tl.max(lse, axis=0)
        m = tl.where(m == float("-inf"), 0.0, m)  # all splits empty: weights 0, output 0
        w = tl.exp2(lse - m)  # empty split: 2^-inf = 0
        part = tl.load(part_ptr + (row + offs_s)[:, None] * D_PAD + offs_d[None, :],
                       mask=s_ok[:, None], other=0.0)  # (SPLITS_P2, D_PAD)
        total = tl.sum(w, axis=0)
        o = tl.sum(part * w[:, None], axis=0) / tl.where(total > 0.0, total, 1.0)
        tl.store(out_ptr + b.to(tl.int64) * stride_ob + hq * stride_oh + offs_d,
                 o.to(out_ptr.dtype.element_ty), mask=offs_d < D)


@functools.lru_cache(maxsize=8)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (looked up once per device)."""
    return _sm_count(device.index or 0)


def default_num_splits(batch: int, num_kv_heads: int, max_seq_len: int, sm_count: int, per_sm: float = WAVES) -> int:
    """Splits per sequence so that B * Hkv * splits stage-1 programs give every SM about `per_sm`
    of them (the programs a config keeps resident per SM; WAVES for the 16-bit tables), but no split
    is shorter than MIN_SPLIT_TOKENS (stage 2 and the workspace would then cost more than the extra
    programs gain). B * Hkv >= per_sm * SMs already fills the chip: 1 split, and no stage 2."""
    programs = batch * num_kv_heads
    want = max(1, round(per_sm * sm_count / programs))
    cap = max(1, cdiv(max_seq_len, MIN_SPLIT_TOKENS))
    return max(1, min(want, cap, MAX_SPLITS))


SPLIT_TOKENS = 1024  # the engine's fixed split (fixed_split_tokens): the fastest of those measured
MAX_FIXED_SPLITS = 16  # the most fixed splits the engine's grid holds (fixed_split_tokens)


def invariant_split_tokens(max_len: int) -> int:
    """Keys per split in the batch-invariant mode, for contexts up to `max_len`: SPLIT_TOKENS
    whatever the batch, or a multiple of it where that would need more than MAX_SPLITS splits."""
    return SPLIT_TOKENS * cdiv(cdiv(max_len, SPLIT_TOKENS), MAX_SPLITS)


def fixed_split_tokens(max_len: int, batch: int, num_kv_heads: int, sm_count: int) -> int | None:
    """Keys per split for the engine's `paged_decode(split_tokens=...)` of `batch` sequences over
    contexts up to `max_len` (what its CUDA graphs are captured for), or None for the
    batch-dependent split count.

    Fixed splits balance a ragged batch: one long context no longer runs alone on one SM while the
    rest of the chip idles, and a sequence's output does
    not depend on its companions. But the grid holds a program per split of the longest allowed
    context, and for short contexts most of them only read their length and leave (a measurable
    cost on a short-context decode step), so they are used up to
    MAX_FIXED_SPLITS (max_len <= 16,384). And a few sequences get more programs each from the batch
    count (one long context runs faster over the batch count's twice as many; eight: equal), so
    fixed splits need the batch to give at least half the SMs a program (batch x kv heads)."""
    if cdiv(max_len, SPLIT_TOKENS) > MAX_FIXED_SPLITS or 2 * batch * num_kv_heads < sm_count:
        return None
    return SPLIT_TOKENS


K_MODES = {"cast": 0, "bias": 1, "imma": 2, "imma1": 3}  # see _int8_scores
V_MODES = {"cast": 0, "asm": 1, "bias": 2}  # see _int8_pv


@dataclass(frozen=True, slots=True)
class DecodeConfig:
    """Launch parameters of stage 1 (see `_config` for the defaults)."""

    block_n: int  # tokens per K/V tile: whole pages, or an even share of one
    num_warps: int = 4
    num_stages: int = 3  # software-pipelining depth of the K/V loads
    maxnreg: int | None = None  # register cap per thread (None: the compiler's choice)
    k_mode: str = "cast"  # int8 scores: one of K_MODES
    v_mode: str = "asm"  # int8 P V: one of V_MODES (the PTX conversions only on the GPU)
    tight_m: bool = False  # dot rows = the GQA group (padded to a power of two), not >= 16
    k_t: bool = True  # K loaded as (D, N) (its own addresses) rather than (N, D) like V
    per_sm: float = WAVES  # stage-1 programs resident per SM, for the split-count heuristic
    # > 0: each tile's keys in this many sub-tiles with a softmax state of their own, one per warp
    # (`_warp_tile`; block_n // sub_tiles keys each, >= 16), merged once per split
    sub_tiles: int = 0
    # Splits by the batch count (no split_tokens): > 0, a sequence's keys go to as many of the
    # grid's splits as hold at least this many keys each (the rule `default_num_splits` applies to
    # the batch's longest context, applied per sequence on the device), the rest exit at once and
    # one used split writes `out` itself; 0, its tiles spread over every split. The grid a graph
    # captures for the longest allowed context then does a short context's work in one split.
    min_split: int = 0


MANY_PROGRAMS = 8  # (sequence, kv head) pairs per SM from which head dim 64 runs one warp per program


def _config(d_pad: int, page: int, cache_dtype: torch.dtype, on_gpu: bool, programs_per_sm: float = 0.0) -> DecodeConfig:
    """Launch table, by the padded head dim. Interpreter: small tiles keep masked work low. GPU:
    the fastest of benchmarks/decode_variants.py's candidates (Hq 32, Hkv 8, page 16). int8 at
    head dim 128: 4 warps over 64-key tiles, the group's 4 query rows without padding registers
    (128 registers, 4 programs and 16 warps per SM; the old 2-warp table used 255 and spilled),
    scores on int8 tensor cores, V read as 1152 + V. Head dim 64: 2 warps over 128-key tiles (the
    4-warp table lost at 400-token contexts), and with at least
    MANY_PROGRAMS (sequence, kv head) pairs per SM (`programs_per_sm`, 0 = unknown) one warp over
    32-key tiles (faster on many short contexts; with few programs it starves the SMs). Head dims
    past 128 keep the old table (halved tiles, not measured again). 16-bit pages: BLOCK_N 64 / 2
    stages."""
    if not on_gpu:
        return DecodeConfig(block_n=max(16, min(page, 32)), num_stages=1, k_mode="cast", v_mode="cast")
    wide = d_pad > 128
    if cache_dtype == torch.int8:
        if wide:
            return DecodeConfig(block_n=64, num_warps=2, num_stages=2, k_mode="cast", v_mode="asm")
        k_mode = "imma" if d_pad >= 32 else "bias"
        if d_pad >= 128:
            return DecodeConfig(64, 4, 2, k_mode=k_mode, v_mode="bias", tight_m=True, k_t=False, per_sm=4)
        if programs_per_sm >= MANY_PROGRAMS:
            # 128 registers: 16 programs per SM (the B256 ctx400 grid in one wave); uncapped, the
            # fixed-split paths take more (triton 3.6): fewer programs per SM and a second wave,
            # measurably slower
            return DecodeConfig(32, 1, 3, maxnreg=128, k_mode="bias", v_mode="bias", tight_m=True, k_t=False,
                                per_sm=10)
        return DecodeConfig(128, 2, 2, k_mode=k_mode, v_mode="bias", tight_m=True)
    if cache_dtype == torch.float32:
        return DecodeConfig(block_n=16 if wide else 32 if d_pad >= 128 else 64, num_stages=2)
    return DecodeConfig(block_n=32 if wide else 64 if d_pad >= 128 else 128, num_stages=2)


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    softmax_scale: float,
    *,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    window: int | None = None,
    split_tokens: int | None = None,
    programs: int | None = None,
    out: torch.Tensor | None = None,
    config: DecodeConfig | None = None,
    batch_invariant: bool = False,
) -> torch.Tensor:
    """Decode attention of one query per sequence over the paged cache; the Triton twin of
    `kernels.reference.paged_attention_decode`.

    q (B, Hq, D), D even and <= 256; caches (num_blocks, PAGE, Hkv, D); scales (num_blocks, Hkv,
    PAGE) fp16 iff int8; block_tables (B, max_blocks) int32 (entries past a sequence's last page
    are never read); seq_lens (B,) int32, >= 1. max_seq_len: a host bound on seq_lens, saves a
    device sync when num_splits is not given. num_splits: force the split count (1 = no stage 2).
    window: sliding-window width (the query sees its last `window` keys), None = all.
    split_tokens: split each sequence at fixed key positions, every `split_tokens` keys (a multiple
    of the tile, e.g. 1024), and merge the splits in a fixed order: a sequence's output is then the
    same bits in any batch that picks the same launch table (the default split count depends on the
    batch size and the longest sequence; with split_tokens only on the sequence itself, up to
    MAX_SPLITS splits), and a batch of ragged lengths keeps every SM busy (`fixed_split_tokens`;
    a sequence no longer than one split skips stage 2, splits past its end cost nothing).
    programs: with split_tokens, that many persistent programs per kv head take the batch's
    (sequence, split) items in turn (a work list from the prefix sums of each sequence's split
    count, on the device): the grid no longer grows with the longest allowed context, no program
    is spent on a split past a sequence's end, and the bits are those of the one-program-per-split
    grid. (Measured against it in benchmarks/decode_variants.py --ragged; not yet the engine's.)
    out: (B, Hq, D) q.dtype, written in full. config: overrides the launch table (benchmarks).
    batch_invariant: the launch table chosen without the batch size (head dim 64 otherwise takes a
    one-warp table in large batches), so that with split_tokens a sequence's output is the same bits
    in every batch. Returns out.
    """
    assert q.dim() == 3, f"q must be (B, Hq, D), got {tuple(q.shape)}"
    assert q.dtype in _Q_DTYPES, f"unsupported q dtype {q.dtype}"
    assert k_cache.dim() == 4 and v_cache.shape == k_cache.shape, (
        f"caches must be (blocks, page, Hkv, D): {tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    assert k_cache.dtype in _CACHE_DTYPES and v_cache.dtype == k_cache.dtype
    b, hq, d = q.shape
    num_blocks, page, hkv, dk = k_cache.shape
    assert dk == d, f"head dim {d} of q vs {dk} of the cache"
    assert d % 2 == 0 and 2 <= d <= MAX_HEAD_DIM, f"head dim {d} not even or above {MAX_HEAD_DIM}"
    assert page >= 8 and page & (page - 1) == 0, f"block size {page} not a power of two >= 8"
    assert hq % hkv == 0, f"Hq {hq} not a multiple of Hkv {hkv}"
    group = hq // hkv
    assert 1 <= group <= MAX_GROUP, f"GQA group {group} outside 1..{MAX_GROUP}"
    assert q.stride(2) == 1, "q's last dim must be contiguous"
    assert k_cache.is_contiguous() and v_cache.is_contiguous(), "caches must be contiguous"
    assert window is None or window >= 1, f"window {window} must be >= 1"
    is_int8 = k_cache.dtype == torch.int8
    if is_int8:
        want = (num_blocks, hkv, page)
        for s in (k_scale, v_scale):
            assert s is not None and s.dtype == torch.float16 and tuple(s.shape) == want, (
                f"int8 cache needs fp16 scales of shape {want}")
            assert s.is_contiguous(), "scales must be contiguous"
    else:
        assert k_scale is None and v_scale is None, "scales are only for int8 caches"
    assert block_tables.dim() == 2 and block_tables.shape[0] == b and block_tables.stride(1) == 1, (
        f"block_tables must be ({b}, max_blocks), rows contiguous")
    assert block_tables.dtype == torch.int32, f"block_tables must be int32: {block_tables.dtype}"
    assert seq_lens.shape == (b,) and seq_lens.is_contiguous(), f"seq_lens must be ({b},)"
    assert seq_lens.dtype == torch.int32, f"seq_lens must be int32, not {seq_lens.dtype}"
    devices = {t.device for t in (q, k_cache, v_cache, block_tables, seq_lens)}
    assert len(devices) == 1, f"tensors on several devices: {devices}"
    if out is None:
        out = torch.empty_like(q)
    else:
        assert out.shape == q.shape and out.dtype == q.dtype and out.device == q.device, (
            f"out must be {tuple(q.shape)} {q.dtype} on {q.device}")
        assert out.stride(2) == 1, "out's last dim must be contiguous"
    if b == 0:
        return out

    on_gpu = q.device.type == "cuda"
    dot_dtype, precision = dot_types(q.dtype, on_gpu)
    d_pad = pad_head_dim(d)
    # The one-warp table (head dim 64) needs many programs, so the table depends on the batch size:
    # split_tokens gives the same bits in any batch that picks the same table.
    programs_per_sm = b * hkv / _sm_count(q.device.index or 0) if on_gpu and not batch_invariant else 0.0
    assert not batch_invariant or split_tokens is not None, "batch_invariant needs split_tokens"
    cfg = config or _config(d_pad, page, k_cache.dtype, on_gpu, programs_per_sm)
    assert cfg.k_mode in K_MODES and cfg.v_mode in V_MODES, f"unknown int8 modes {cfg.k_mode}, {cfg.v_mode}"
    assert not (is_int8 and cfg.k_mode.startswith("imma") and d_pad < 32), "int8 tensor-core scores need D >= 32"
    assert on_gpu or cfg.v_mode != "asm", "v_mode 'asm' is inline PTX: GPU only"
    assert cfg.sub_tiles == 0 or (cfg.block_n % cfg.sub_tiles == 0 and cfg.block_n // cfg.sub_tiles >= 16), (
        f"block_n {cfg.block_n} not {cfg.sub_tiles} sub-tiles of >= 16 keys")
    # int8 V cast to bf16 in the dot-operand layout fails the kernel tests on the GPU (cause not
    # found; no launch table uses it): refused there
    assert not (on_gpu and is_int8 and cfg.v_mode == "cast"), "v_mode 'cast' is not for int8 pages on the GPU"
    # The int8 modes that read K or V as fp16 do so in fp16 on the GPU; the interpreter keeps the
    # dot dtype (its fp32 dots check the same algebra exactly).
    half = tl.float16 if on_gpu else dot_dtype
    extra = {} if cfg.maxnreg is None or not on_gpu else {"maxnreg": cfg.maxnreg}

    if split_tokens is not None:
        assert split_tokens % cfg.block_n == 0, f"split_tokens {split_tokens} not a multiple of {cfg.block_n}"
        if max_seq_len is None:
            max_seq_len = int(seq_lens.max())  # device sync; callers pass max_seq_len to avoid it
        need = cdiv(max_seq_len, split_tokens)
        assert need <= MAX_SPLITS, f"{need} splits of {split_tokens} tokens: more than {MAX_SPLITS}"
        assert num_splits is None or num_splits >= need, f"num_splits {num_splits} < {need}"
        num_splits = num_splits or need
    if num_splits is None:
        if max_seq_len is None:
            max_seq_len = int(seq_lens.max())  # device sync; callers pass max_seq_len to avoid it
        sms = _sm_count(q.device.index or 0) if on_gpu else 1
        num_splits = default_num_splits(b, hkv, min(max_seq_len, window or max_seq_len), sms, cfg.per_sm)
    assert num_splits >= 1, f"num_splits {num_splits} < 1"
    assert programs is None or (split_tokens is not None and programs >= 1), (
        "programs (a work list of splits) needs split_tokens and at least one program")
    cum = seq_lens  # unused by the kernel without a work list
    if programs is not None:
        # each sequence's splits (at least one: a zero-length padding row still writes its zeros)
        cum = torch.cumsum(torch.clamp((seq_lens + (split_tokens - 1)) // split_tokens, min=1), 0, dtype=torch.int32)
    # M rows of the dots: the group padded to a power of two (the layout pads to the MMA's 16 rows
    # itself, without registers for the padding), or at least BLOCK_M (the old layout).
    block_m = next_pow2(group) if cfg.tight_m else max(BLOCK_M, next_pow2(group))

    min_tiles = cdiv(cfg.min_split, cfg.block_n) if split_tokens is None and cfg.min_split > 0 else 1
    if num_splits == 1:
        part = lse = out  # unused by the kernel
    else:
        part = torch.empty((b, hq, num_splits, d_pad), dtype=torch.float32, device=q.device)
        lse = torch.empty((b, hq, num_splits), dtype=torch.float32, device=q.device)
    ks = k_scale if is_int8 else k_cache  # unused pointers when not int8
    vs = v_scale if is_int8 else v_cache
    _decode_stage1[(hkv, b, num_splits) if programs is None else (hkv, programs)](
        q, k_cache, v_cache, ks, vs, block_tables, seq_lens, out, part, lse, cum,
        softmax_scale * LOG2E,
        q.stride(0), q.stride(1),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        num_splits, b,
        G=group, HQ=hq, HKV=hkv, K_T=cfg.k_t, SPLIT_TOKENS=split_tokens or 0, DIRECT=num_splits == 1, WINDOW=window or 0,
        PAGE=page, D=d, D_PAD=d_pad, BLOCK_M=block_m, BLOCK_N=cfg.block_n,
        IS_INT8=is_int8, K_MODE=K_MODES[cfg.k_mode], V_MODE=V_MODES[cfg.v_mode], DOT_DTYPE=dot_dtype,
        QK_DTYPE=half if is_int8 and cfg.k_mode == "bias" else dot_dtype,
        PV_DTYPE=half if is_int8 and cfg.v_mode != "cast" else dot_dtype, PRECISION=precision, ASM=on_gpu,
        WORKLIST=programs is not None, W=cfg.sub_tiles, MIN_TILES=min_tiles, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, **extra,
    )
    if num_splits > 1:
        _decode_stage2[(b, hq)](
            part, lse, out, seq_lens, out.stride(0), out.stride(1), num_splits,
            HQ=hq, SPLIT_TOKENS=split_tokens or 0, SPLITS_P2=max(MAX_SPLITS, next_pow2(num_splits)),
            # (the window and tile read only with MIN_TILES > 1: no other compile without it)
            WINDOW=(window or 0) if min_tiles > 1 else 0, BLOCK_N=cfg.block_n if min_tiles > 1 else 16,
            MIN_TILES=min_tiles,
            D=d, D_PAD=d_pad,
            num_warps=4 if d_pad >= 128 else 2,
        )
    return out
