"""Torch reference ops for the paged KV cache: the CPU path, and the twins the Triton kernels are
tested against (`triton_cache_write`, `triton_decode`, `triton_extend`, sharing `triton_tile`).
Everything in kernels/ is a pure function on tensors with documented shapes, knowing nothing of
requests or models. An int8 cache stores one symmetric scale per (token, kv head), computed once
when the token is written (scale = fp16(absmax / 127), floored), so earlier tokens are never
re-quantized. One op is not about the cache: `apply_token_bitmask_` forbids tokens in the logits
from structured output's token masks (one bit per vocabulary entry; `triton_bitmask` is its kernel).

Shapes (one layer):
    k_cache, v_cache   (num_blocks, block_size, Hkv, D)  int8 | bfloat16 | float16 | float32
    k_scale, v_scale   (num_blocks, Hkv, block_size)     float16, only for int8 caches, else None
                       (head-major: a kernel reads one page's scales of one kv head contiguously)
    slot               block_id * block_size + offset; -1 marks a padding token (skipped)

Packed queries of B sequences (T = sum of q_len_i):

    sequence i:  |<----------- seq_lens[i] tokens in the cache ----------->|
                 |<-- context: seq_lens[i] - q_len_i -->|<--- q_len_i ---->|
                                                        q[qsl[i]:qsl[i+1]]   (qsl = query_start_loc)

The j-th new query of sequence i (0-based) sits at position seq_lens[i] - q_len_i + j and sees the
cached positions 0 ..= that position (causal). Its own K/V are written before attention runs.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

INT8_MAX = 127.0
# Scales are stored in fp16 (2 bytes per (token, kv head): nearly twice the tokens of a bf16 cache
# at head dim 128, a little more than with fp32 scales). The scale is rounded to fp16 before the
# values are quantized against it, so the stored pair is exact; its floor is fp16's smallest
# normal number, where the rounding is still relative (2^-11): vectors below 127 * 2^-14 = 0.0078
# in absmax are quantized in steps of 2^-14.
SCALE_DTYPE = torch.float16
SCALE_MIN = 2.0 ** -14

CACHE_DTYPES = (torch.int8, torch.bfloat16, torch.float16, torch.float32)


def quantize_per_token_head(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 quantization with one scale per (token, head).

    x (T, H, D) float -> (q int8 (T, H, D), scale fp16 (T, H)), with
    scale = fp16(max(absmax over D / 127, SCALE_MIN)) and q = clamp(round(x / scale), -127, 127),
    rounding half away from zero.
    """
    assert x.dim() == 3, f"expected (T, H, D), got {tuple(x.shape)}"
    xf = x.float()
    absmax = xf.abs().amax(dim=-1)  # (T, H)
    # A tensor divisor: CUDA torch multiplies by the reciprocal of a Python scalar divisor, which
    # is not the IEEE quotient the kernels compute (tl.div_rn) and the CPU gives.
    scale = (absmax / torch.full_like(absmax, INT8_MAX)).clamp_min(SCALE_MIN).to(SCALE_DTYPE)
    y = xf / scale.float().unsqueeze(-1)
    # Round half away from zero (not torch.round's half-to-even): what a kernel gets from
    # floor(|y| + 0.5) without libdevice, so the Triton cache write matches this bit for bit.
    q = (torch.sign(y) * torch.floor(y.abs() + 0.5)).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor | None,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q (..., D) with scale (...) -> q * scale in `dtype`; a non-int8 q (scale None) is cast."""
    if scale is None:
        assert q.dtype != torch.int8, "an int8 cache needs its scales"
        return q.to(dtype)
    assert q.shape[:-1] == scale.shape, f"scale {tuple(scale.shape)} vs values {tuple(q.shape)}"
    return (q.float() * scale.unsqueeze(-1)).to(dtype)


def _check_cache(cache: torch.Tensor, scale: torch.Tensor | None) -> None:
    assert cache.dim() == 4, f"cache must be (blocks, block_size, Hkv, D), not {tuple(cache.shape)}"
    assert cache.dtype in CACHE_DTYPES, f"unsupported cache dtype {cache.dtype}"
    assert cache.is_contiguous(), "cache must be contiguous"
    if cache.dtype == torch.int8:
        assert scale is not None and scale.dtype == SCALE_DTYPE, "int8 cache needs fp16 scales"
        want = (cache.shape[0], cache.shape[2], cache.shape[1])  # (num_blocks, Hkv, block_size)
        assert tuple(scale.shape) == want and scale.is_contiguous(), (
            f"scale must be contiguous {want}, got {tuple(scale.shape)}")
    else:
        assert scale is None, "scales are only for int8 caches"


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

    k, v (T, Hkv, D) any float dtype; slot_mapping (T,) int32/int64. An int8 cache quantizes each
    (token, kv head) vector once, here, and stores its scale next to it.
    """
    _check_cache(k_cache, k_scale)
    _check_cache(v_cache, v_scale)
    num_blocks, block_size, hkv, d = k_cache.shape
    assert v_cache.shape == k_cache.shape and v_cache.dtype == k_cache.dtype
    assert k.shape == v.shape and k.dim() == 3 and k.shape[1:] == (hkv, d), (
        f"k/v must be (T, {hkv}, {d}), got {tuple(k.shape)} and {tuple(v.shape)}")
    assert slot_mapping.shape == (k.shape[0],), "one slot per token"
    assert slot_mapping.dtype in (torch.int32, torch.int64)

    slots = slot_mapping.long()
    keep = slots >= 0
    if not bool(keep.all()):
        slots, k, v = slots[keep], k[keep], v[keep]
    if slots.numel() == 0:
        return
    num_slots = num_blocks * block_size
    if k_cache.dtype != torch.int8:
        k_cache.view(num_slots, hkv, d).index_copy_(0, slots, k.to(k_cache.dtype))
        v_cache.view(num_slots, hkv, d).index_copy_(0, slots, v.to(v_cache.dtype))
        return
    # K and V quantized in one pass: scales are per (token, head), so stacking heads changes nothing.
    q, s = quantize_per_token_head(torch.cat((k, v), dim=1))  # (T, 2 Hkv, D), (T, 2 Hkv)
    k_cache.view(num_slots, hkv, d).index_copy_(0, slots, q[:, :hkv])
    v_cache.view(num_slots, hkv, d).index_copy_(0, slots, q[:, hkv:])
    # Scale of (slot, head) in the (num_blocks, Hkv, block_size) layout, flattened: (T, Hkv).
    idx = ((slots // block_size) * (hkv * block_size) + slots % block_size)[:, None] \
        + torch.arange(0, hkv * block_size, block_size, device=slots.device)
    idx = idx.reshape(-1)
    k_scale.view(-1).index_copy_(0, idx, s[:, :hkv].reshape(-1))
    v_scale.view(-1).index_copy_(0, idx, s[:, hkv:].reshape(-1))


def _gather_kv(cache: torch.Tensor, scale: torch.Tensor | None,
               blocks: torch.Tensor) -> torch.Tensor:
    """blocks (..., n) block ids -> float32 values (..., n * block_size, Hkv, D)."""
    _, block_size, hkv, d = cache.shape
    # (..., n, block_size, Hkv, D)
    vals = dequantize(cache[blocks], None if scale is None else scale[blocks].transpose(-1, -2))
    return vals.reshape(*blocks.shape[:-1], blocks.shape[-1] * block_size, hkv, d)


def gather_pages(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of B sequences as stored, packed sequence after sequence: (sum(seq_lens), Hkv, D)
    each in `dtype`; block_tables (B, max_blocks), seq_lens (B,). int8 values come out as
    q * scale computed in float32, rounded once to `dtype`."""
    _check_cache(k_cache, k_scale)
    _check_cache(v_cache, v_scale)
    block_size, hkv, d = k_cache.shape[1:]
    ks, vs = [], []
    for i, n in enumerate(seq_lens.tolist()):
        blocks = block_tables[i, : (n + block_size - 1) // block_size].long()
        ks.append(_gather_kv(k_cache, k_scale, blocks)[:n].to(dtype))
        vs.append(_gather_kv(v_cache, v_scale, blocks)[:n].to(dtype))
    empty = k_cache.new_empty(0, hkv, d, dtype=dtype)
    return (torch.cat(ks), torch.cat(vs)) if ks else (empty, empty.clone())


def _attend_sequence(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    block_table: torch.Tensor,
    seq_len: int,
    softmax_scale: float,
    k_new: torch.Tensor | None = None,
    v_new: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Causal attention of one sequence's last q_len tokens over its cached K/V.

    q (q_len, Hq, D); block_table (max_blocks,) -> (q_len, Hq, D) float32. k_new, v_new
    (q_len, Hkv, D): the new tokens' own K/V, used as they are instead of the cache's copies.
    """
    q_len, hq, _ = q.shape
    block_size, hkv = k_cache.shape[1], k_cache.shape[2]
    group = hq // hkv
    assert 1 <= q_len <= seq_len, f"q_len {q_len} must be in [1, seq_len {seq_len}]"
    cached = seq_len - q_len if k_new is not None else seq_len  # tokens read from the cache
    blocks = block_table[: (cached + block_size - 1) // block_size].long()
    k = _gather_kv(k_cache, k_scale, blocks)[:cached]  # (S, Hkv, D)
    v = _gather_kv(v_cache, v_scale, blocks)[:cached]  # (S, Hkv, D)
    if k_new is not None:
        k, v = torch.cat((k, k_new.float())), torch.cat((v, v_new.float()))

    # SDPA's fused CPU kernel never materializes the (Hq, L, S) scores; with enable_gqa query
    # head h reads kv head h // group.
    query_pos = torch.arange(seq_len - q_len, seq_len, device=q.device).unsqueeze(1)  # (L, 1)
    key_pos = torch.arange(seq_len, device=q.device).unsqueeze(0)  # (1, S)
    visible = key_pos <= query_pos  # (L, S)
    if window is not None:
        visible &= key_pos > query_pos - window
    out = F.scaled_dot_product_attention(
        q.float().transpose(0, 1).unsqueeze(0),  # (1, Hq, L, D)
        k.transpose(0, 1).unsqueeze(0),  # (1, Hkv, S, D)
        v.transpose(0, 1).unsqueeze(0),
        attn_mask=visible, scale=softmax_scale, enable_gqa=group > 1,
    )  # (1, Hq, L, D)
    return out.squeeze(0).transpose(0, 1)  # (L, Hq, D)


def paged_attention_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    softmax_scale: float,
    k_new: torch.Tensor | None = None,
    v_new: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """One query per sequence (decode), batched: q (B, Hq, D); block_tables (B, max_blocks);
    seq_lens (B,) -> (B, Hq, D) in q.dtype. k_new, v_new (B, Hkv, D): the K/V of the query's own
    token (position seq_len - 1), used as they are instead of the cache's copy. window: the query
    sees only its last `window` keys (sliding-window attention), None = all.

    Gathers every sequence's blocks padded to the longest one, masks positions >= seq_len.
    """
    _check_cache(k_cache, k_scale)
    _check_cache(v_cache, v_scale)
    b, hq, d = q.shape
    block_size, hkv = k_cache.shape[1], k_cache.shape[2]
    assert hq % hkv == 0 and k_cache.shape[3] == d
    assert block_tables.shape[0] == b and seq_lens.shape == (b,)
    group = hq // hkv
    max_len = int(seq_lens.max())
    n = (max_len + block_size - 1) // block_size
    # Padding entries (e.g. -1) past a sequence's blocks only feed masked positions; clamp them to
    # a valid id so the gather stays in bounds.
    blocks = block_tables[:, :n].long().clamp_min(0)  # (B, n)
    s_len = n * block_size

    flat_blocks = blocks.reshape(-1)  # (B * n,)

    def gather(cache: torch.Tensor, scale: torch.Tensor | None):
        # One index_select per cache, then one pass that both converts to float32 and lays the
        # values out head-major (B, Hkv, S, D), so the two batched matmuls below read them without
        # another copy (an einsum over the (B, S, Hkv, D) gather permuted K and V again: slower on
        # the CPU). An int8 cache's scales stay apart, (B, Hkv, 1, S), folded into the
        # scores and the probabilities: cheaper than multiplying every element.
        vals = cache.view(cache.shape[0], -1).index_select(0, flat_blocks).view(b, s_len, hkv, d)
        vals = vals.permute(0, 2, 1, 3).to(torch.float32, memory_format=torch.contiguous_format)
        if scale is None:
            return vals, None
        s = scale.view(scale.shape[0], -1).index_select(0, flat_blocks).view(b, n, hkv, block_size).float()
        return vals, s.permute(0, 2, 1, 3).reshape(b, hkv, 1, s_len)

    k, k_s = gather(k_cache, k_scale)  # (B, Hkv, S, D)
    v, v_s = gather(v_cache, v_scale)
    if k_new is not None:  # the own token: exact values, scale 1
        rows, last = torch.arange(b, device=q.device), seq_lens.long() - 1
        k[rows, :, last] = k_new.float()
        v[rows, :, last] = v_new.float()
        if k_s is not None:
            k_s[rows, :, 0, last] = 1.0
            v_s[rows, :, 0, last] = 1.0
    qf = q.float().view(b, hkv, group, d)  # (B, Hkv, G, D)
    scores = torch.matmul(qf, k.transpose(-1, -2))  # (B, Hkv, G, S)
    scores *= softmax_scale if k_s is None else k_s * softmax_scale
    positions = torch.arange(s_len, device=q.device)  # (S,)
    pad = positions.unsqueeze(0) >= seq_lens.long().unsqueeze(1)  # (B, S), True = masked
    if window is not None:
        pad |= positions.unsqueeze(0) < (seq_lens.long() - window).unsqueeze(1)
    scores.masked_fill_(pad[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if v_s is not None:
        probs *= v_s
    out = torch.matmul(probs, v)  # (B, Hkv, G, D)
    return out.reshape(b, hq, d).to(q.dtype)


def paged_attention(
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
    max_query_len: int | None = None,
    k_new: torch.Tensor | None = None,
    v_new: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Causal attention of packed queries over the paged cache (see the module docstring).

    q (T, Hq, D); block_tables (B, max_blocks) int32, padded with anything past the used blocks;
    seq_lens (B,) int32, cached tokens including the new ones; query_start_loc (B+1,) int32,
    cumulative. GQA: query head h reads kv head h // (Hq // Hkv). Returns (T, Hq, D) in q.dtype,
    computed in float32. k_new, v_new (T, Hkv, D): the new tokens' K/V (what was just written);
    when given, the new tokens attend to these exact values and only to the cache for the tokens
    before them (an int8 cache's rounding then touches only earlier steps' tokens). window:
    sliding-window attention, each query seeing only its last `window` keys; None = all.

    Sequences with one query (decode) go through the batched `paged_attention_decode`; the others
    loop, one gather per sequence.
    """
    _check_cache(k_cache, k_scale)
    _check_cache(v_cache, v_scale)
    t, hq, d = q.shape
    hkv = k_cache.shape[2]
    assert hq % hkv == 0, f"Hq {hq} must be a multiple of Hkv {hkv}"
    assert k_cache.shape[3] == d and v_cache.shape == k_cache.shape
    b = seq_lens.shape[0]
    assert query_start_loc.shape == (b + 1,) and block_tables.shape[0] == b

    q_lens = query_start_loc[1:] - query_start_loc[:-1]  # (B,)
    if max_query_len is None:
        max_query_len = int(q_lens.max()) if b else 0
    if max_query_len == 1 and t == b:
        return paged_attention_decode(q, k_cache, v_cache, k_scale, v_scale, block_tables,
                                      seq_lens, softmax_scale, k_new, v_new, window)

    out = torch.empty(t, hq, d, dtype=q.dtype, device=q.device)
    decode = (q_lens == 1).nonzero().squeeze(1)  # (B_decode,)
    if decode.numel():
        rows = query_start_loc[decode].long()
        out[rows] = paged_attention_decode(q[rows], k_cache, v_cache, k_scale, v_scale,
                                           block_tables[decode], seq_lens[decode], softmax_scale,
                                           None if k_new is None else k_new[rows],
                                           None if v_new is None else v_new[rows], window)
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    for i in (q_lens > 1).nonzero().squeeze(1).tolist():
        lo, hi = starts[i], starts[i + 1]
        out[lo:hi] = _attend_sequence(q[lo:hi], k_cache, v_cache, k_scale, v_scale,
                                      block_tables[i], lens[i], softmax_scale,
                                      None if k_new is None else k_new[lo:hi],
                                      None if v_new is None else v_new[lo:hi], window)
    return out


# ---- structured output: token masks ------------------------------------------------------------

def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Forbids tokens in place: logits[rows[s], v] = -inf where bit v of bitmask[s] is 0; returns
    logits.

    logits (B, V) float with a unit stride along V; bitmask (S, W) int32 with W = ceil(V / 32):
    token v is bit v % 32 of word v // 32 (llguidance's layout; the bits past V are ignored);
    rows (S,) int32/int64: which row of logits each mask constrains (distinct). Rows of logits
    that no mask names are left as they are.
    """
    assert logits.dim() == 2 and bitmask.dim() == 2 and rows.dim() == 1, \
        f"logits (B, V), bitmask (S, W), rows (S,); got {tuple(logits.shape)}, {tuple(bitmask.shape)}, {tuple(rows.shape)}"
    vocab = logits.shape[1]
    num_masks, words = bitmask.shape
    assert bitmask.dtype == torch.int32, f"bitmask must be int32, got {bitmask.dtype}"
    assert words == -(-vocab // 32), f"bitmask has {words} words per row; V = {vocab} needs {-(-vocab // 32)}"
    assert rows.shape[0] == num_masks, f"{rows.shape[0]} rows for {num_masks} masks"
    if num_masks == 0:
        return logits
    # Bit v of a row is bit v % 8 of its byte v // 8 in memory (the int32 words are little-endian):
    # shifting bytes is a quarter of the work of shifting words by 0..31.
    assert sys.byteorder == "little", "the mask's bytes are read as little-endian words"
    shifts = torch.arange(8, device=bitmask.device, dtype=torch.uint8)
    bits = (bitmask.contiguous().view(torch.uint8).unsqueeze(-1) >> shifts) & 1  # (S, 4W, 8)
    forbidden = (bits.view(num_masks, words * 32)[:, :vocab] == 0).to(logits.device)  # (S, V)
    index = rows.to(device=logits.device, dtype=torch.int64)
    masked = logits.index_select(0, index).masked_fill_(forbidden, float("-inf"))
    return logits.index_copy_(0, index, masked)
