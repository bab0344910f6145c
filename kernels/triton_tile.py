"""The tile code the decode and extend kernels share: where a tile of paged keys lives, masked
loads, and the online-softmax update of one tile of keys, in three steps so that a kernel loads V
only after the scores (V held in registers across the softmax cost a fifth of the time at D 128).

Both kernels hold a block of BLOCK_M query rows (decode: the G query heads of one kv head; extend:
BLOCK_Q tokens x G heads) and walk the keys in tiles of BLOCK_N:

    s = q' K^T                      q' = q * softmax_scale * log2(e), so exp2 is the softmax's exp
    int8 pages:  s *= k_scale[n]    (K cast to the dot dtype as is: |x| <= 127 is exact in bf16/fp16)
    m' = max(m, rowmax(s)); p = 2^(s - m'); l = l 2^(m - m') + rowsum(p)
    acc = acc 2^(m - m') + p V      int8 pages: p * v_scale[n] feeds the dot, l sums the unscaled p

Head dims that are not a power of two run padded to D_PAD (the padding lanes load 0: they add
nothing to any dot). Scales are fp16, one per (token, kv head). int8_scores / int8_pv hold the
cheaper int8 paths both kernels use on the GPU (K on int8 tensor cores or read as 1152 + K, V
read as 1152 + V, the offsets taken off per row); tile_scores / accumulate_pv the plain casts.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def int8_to_f16(x):
    """int8 -> fp16 with integer ops, 4 values per 32-bit register: byte b + 128 (xor 0x80) under
    the fp16 exponent of 1024 (high byte 0x64) reads as 1152 + b; subtracting 1152 gives b exactly.

    Not pure on purpose: Triton would otherwise move this conversion past the shared-memory copy
    that feeds tl.dot, where int8 V (D-contiguous, reduced over tokens) is read byte by byte; here
    V goes to shared memory as fp16 and comes back with ldmatrix.trans."""
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 u, m;
        xor.b32 u, $2, 0x80808080;
        mov.b32 m, 0x64806480;
        prmt.b32 $0, u, 0x64646464, 0x4140;
        prmt.b32 $1, u, 0x64646464, 0x4342;
        sub.f16x2 $0, $0, m;
        sub.f16x2 $1, $1, m;
        }""",
        constraints="=r,=r,r", args=[x], dtype=tl.float16, is_pure=False, pack=4)


INT8_BIAS = tl.constexpr(1152.0)  # int8 x is read as the fp16 number 1152 + x (exact: 1025..1279 are integers in fp16)


@triton.jit
def int8_biased(x, DTYPE: tl.constexpr, ASM: tl.constexpr, PURE: tl.constexpr):
    """int8 -> DTYPE holding 1152 + x, exactly; the caller subtracts 1152 * (sum of the other dot
    operand), once per row, so the per-element subtraction of `int8_to_f16` is gone: 3 integer
    instructions per 4 values (xor 0x80808080 maps x to the byte x + 128; prmt puts it under the
    fp16 exponent of 1024) instead of 5. ASM: that PTX (fp16 only, GPU only); else plain casts
    (the interpreter, and any DTYPE). PURE lets Triton apply the conversion where it likes, e.g.
    after loading K from shared memory in the dot-operand layout (K is contiguous along the dot's
    reduction, so that load is 32-bit wide); V (reduced along its rows) must convert before its
    fp16 shared-memory copy, so it is not pure."""
    if ASM:
        return tl.inline_asm_elementwise(
            asm="""{
            .reg .b32 u;
            xor.b32 u, $2, 0x80808080;
            prmt.b32 $0, u, 0x64646464, 0x4140;
            prmt.b32 $1, u, 0x64646464, 0x4342;
            }""",
            constraints="=r,=r,r", args=[x], dtype=tl.float16, is_pure=PURE, pack=4)
    else:
        return (x.to(tl.float32) + INT8_BIAS).to(DTYPE)


@triton.jit
def load(ptrs, mask, other, USE_MASK: tl.constexpr):
    """tl.load, masked only when USE_MASK (unmasked loads vectorize best)."""
    if USE_MASK:
        return tl.load(ptrs, mask=mask, other=other)
    else:
        return tl.load(ptrs)


@triton.jit
def paged_slots(bt_row, offs_n, key_ok, PAGE: tl.constexpr, MASKED: tl.constexpr):
    """Pages and in-page slots of the keys offs_n (BLOCK_N,) of one sequence: page ids from its
    block-table row (int64, 0 for masked keys) and offs_n % PAGE."""
    page = load(bt_row + offs_n // PAGE, key_ok, 0, MASKED).to(tl.int64)
    return page, offs_n % PAGE


@triton.jit
def tile_scores(q, k, ks_ptrs, key_ok, visible, K_TRANSPOSED: tl.constexpr, QUANT: tl.constexpr,
                MASKED: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr):
    """Scores of one tile, (BLOCK_M, BLOCK_N) fp32 in log2 units: q (BLOCK_M, D_PAD) pre-scaled by
    softmax_scale * log2(e), in DOT_DTYPE; k (D_PAD, BLOCK_N) when K_TRANSPOSED else
    (BLOCK_N, D_PAD); int8 pages (QUANT): the keys' fp16 scales at ks_ptrs (BLOCK_N,), loaded
    after the dot (before it, they stayed live across it: register pressure at 255 registers);
    keys not `visible` (a mask broadcastable to the tile, used when MASKED) get -inf."""
    if K_TRANSPOSED:
        s = tl.dot(q, k.to(DOT_DTYPE), input_precision=PRECISION)
    else:
        s = tl.dot(q, tl.trans(k.to(DOT_DTYPE)), input_precision=PRECISION)
    if QUANT:
        s = s * load(ks_ptrs, key_ok, 0.0, MASKED).to(tl.float32)[None, :]
    if MASKED:
        s = tl.where(visible, s, float("-inf"))
    return s


@triton.jit
def int8_query(qf):
    """q (BLOCK_M, D_PAD) fp32, pre-scaled, in the two int8 terms int8_scores' tensor-core modes read:
    (q1, q2, qa, qa2) with q ~ qa * q1 + qa2 * q2 per row; qa = rowmax|q| / 127 puts q1 in [-127, 127],
    the remainder is at most qa / 2, so its step qa2 = qa / 254 puts q2 there too."""
    qa = tl.maximum(tl.max(tl.abs(qf), axis=1), 1e-30) / 127.0
    q1f = tl.floor(qf / qa[:, None] + 0.5)
    qa2 = qa / 254.0
    q2 = tl.floor((qf - q1f * qa[:, None]) / qa2[:, None] + 0.5).to(tl.int8)
    return q1f.to(tl.int8), q2, qa, qa2


@triton.jit
def int8_scores(q, q2, qa, qa2, kt, K_MODE: tl.constexpr, QK_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
                 ASM: tl.constexpr):
    """q K^T of one tile over int8 keys kt (D_PAD, BLOCK_N) (a view), before the keys' scales (K_MODE):
    0 K cast to QK_DTYPE; 1 K read as 1152 + K (int8_biased) and qa = 1152 * rowsum(q) taken off;
    2 int8 tensor cores, q = qa * q + qa2 * q2 in two int8 terms; 3 the same with one term."""
    if K_MODE == 1:
        return tl.dot(q, int8_biased(kt, QK_DTYPE, ASM, True), input_precision=PRECISION) - qa[:, None]
    elif K_MODE == 2:
        s = tl.dot(q, kt, out_dtype=tl.int32).to(tl.float32) * qa[:, None]
        return s + tl.dot(q2, kt, out_dtype=tl.int32).to(tl.float32) * qa2[:, None]
    elif K_MODE == 3:
        return tl.dot(q, kt, out_dtype=tl.int32).to(tl.float32) * qa[:, None]
    else:
        return tl.dot(q, kt.to(QK_DTYPE), input_precision=PRECISION)


@triton.jit
def int8_pv(p, v, v_s, V_MODE: tl.constexpr, PV_DTYPE: tl.constexpr, PRECISION: tl.constexpr, ASM: tl.constexpr,
            ROW_NORM: tl.constexpr):
    """P V of one tile over int8 values v (BLOCK_N, D_PAD) with scales v_s (BLOCK_N,) fp32 (V_MODE):
    0 P * v_s and V cast to PV_DTYPE; 1 V to fp16 by `int8_to_f16`; 2 V read as 1152 + V
    (int8_biased) and 1152 * rowsum(P) taken off. 1 and 2 feed P * v_s / c in [0, 1] to the fp16
    dot (no underflow for small scales) and put c back after: c = max(v_s) over the tile, or with
    ROW_NORM the row's max of P * v_s, which does not depend on which invisible keys the tile
    loaded (masked to 0 or not): a query's output then does not depend on its chunk (extend)."""
    if V_MODE == 0:
        return tl.dot((p * v_s[None, :]).to(PV_DTYPE), v.to(PV_DTYPE), input_precision=PRECISION)
    if ROW_NORM:
        pw = p * v_s[None, :]
        c = tl.maximum(tl.max(pw, axis=1), 1e-30)  # (BLOCK_M,)
        p16 = (pw / c[:, None]).to(PV_DTYPE)
    else:
        vs_max = tl.maximum(tl.max(v_s, axis=0), 1e-30)
        p16 = (p * (v_s / vs_max)[None, :]).to(PV_DTYPE)
    if V_MODE == 1:
        pv = tl.dot(p16, int8_to_f16(v), input_precision=PRECISION)
    else:
        pv = tl.dot(p16, int8_biased(v, PV_DTYPE, ASM, False), input_precision=PRECISION)
        pv -= INT8_BIAS * tl.sum(p16.to(tl.float32), axis=1)[:, None]
    if ROW_NORM:
        pv = pv * c[:, None]
    else:
        pv = pv * vs_max
    return pv


@triton.jit
def online_softmax(s, m_i, l_i, GUARD: tl.constexpr):
    """The running max and sum after tile scores s: returns (p, alpha, m_new, l_new), p = 2^(s - m_new)
    and alpha = 2^(m_i - m_new) the factor for what was accumulated before. GUARD: a row may have
    seen no visible key yet (m = -inf: a sliding window's first tile), which then gets p = 0
    instead of 2^(-inf + inf) = NaN; without a window every row sees a key in its first tile."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    if GUARD:
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_sub = m_new
    alpha = tl.exp2(m_i - m_sub)
    p = tl.exp2(s - m_sub[:, None])
    return p, alpha, m_new, l_i * alpha + tl.sum(p, axis=1)


@triton.jit
def accumulate_pv(acc, alpha, p, v, v_s, QUANT: tl.constexpr, V_ASM: tl.constexpr, DOT_DTYPE: tl.constexpr,
                  PRECISION: tl.constexpr):
    """acc * alpha + P V for one tile: v (BLOCK_N, D_PAD); int8 pages scale P by v_s (BLOCK_N,) fp32
    (the softmax sum keeps the unscaled P). V_ASM (int8 V, GPU only): V goes int8 -> fp16 by
    `int8_to_f16` and P @ V runs in fp16, with p * v_s / max(v_s) in [0, 1] (no fp16 underflow for
    small scales) and max(v_s) put back after."""
    acc = acc * alpha[:, None]
    if QUANT:
        if V_ASM:
            vs_max = tl.maximum(tl.max(v_s, axis=0), 1e-30)
            p = p * (v_s / vs_max)[None, :]
            acc += tl.dot(p.to(tl.float16), int8_to_f16(v)) * vs_max
        else:
            p = p * v_s[None, :]
            acc += tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision=PRECISION)
    else:
        acc += tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision=PRECISION)
    return acc


def dot_types(q_dtype, on_gpu: bool):
    """(DOT_DTYPE, PRECISION) for a query dtype: 16-bit dots on the GPU; fp32 on the CPU
    interpreter (its bf16 arithmetic is wrong) and for fp32 queries, with IEEE precision."""
    import torch

    if on_gpu and q_dtype == torch.bfloat16:
        return tl.bfloat16, None
    if q_dtype == torch.float16:
        return tl.float16, None
    return tl.float32, "ieee"


def pad_head_dim(d: int) -> int:
    """The padded tile width of head dim d (a power of two >= 16)."""
    return max(16, next_pow2(d))


# Host arithmetic for the launch wrappers. triton.cdiv and triton.next_power_of_2 are constexpr
# functions in triton 3.7: each host call unwraps its arguments, and the attention wrappers of an
# eager step make several per layer.
def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for ints, b > 0."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two >= n, for n >= 1."""
    return 1 << (n - 1).bit_length()
