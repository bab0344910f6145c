"""Fused Triton kernels for the elementwise work around the matmuls of a decoder layer.

In eager torch a decode step of a small model is dominated by launches, not by bytes: RMSNorm is
four kernels (cast, statistics, cast back, weight multiply), rotate-half RoPE five (two products,
negate, cat, add), SwiGLU's silu(gate) * up two, plus one per residual add. Each of those reads
and writes a few KB. Here each is one kernel:

- `rms_norm`: optional residual add and RMSNorm in one pass over a row (one program per token).
- `silu_mul`: silu(gate) * up straight from the fused gate_up projection output.
- `rotary_`: rotate-half RoPE of the q and k heads, in place in the qkv projection output.

They reproduce the eager ops' roundings, not just their math: every value torch rounds to the
activation dtype (bf16/fp16) is rounded here too, and products of two such values are formed in
fp32, where they are exact, then rounded once, as torch does. So `rotary_` and the residual sum
match torch bit for bit (the rotary launch turns fma contraction off: it would skip the rounding
of one product), and `rms_norm` and `silu_mul` agree to within one ulp of the dtype in the fp32
intermediate (normalized value, silu) that is cast before the final product: reduction order and
the exp/rsqrt approximations differ in the last fp32 bits.

No kernel syncs with the host or allocates from values, so all of them can be captured in a CUDA
graph. Shapes that vary per step (the token count) are only grid sizes, never kernel arguments,
so a model compiles each kernel once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_HIDDEN = 16384  # rms_norm keeps a whole row in registers


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def _num_warps(block: int) -> int:
    """About 8 elements per thread, 1 to 16 warps."""
    return max(1, min(16, block // 256))


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, res_ptr, out_ptr, eps,
                     H: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64) * H
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    x = tl.load(x_ptr + row + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)  # torch's x + residual
        tl.store(res_ptr + row + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(xf * xf, axis=0) / H + eps)
    normed = (xf * rstd).to(x.dtype)  # F.rms_norm(x.float()).to(dtype)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    out = normed.to(tl.float32) * w.to(tl.float32)  # exact for bf16/fp16 operands
    tl.store(out_ptr + row + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None,
             out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """weight * rms_norm(x), optionally of x + residual; returns (out, residual_out).

    x (T, H) contiguous bf16/fp16/fp32, H <= MAX_HIDDEN; weight (H,) and residual (T, H) of x's
    dtype. Without residual, residual_out is x itself. With it, s = x + residual (rounded to the
    dtype) is written in place into `residual`, which is returned as residual_out, and the norm
    is taken of s: the pre-norm block's `h = h + f(h); y = norm(h)` in one kernel. out (T, H) is
    allocated unless given (contiguous, x's dtype; it may be x itself).
    """
    _check(x.dim() == 2, f"x must be (T, H), got shape {tuple(x.shape)}")
    t, h = x.shape
    _check(x.dtype in DTYPES, f"x must be bf16, fp16 or fp32, got {x.dtype}")
    _check(x.is_contiguous(), "x must be contiguous")
    _check(0 < h <= MAX_HIDDEN, f"H must be in 1..{MAX_HIDDEN}, got {h}")
    _check(weight.shape == (h,), f"weight must be ({h},), got {tuple(weight.shape)}")
    _check(weight.is_contiguous(), "weight must be contiguous")
    others = {"weight": weight}
    if residual is not None:
        _check(residual.shape == x.shape,
               f"residual must be {tuple(x.shape)}, got {tuple(residual.shape)}")
        _check(residual.is_contiguous(), "residual must be contiguous")
        others["residual"] = residual
    if out is None:
        out = torch.empty_like(x)
    else:
        _check(out.shape == x.shape, f"out must be {tuple(x.shape)}, got {tuple(out.shape)}")
        _check(out.is_contiguous(), "out must be contiguous")
        others["out"] = out
    for name, other in others.items():
        _check(other.dtype == x.dtype, f"{name} must be {x.dtype}, got {other.dtype}")
        _check(other.device == x.device, f"{name} is on {other.device}, x on {x.device}")
    residual_out = x if residual is None else residual
    if t == 0:
        return out, residual_out
    block = triton.next_power_of_2(h)
    _rms_norm_kernel[(t,)](
        x, weight, x if residual is None else residual, out, eps,
        H=h, BLOCK=block, HAS_RESIDUAL=residual is not None, num_warps=_num_warps(block))
    return out, residual_out


@triton.jit
def _silu_mul_kernel(gate_up_ptr, out_ptr, I: tl.constexpr, BLOCK: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    gate_ptr = gate_up_ptr + token * (2 * I) + cols
    gate = tl.load(gate_ptr, mask=mask, other=0.0)
    up = tl.load(gate_ptr + I, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype)  # F.silu: fp32 math, one rounding
    out = silu.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + token * I + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """silu(gate) * up for gate_up = cat(gate, up) along the last dim.

    gate_up (T, 2I) contiguous bf16/fp16/fp32 -> out (T, I) in its dtype; out is allocated unless
    given (contiguous, gate_up's dtype and device).
    """
    _check(gate_up.dim() == 2, f"gate_up must be (T, 2I), got shape {tuple(gate_up.shape)}")
    t, two_i = gate_up.shape
    _check(two_i > 0 and two_i % 2 == 0, f"gate_up's last dim must be even, got {two_i}")
    _check(gate_up.dtype in DTYPES, f"gate_up must be bf16, fp16 or fp32, got {gate_up.dtype}")
    _check(gate_up.is_contiguous(), "gate_up must be contiguous")
    i = two_i // 2
    if out is None:
        out = gate_up.new_empty((t, i))
    else:
        _check(out.shape == (t, i), f"out must be {(t, i)}, got {tuple(out.shape)}")
        _check(out.dtype == gate_up.dtype, f"out must be {gate_up.dtype}, got {out.dtype}")
        _check(out.device == gate_up.device, f"out is on {out.device}, gate_up on {gate_up.device}")
        _check(out.is_contiguous(), "out must be contiguous")
    if t == 0:
        return out
    block = min(triton.next_power_of_2(i), 1024)
    _silu_mul_kernel[(t, triton.cdiv(i, block))](
        gate_up, out, I=i, BLOCK=block, num_warps=_num_warps(block))
    return out


@triton.jit
def _rotary_kernel(qk_ptr, cos_ptr, sin_ptr, stride_t, stride_h, stride_cos, stride_sin,
                   H: tl.constexpr, H_PAD: tl.constexpr, HALF: tl.constexpr,
                   HALF_PAD: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, H_PAD)
    dims = tl.arange(0, HALF_PAD)
    dim_ok = dims < HALF
    mask = (heads < H)[:, None] & dim_ok[None, :]
    # The halves of cos/sin are equal: read the first only.
    cos = tl.load(cos_ptr + token * stride_cos + dims, mask=dim_ok, other=0.0)[None, :]
    sin = tl.load(sin_ptr + token * stride_sin + dims, mask=dim_ok, other=0.0)[None, :]
    x1_ptr = qk_ptr + token * stride_t + heads[:, None].to(tl.int64) * stride_h + dims[None, :]
    x1 = tl.load(x1_ptr, mask=mask, other=0.0)
    x2 = tl.load(x1_ptr + HALF, mask=mask, other=0.0)
    dtype = x1.dtype
    # torch rounds every product to the dtype, then the sum: x * cos + cat(-x2, x1) * sin.
    x1c = (x1.to(tl.float32) * cos.to(tl.float32)).to(dtype).to(tl.float32)
    x1s = (x1.to(tl.float32) * sin.to(tl.float32)).to(dtype).to(tl.float32)
    x2c = (x2.to(tl.float32) * cos.to(tl.float32)).to(dtype).to(tl.float32)
    x2s = (x2.to(tl.float32) * sin.to(tl.float32)).to(dtype).to(tl.float32)
    tl.store(x1_ptr, (x1c - x2s).to(dtype), mask=mask)
    tl.store(x1_ptr + HALF, (x2c + x1s).to(dtype), mask=mask)


def rotary_(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half (neox) RoPE of every head, in place; returns qk.

    qk (T, H, D) bf16/fp16/fp32 with unit stride along D and any token/head strides (H = Hq + Hkv
    heads sliced from the qkv projection output); cos, sin (T, 1, D) or (T, D) of qk's dtype with
    unit stride along D, each half of D repeated, as `model.rope.RotaryEmbedding.lookup` returns.
    For i < D/2: x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin, where x1, x2 are the two halves.
    """
    _check(qk.dim() == 3, f"qk must be (T, H, D), got shape {tuple(qk.shape)}")
    t, h, d = qk.shape
    _check(qk.dtype in DTYPES, f"qk must be bf16, fp16 or fp32, got {qk.dtype}")
    _check(d > 0 and d % 2 == 0, f"head_dim must be even, got {d}")
    _check(qk.stride(2) == 1, f"qk needs a unit stride along D, got strides {qk.stride()}")
    for name, table in (("cos", cos), ("sin", sin)):
        _check(table.shape in ((t, 1, d), (t, d)),
               f"{name} must be {(t, 1, d)} or {(t, d)}, got {tuple(table.shape)}")
        _check(table.dtype == qk.dtype, f"{name} must be {qk.dtype}, got {table.dtype}")
        _check(table.device == qk.device, f"{name} is on {table.device}, qk on {qk.device}")
        _check(table.stride(-1) == 1, f"{name} needs a unit stride along D")
    if t == 0 or h == 0:
        return qk
    half = d // 2
    h_pad, half_pad = triton.next_power_of_2(h), triton.next_power_of_2(half)
    _rotary_kernel[(t,)](
        qk, cos, sin, qk.stride(0), qk.stride(1), cos.stride(0), sin.stride(0),
        H=h, H_PAD=h_pad, HALF=half, HALF_PAD=half_pad, num_warps=_num_warps(h_pad * half_pad),
        # Otherwise LLVM turns x1 * cos - rnd(x2 * sin) into one fma, skipping a rounding.
        enable_fp_fusion=False)
    return qk
