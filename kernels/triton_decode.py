"""Paged decode attention in Triton (flash-decoding): one query token per sequence.

    q        (B, Hq, D)                      bf16 | fp16 | fp32
    k_cache  (num_blocks, PAGE, Hkv, D)      int8 | bf16 | fp16 | fp32  (v_cache the same)
    k_scale  (num_blocks, Hkv, PAGE)         fp16, int8 caches only     (v_scale the same)
    out      (B, Hq, D)                      q.dtype

Stage 1, one program per (sequence, kv head, split):

    keys of sequence b:  |<- split 0 ->|<- split 1 ->| ... |<- split S-1 ->|     (whole tiles)
    tile of BLOCK_N keys: page = block_tables[b, n // PAGE], row = page*PAGE + n % PAGE

The G = Hq/Hkv query heads of the kv head are the M rows of `tl.dot` (padded to BLOCK_M >= 16), so
each K/V tile is read once per kv head. Only the sequence's last tile is partial, so every other
tile runs without masks. With one split the program writes `out` directly; otherwise it writes the
normalized partial output and its base-2 log-sum-exp to an fp32 workspace, and stage 2 (one program
per (sequence, query head)) merges the splits, weighting each by 2^(lse - max lse); an empty split
has lse = -inf and weight 0. With a sliding window W the keys start at seq_len - W (every tile
masked then). The tile update is triton_tile's, shared with the extend kernel; K is
loaded transposed, (D, BLOCK_N), and V goes int8 -> fp16 in inline PTX on the GPU (V_ASM).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.triton_tile import accumulate_pv, dot_types, load, online_softmax, pad_head_dim, paged_slots, tile_scores

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
def _decode_tile(acc, m_i, l_i, q, k_base, v_base, ks_base, vs_base, bt_row, tile_start, lo, end,
                 stride_kp, stride_kt, stride_sp, offs_d, d_ok,
                 PAGE: tl.constexpr, BLOCK_N: tl.constexpr, IS_INT8: tl.constexpr, DOT_DTYPE: tl.constexpr,
                 PRECISION: tl.constexpr, V_ASM: tl.constexpr, MASKED: tl.constexpr, EVEN_D: tl.constexpr):
    """Keys [tile_start, tile_start + BLOCK_N) of one sequence's pages; when MASKED, only those in
    [lo, end) count."""
    offs_n = tile_start + tl.arange(0, BLOCK_N)
    key_ok = (offs_n >= lo) & (offs_n < end)
    page, slot = paged_slots(bt_row, offs_n, key_ok, PAGE, MASKED)
    row = page * stride_kp + slot * stride_kt  # (BLOCK_N,) int64 element offset of each key
    use_mask: tl.constexpr = MASKED or not EVEN_D
    kt = load(k_base + row[None, :] + offs_d[:, None], key_ok[None, :] & d_ok[:, None], 0.0, use_mask)  # (D, N)
    srow = page * stride_sp + slot  # (BLOCK_N,) offset into this kv head's scale pages (int8 only)
    s = tile_scores(q, kt, ks_base + srow, key_ok, key_ok[None, :], True, IS_INT8, MASKED, DOT_DTYPE, PRECISION)
    p, alpha, m_i, l_i = online_softmax(s, m_i, l_i, False)  # every split's first tile shows a key
    v = load(v_base + row[:, None] + offs_d[None, :], key_ok[:, None] & d_ok[None, :], 0.0, use_mask)  # (N, D)
    v_s = 0.0
    if IS_INT8:
        v_s = load(vs_base + srow, key_ok, 0.0, MASKED).to(tl.float32)
    acc = accumulate_pv(acc, alpha, p, v, v_s, IS_INT8, V_ASM, DOT_DTYPE, PRECISION)
    return acc, m_i, l_i


# One compile whatever the split count, and whatever the alignment of seq_lens, a slice of the
# runner's staging buffer at an offset that moves with the step's token count.
@triton.jit(do_not_specialize=["num_splits"], do_not_specialize_on_alignment=["lens_ptr"])
def _decode_stage1(
    q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr, lens_ptr, out_ptr, part_ptr, lse_ptr,
    qk_scale,
    stride_qb, stride_qh,
    stride_kp, stride_kt, stride_kh,
    stride_sp, stride_sh,
    stride_btb,
    stride_ob, stride_oh,
    num_splits,
    G: tl.constexpr, HQ: tl.constexpr, DIRECT: tl.constexpr, WINDOW: tl.constexpr,
    PAGE: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_INT8: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr, V_ASM: tl.constexpr,
):
    h = tl.program_id(0)  # kv head: a sequence's Hkv programs launch side by side
    b = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(lens_ptr + b)
    lo = 0
    if WINDOW > 0:
        lo = tl.maximum(seq_len - WINDOW, 0)  # the oldest key the query still sees
    first = lo // BLOCK_N * BLOCK_N
    num_tiles = tl.cdiv(seq_len - first, BLOCK_N)
    tiles_per_split = tl.cdiv(num_tiles, num_splits)
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
    q = (q.to(tl.float32) * qk_scale).to(DOT_DTYPE)

    k_base = k_ptr + h.to(tl.int64) * stride_kh
    v_base = v_ptr + h.to(tl.int64) * stride_kh
    ks_base = ks_ptr + h.to(tl.int64) * stride_sh
    vs_base = vs_ptr + h.to(tl.int64) * stride_sh
    bt_row = bt_ptr + b.to(tl.int64) * stride_btb

    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, D_PAD), tl.float32)
    if WINDOW > 0:  # the window's first tile starts mid-tile: mask every tile (a rare model kind)
        for tile_start in range(start, end, BLOCK_N):
            acc, m_i, l_i = _decode_tile(
                acc, m_i, l_i, q, k_base, v_base, ks_base, vs_base, bt_row, tile_start, lo, end,
                stride_kp, stride_kt, stride_sp, offs_d, d_ok,
                PAGE, BLOCK_N, IS_INT8, DOT_DTYPE, PRECISION, V_ASM, True, EVEN_D)
    else:
        for tile_start in range(start, full_end, BLOCK_N):
            acc, m_i, l_i = _decode_tile(
                acc, m_i, l_i, q, k_base, v_base, ks_base, vs_base, bt_row, tile_start, lo, end,
                stride_kp, stride_kt, stride_sp, offs_d, d_ok,
                PAGE, BLOCK_N, IS_INT8, DOT_DTYPE, PRECISION, V_ASM, False, EVEN_D)
        if full_end < end:
            acc, m_i, l_i = _decode_tile(
                acc, m_i, l_i, q, k_base, v_base, ks_base, vs_base, bt_row, full_end, lo, end,
                stride_kp, stride_kt, stride_sp, offs_d, d_ok,
                PAGE, BLOCK_N, IS_INT8, DOT_DTYPE, PRECISION, V_ASM, True, EVEN_D)

    # An empty split (or a zero-length padding sequence) has l = 0: write 0 and lse = -inf.
    has = l_i > 0.0
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    if DIRECT:  # one split: no stage 2
        o_ptrs = out_ptr + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    else:
        # workspace part (B, HQ, num_splits, D_PAD) and lse (B, HQ, num_splits), contiguous
        row = (b.to(tl.int64) * HQ + heads) * num_splits + split  # (BLOCK_M,)
        tl.store(part_ptr + row[:, None] * D_PAD + offs_d[None, :], o, mask=row_ok[:, None])
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + row, lse, mask=row_ok)


@triton.jit(do_not_specialize=["num_splits"])
def _decode_stage2(
    part_ptr, lse_ptr, out_ptr,
    stride_ob, stride_oh, num_splits,
    HQ: tl.constexpr, SPLITS_P2: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
):
    b = tl.program_id(0)
    hq = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_P2)
    offs_d = tl.arange(0, D_PAD)
    s_ok = offs_s < num_splits
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


def default_num_splits(batch: int, num_kv_heads: int, max_seq_len: int, sm_count: int) -> int:
    """Splits per sequence so that B * Hkv * splits stage-1 programs give every SM about WAVES of
    them, but no split is shorter than MIN_SPLIT_TOKENS (stage 2 and the workspace would then cost
    more than the extra programs gain). B * Hkv >= WAVES * SMs already fills the chip: 1 split, and
    no stage 2."""
    programs = batch * num_kv_heads
    want = triton.cdiv(WAVES * sm_count, programs)
    cap = max(1, triton.cdiv(max_seq_len, MIN_SPLIT_TOKENS))
    return max(1, min(want, cap, MAX_SPLITS))


@dataclass(frozen=True, slots=True)
class DecodeConfig:
    """Launch parameters of stage 1 (see `_config` for the defaults)."""

    block_n: int  # tokens per K/V tile: whole pages, or an even share of one
    num_warps: int = 4
    num_stages: int = 3  # software-pipelining depth of the K/V loads
    maxnreg: int | None = None  # register cap per thread (None: the compiler's choice)
    v_asm: bool = True  # int8 V to fp16 in inline PTX before shared memory (GPU only)


def _config(d_pad: int, page: int, cache_dtype: torch.dtype, on_gpu: bool) -> DecodeConfig:
    """Launch table, by the padded head dim. Interpreter: small tiles keep masked work low. GPU:
    measured on an H200 with benchmarks/decode_variants.py (B=64 ctx 4096 / B=1 ctx 32768 / B=256
    ctx 512; Hq 32, Hkv 8, D 128, page 16). int8: BLOCK_N 128 / 3 stages beat 64 / 2-3 stages by
    10-40 % (twice the bytes per tile for the same per-tile overhead; 255 registers, 2 programs per
    SM, and 512 programs fill two whole waves); 32 was 2x slower. 16-bit pages: BLOCK_N 64 / 2
    stages (4.1 TB/s), 128 within 1 %. D=64 int8: see below. Head dims past 128 halve the tile so
    that a tile's registers stay those of D 128."""
    if not on_gpu:
        return DecodeConfig(block_n=max(16, min(page, 32)), num_stages=1)
    wide = d_pad > 128
    if cache_dtype == torch.int8:
        # 2 warps (2026-12-01, same H200, decode_variants.py --engine, fp16 scales): at D 128
        # 0.248 ms (B64 ctx4096) and 0.122 ms (B256 ctx512) against 0.287 / 0.154 with 4 warps;
        # at D 64 0.089 (B256 ctx400) and 0.123 (B64 ctx4096) against 0.095 / 0.146.
        return DecodeConfig(block_n=64 if wide else 128, num_warps=2, num_stages=2)
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
    out: torch.Tensor | None = None,
    config: DecodeConfig | None = None,
) -> torch.Tensor:
    """Decode attention of one query per sequence over the paged cache; the Triton twin of
    `kernels.reference.paged_attention_decode`.

    q (B, Hq, D), D even and <= 256; caches (num_blocks, PAGE, Hkv, D); scales (num_blocks, Hkv,
    PAGE) fp16 iff int8; block_tables (B, max_blocks) int32 (entries past a sequence's last page
    are never read); seq_lens (B,) int32, >= 1. max_seq_len: a host bound on seq_lens, saves a
    device sync when num_splits is not given. num_splits: force the split count (1 = no stage 2).
    window: sliding-window width (the query sees its last `window` keys), None = all. out: (B, Hq,
    D) q.dtype, written in full. config: overrides the launch table (benchmarks). Returns out.
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
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1, (
        "caches need equal strides and a contiguous last dim")
    assert window is None or window >= 1, f"window {window} must be >= 1"
    is_int8 = k_cache.dtype == torch.int8
    if is_int8:
        want = (num_blocks, hkv, page)
        for s in (k_scale, v_scale):
            assert s is not None and s.dtype == torch.float16 and tuple(s.shape) == want, (
                f"int8 cache needs fp16 scales of shape {want}")
            assert s.stride(2) == 1, "scales' last dim must be contiguous"
        assert k_scale.stride() == v_scale.stride(), "k_scale and v_scale need equal strides"
        sp, sh = k_scale.stride(0), k_scale.stride(1)
    else:
        assert k_scale is None and v_scale is None, "scales are only for int8 caches"
        sp, sh = 0, 0
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
    cfg = config or _config(d_pad, page, k_cache.dtype, on_gpu)
    extra = {} if cfg.maxnreg is None or not on_gpu else {"maxnreg": cfg.maxnreg}

    if num_splits is None:
        if max_seq_len is None:
            max_seq_len = int(seq_lens.max())  # device sync; callers pass max_seq_len to avoid it
        sms = _sm_count(q.device.index or 0) if on_gpu else 1
        num_splits = default_num_splits(b, hkv, min(max_seq_len, window or max_seq_len), sms)
    assert num_splits >= 1, f"num_splits {num_splits} < 1"
    block_m = max(BLOCK_M, triton.next_power_of_2(group))

    if num_splits == 1:
        part = lse = out  # unused by the kernel
    else:
        part = torch.empty((b, hq, num_splits, d_pad), dtype=torch.float32, device=q.device)
        lse = torch.empty((b, hq, num_splits), dtype=torch.float32, device=q.device)
    ks = k_scale if is_int8 else k_cache  # unused pointers when not int8
    vs = v_scale if is_int8 else v_cache
    _decode_stage1[(hkv, b, num_splits)](
        q, k_cache, v_cache, ks, vs, block_tables, seq_lens, out, part, lse,
        softmax_scale * LOG2E,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        sp, sh,
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        num_splits,
        G=group, HQ=hq, DIRECT=num_splits == 1, WINDOW=window or 0,
        PAGE=page, D=d, D_PAD=d_pad, BLOCK_M=block_m, BLOCK_N=cfg.block_n,
        IS_INT8=is_int8, DOT_DTYPE=dot_dtype, PRECISION=precision, V_ASM=is_int8 and on_gpu and cfg.v_asm,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **extra,
    )
    if num_splits > 1:
        _decode_stage2[(b, hq)](
            part, lse, out, out.stride(0), out.stride(1), num_splits,
            HQ=hq, SPLITS_P2=triton.next_power_of_2(num_splits), D=d, D_PAD=d_pad,
            num_warps=4 if d_pad >= 128 else 2,
        )
    return out
