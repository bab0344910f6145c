"""The fused Triton kernels (RMSNorm with residual add, SiLU*mul, rotary) against the eager torch
ops they replace, with the same roundings.

rotary_ and the residual sum must match torch exactly. rms_norm and silu_mul cast an fp32
intermediate (the normalized value, silu(gate)) to the dtype before the final product; its last
fp32 bits depend on reduction order and exp/rsqrt, so the kernel may round it one ulp the other
way: the check is that out == rnd(factor * m) for some m within `ulps` of torch's intermediate.

Runs in Triton's CPU interpreter (fp32, fp16; small shapes) when there is no GPU. Fresh random
inputs every case, drawn from the `gen` fixture (tests/kernels/conftest.py); outputs poisoned with
NaN before the kernel writes them.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any @triton.jit runs

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from pie.kernels.triton_fused import rms_norm, rotary_, silu_mul  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CPU_DTYPES = [torch.float32, torch.float16]  # the interpreter computes bf16 wrongly
# How far the kernel's intermediate may be from torch's, in ulps of the dtype. In fp32 that is the
# error of the GPU's exp (ex2.approx of g * log2(e): ~|g| ulps) and division, not a rounding flip.
INTERMEDIATE_ULPS = {torch.float32: 64, torch.float16: 1, torch.bfloat16: 1}


def _bits(dtype: torch.dtype) -> tuple[torch.dtype, int]:
    return (torch.int32, 32) if dtype == torch.float32 else (torch.int16, 16)


def ordered(t: torch.Tensor) -> torch.Tensor:
    """Float bits as int64 that count ulps monotonically across zero (-0 and +0 both 0)."""
    int_dtype, n = _bits(t.dtype)
    bits = t.view(int_dtype).long()
    return torch.where(bits < 0, -(bits & ((1 << (n - 1)) - 1)), bits)


def step(t: torch.Tensor, ulps: int) -> torch.Tensor:
    """t moved by `ulps` units in the last place of its dtype (negative: towards -inf)."""
    int_dtype, n = _bits(t.dtype)
    o = ordered(t) + ulps
    bits = torch.where(o < 0, -o - (1 << (n - 1)), o)
    return bits.to(int_dtype).view(t.dtype)


def assert_rounded_product(got: torch.Tensor, factor: torch.Tensor, approx: torch.Tensor,
                           ulps: int) -> None:
    """got == factor * m (in the dtype, torch's rounding) for an m within `ulps` of approx; the
    product is monotonic in m, so got must lie between its values at the two ends. In bf16/fp16
    such flips are rare (<1e-3): nearly all elements must equal torch's result exactly, which
    also catches a missing rounding of the intermediate (it would stay inside the bracket)."""
    assert got.shape == approx.shape and got.dtype == approx.dtype
    assert not got.isnan().any(), "NaN in the output: an element was not written"
    a, b = factor * step(approx, -ulps), factor * step(approx, ulps)
    ok = (got >= torch.minimum(a, b)) & (got <= torch.maximum(a, b))
    inexact = int((got != factor * approx).sum())
    assert bool(ok.all()), f"{int((~ok).sum())} of {ok.numel()} outside +-{ulps} ulps"
    if got.dtype != torch.float32:
        assert inexact <= 2 + got.numel() // 100, f"{inexact} of {got.numel()} not exact"


def assert_equal(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype
    diff = got != want
    ulps = int((ordered(got) - ordered(want)).abs().max()) if diff.any() else 0
    assert not bool(diff.any()), f"{int(diff.sum())} of {diff.numel()} differ, max {ulps} ulps"


def nan_like(t: torch.Tensor, shape=None) -> torch.Tensor:
    return torch.full(shape or t.shape, float("nan"), dtype=t.dtype, device=t.device)


# --- rms_norm ---------------------------------------------------------------------------------


def check_rms_norm(t: int, h: int, dtype: torch.dtype, with_residual: bool, gen: torch.Generator) -> None:
    eps = 1e-5
    x = (torch.randn(t, h, generator=gen).to(DEVICE) * 2).to(dtype)
    weight = (torch.randn(h, generator=gen).to(DEVICE) * 0.5 + 1).to(dtype)
    residual = (torch.randn(t, h, generator=gen).to(DEVICE) * 3).to(dtype) if with_residual else None
    s = x + residual if with_residual else x  # torch's rounding of the residual add
    normed = F.rms_norm(s.float(), (h,), eps=eps).to(dtype)
    x_before = x.clone()

    out = nan_like(x)
    got, res_out = rms_norm(x, weight, eps, residual=residual, out=out)
    assert got is out
    assert_rounded_product(got, weight, normed, INTERMEDIATE_ULPS[dtype])
    assert_equal(x, x_before)  # the input is read only
    if with_residual:
        assert res_out is residual  # written in place
        assert_equal(res_out, s)
    else:
        assert res_out is x

    # Without out=, a fresh tensor with the same values.
    got2, _ = rms_norm(x_before.clone(), weight, eps)
    if not with_residual:
        assert_equal(got2, got)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("t,h", [(1, 96), (5, 96), (3, 2048), (2, 1000)])
def test_rms_norm(t, h, dtype, with_residual, gen) -> None:
    check_rms_norm(t, h, dtype, with_residual, gen)


def test_rms_norm_empty(gen) -> None:
    x = torch.randn(0, 64, generator=gen).to(DEVICE)
    w = torch.randn(64, generator=gen).to(DEVICE)
    r = torch.randn(0, 64, generator=gen).to(DEVICE)
    out, res = rms_norm(x, w, 1e-6)
    assert out.shape == (0, 64) and res is x
    out, res = rms_norm(x, w, 1e-6, residual=r)
    assert out.shape == (0, 64) and res is r


def test_rms_norm_rejects_bad_inputs(gen) -> None:
    x = torch.randn(4, 64, generator=gen).to(DEVICE)
    w = torch.randn(64, generator=gen).to(DEVICE)
    bad = [
        dict(x=x[None], weight=w),  # 3-D
        dict(x=x.t(), weight=torch.randn(4, generator=gen).to(DEVICE)),  # not contiguous
        dict(x=x.long(), weight=w.long()),  # not float
        dict(x=x, weight=w[:32]),  # wrong weight size
        dict(x=x, weight=w.half()),  # weight dtype
        dict(x=x, weight=w, residual=torch.randn(3, 64, generator=gen).to(DEVICE)),
        dict(x=x, weight=w, residual=x.half()),
        dict(x=x, weight=w, out=torch.empty(4, 64, dtype=torch.half, device=DEVICE)),
    ]
    for kwargs in bad:
        with pytest.raises(ValueError):
            rms_norm(eps=1e-6, **kwargs)


# --- silu_mul ---------------------------------------------------------------------------------


def check_silu_mul(t: int, i: int, dtype: torch.dtype, gen: torch.Generator) -> None:
    gate_up = (torch.randn(t, 2 * i, generator=gen).to(DEVICE) * 4).to(dtype)
    gate, up = gate_up.split(i, dim=-1)
    silu = F.silu(gate)
    out = nan_like(gate_up, (t, i))
    got = silu_mul(gate_up, out=out)
    assert got is out
    assert_rounded_product(got, up, silu, INTERMEDIATE_ULPS[dtype])
    assert_equal(silu_mul(gate_up), got)  # allocating variant


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("t,i", [(1, 96), (5, 96), (3, 1500), (1, 2048)])
def test_silu_mul(t, i, dtype, gen) -> None:
    check_silu_mul(t, i, dtype, gen)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # numpy, in the interpreter
def test_silu_mul_extremes() -> None:
    """Large |gate|: exp(-gate) overflows to inf for very negative gates, silu -> -0, no NaN."""
    gate = torch.tensor([[-200.0, -90.0, -20.0, 0.0, 20.0, 90.0, 200.0, -1e-30]], device=DEVICE)
    up = torch.full_like(gate, 3.0)
    got = silu_mul(torch.cat([gate, up], dim=-1))
    assert_rounded_product(got, up, F.silu(gate), INTERMEDIATE_ULPS[torch.float32])
    assert got[0, :2].tolist() == [0.0, 0.0] and got[0, 6].item() == 600.0


def test_silu_mul_empty_and_bad_inputs(gen) -> None:
    assert silu_mul(torch.randn(0, 64, generator=gen).to(DEVICE)).shape == (0, 32)
    gate_up = torch.randn(4, 64, generator=gen).to(DEVICE)
    for args, kwargs in [
        ((torch.randn(4, 63, generator=gen).to(DEVICE),), {}),  # odd width
        ((gate_up[None],), {}),  # 3-D
        ((gate_up.t(),), {}),  # not contiguous
        ((gate_up.long(),), {}),
        ((gate_up,), dict(out=torch.empty(4, 64, device=DEVICE))),  # out shape
        ((gate_up,), dict(out=torch.empty(4, 32, dtype=torch.half, device=DEVICE))),
        ((gate_up,), dict(out=torch.empty(32, 4, device=DEVICE).t())),  # out not contiguous
    ]:
        with pytest.raises(ValueError):
            silu_mul(*args, **kwargs)


# --- rotary_ ----------------------------------------------------------------------------------


def rotary_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """model.rope.apply_rotary: x * cos + rotate_half(x) * sin."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def cos_sin(t: int, d: int, dtype: torch.dtype, flat: bool, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(T, 1, D) (or (T, D) if flat) tables with both halves equal, as RotaryEmbedding.lookup."""
    angles = torch.rand(t, d // 2, generator=gen).to(DEVICE) * 1000
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
    return (cos, sin) if flat else (cos[:, None, :], sin[:, None, :])


def check_rotary(t: int, hq: int, hkv: int, d: int, dtype: torch.dtype, flat: bool,
                 gen: torch.Generator) -> None:
    h = hq + hkv
    # qk is a view of a (T, N) qkv output with N = (Hq + 2 Hkv) D, plus a few spare columns so
    # that the row stride is no multiple of anything in particular.
    n = (hq + 2 * hkv) * d + 3
    qkv = (torch.randn(t, n, generator=gen).to(DEVICE) * 3).to(dtype)
    qk = qkv[:, : h * d].view(t, h, d)
    cos, sin = cos_sin(t, d, dtype, flat, gen)
    want = rotary_reference(qk, *((cos[:, None], sin[:, None]) if flat else (cos, sin)))
    rest = qkv[:, h * d:].clone()  # v and the spare columns

    # The kernel reads only the first half of cos/sin: poison the second.
    cos_p, sin_p = cos.clone(), sin.clone()
    cos_p[..., d // 2:] = float("nan")
    sin_p[..., d // 2:] = float("nan")
    got = rotary_(qk, cos_p, sin_p)
    assert got is qk
    assert_equal(qk, want)
    assert_equal(qkv[:, h * d:], rest)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("t", [1, 5])
@pytest.mark.parametrize("hq,hkv,d", [(4, 2, 64), (4, 2, 128), (3, 1, 96)])
def test_rotary(t, hq, hkv, d, dtype, gen) -> None:
    check_rotary(t, hq, hkv, d, dtype, flat=False, gen=gen)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_rotary_flat_tables_and_head_slices(dtype, gen) -> None:
    """(T, D) cos/sin; and k alone, a view with a head stride larger than D."""
    check_rotary(3, 4, 2, 64, dtype, flat=True, gen=gen)
    t, d = 3, 64
    buf = torch.randn(t, 2, 4, 2 * d, generator=gen).to(DEVICE, dtype)
    k = buf[:, 1, :, :d]  # (T, 4, D), strides (8D, 2D, 1)
    cos, sin = cos_sin(t, d, dtype, flat=False, gen=gen)
    want, before = rotary_reference(k, cos, sin), buf.clone()
    rotary_(k, cos, sin)
    assert_equal(k, want)
    before[:, 1, :, :d] = want
    assert_equal(buf, before)


def test_rotary_empty_and_bad_inputs(gen) -> None:
    qkv = torch.randn(0, 8 * 64, generator=gen).to(DEVICE)
    qk = qkv[:, : 6 * 64].view(0, 6, 64)
    cos, sin = cos_sin(0, 64, torch.float32, flat=False, gen=gen)
    assert rotary_(qk, cos, sin) is qk

    qk = torch.randn(4, 6, 64, generator=gen).to(DEVICE)
    cos, sin = cos_sin(4, 64, torch.float32, flat=False, gen=gen)
    for args in [
        (qk[0], cos, sin),  # 2-D
        (qk[..., :63], cos[..., :63], sin[..., :63]),  # odd head_dim
        (qk.transpose(1, 2), cos, sin),  # D not unit-stride
        (qk, cos[:3], sin[:3]),  # wrong T
        (qk, cos.half(), sin.half()),  # dtype
        (qk, cos[..., :32], sin[..., :32]),  # half tables
        (qk.long(), cos.long(), sin.long()),
    ]:
        with pytest.raises(ValueError):
            rotary_(*args)


# --- GPU: bf16 at a 1B model's sizes ----------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("t", [1, 7, 256])
def test_rms_norm_gpu(t, with_residual, gen) -> None:
    check_rms_norm(t, 2048, torch.bfloat16, with_residual, gen)
    check_rms_norm(t, 96, torch.bfloat16, with_residual, gen)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 7, 256])
def test_silu_mul_gpu(t, gen) -> None:
    check_silu_mul(t, 8192, torch.bfloat16, gen)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 7, 256])
def test_rotary_gpu(t, gen) -> None:
    check_rotary(t, 32, 8, 64, torch.bfloat16, flat=False, gen=gen)
    check_rotary(t, 32, 8, 128, torch.bfloat16, flat=True, gen=gen)


@pytest.mark.gpu
def test_cuda_graph_capture(gen) -> None:
    """All three kernels capture into a CUDA graph and replay on new inputs."""
    t, h, i, hq, hkv, d = 7, 2048, 8192, 32, 8, 64
    dtype = torch.bfloat16
    x = torch.randn(t, h, generator=gen).to(DEVICE, dtype)
    res = torch.randn(t, h, generator=gen).to(DEVICE, dtype)
    w = torch.randn(h, generator=gen).to(DEVICE, dtype)
    gate_up = torch.randn(t, 2 * i, generator=gen).to(DEVICE, dtype)
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=gen).to(DEVICE, dtype)
    qk = qkv[:, : (hq + hkv) * d].view(t, hq + hkv, d)
    cos, sin = cos_sin(t, d, dtype, flat=False, gen=gen)
    norm_out = torch.empty_like(x)
    mlp_out = torch.empty(t, i, device=DEVICE, dtype=dtype)

    def step_fn():
        rms_norm(x, w, 1e-5, residual=res, out=norm_out)
        silu_mul(gate_up, out=mlp_out)
        rotary_(qk, cos, sin)

    step_fn()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step_fn()

    for _ in range(2):
        for buf in (x, res, gate_up, qkv):
            buf.copy_(torch.randn(buf.shape, generator=gen))
        s = x + res
        want_norm = F.rms_norm(s.float(), (h,), eps=1e-5).to(dtype)
        gate, up = gate_up.split(i, dim=-1)
        want_silu = F.silu(gate)
        want_qk = rotary_reference(qk, cos, sin)
        norm_out.fill_(float("nan"))
        mlp_out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_equal(res, s)
        assert_rounded_product(norm_out, w, want_norm, 1)
        assert_rounded_product(mlp_out, up, want_silu, 1)
        assert_equal(qk, want_qk)


# --- in the model: the kernels as the decoder's FusedOps ------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32] if DEVICE == "cpu" else [torch.float32, torch.bfloat16])
def test_model_with_the_kernels_matches_the_torch_ops(rng, dtype) -> None:
    """A small Llama run with use_fused_ops(triton_fused) against the same model on the torch ops."""
    from pie.kernels import triton_fused
    from pie.model.attention import DenseCausalAttention
    from tests.model.test_fused_ops import tiny_model

    model = tiny_model(False, rng.randrange(2**31)).to(DEVICE, dtype)
    lens = [rng.randint(1, 9) for _ in range(3)]
    ids = torch.tensor([rng.randrange(97) for _ in range(sum(lens))], device=DEVICE)
    positions = torch.cat([torch.arange(n) for n in lens]).to(DEVICE)
    attn = DenseCausalAttention(lens, model.attn_scale)
    with torch.no_grad():
        want = model.compute_logits(model(ids, positions, attn))
        model.use_fused_ops(triton_fused)
        got = model.compute_logits(model(ids, positions, attn))
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
