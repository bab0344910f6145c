"""The batch-invariant linear kernel (kernels/triton_matmul.py) against x.double() @ w.double().T
+ bias, and its promise: a row's bits do not depend on the rows beside it (alone, in batches of any
size, at any position, shuffled, among unrelated rows), whichever way the K chunks run (programs
of their own plus the sum kernel, or one program per tile).

Runs in Triton's CPU interpreter (fp32, fp16; small shapes) when there is no GPU; the GPU tests
add bf16 at a 7B model's projection shapes, CUDA-graph capture and the one-compile-per-shape check.
Fresh random inputs every case, drawn from the `gen` fixture (tests/kernels/conftest.py); outputs
passed in are poisoned with NaN before the kernel writes them.
"""

from __future__ import annotations

import dataclasses
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any @triton.jit runs

import pytest  # noqa: E402

from pie.kernels import triton_matmul as tm  # noqa: E402
from pie.kernels.triton_matmul import MatmulConfig, config_for, linear  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CPU_DTYPES = [torch.float32, torch.float16]  # the interpreter computes bf16 wrongly
# Unit roundoff of the output's rounding: fp32 2^-24, fp16 2^-11, bf16 2^-8 (the interpreter
# truncates bf16 instead of rounding: a whole ulp there).
OUT_EPS = {torch.float32: 2.0 ** -24, torch.float16: 2.0 ** -11,
           torch.bfloat16: 2.0 ** -8 if DEVICE == "cuda" else 2.0 ** -7}
TINY = {torch.float32: 2.0 ** -149, torch.float16: 2.0 ** -24, torch.bfloat16: 2.0 ** -133}
# Weight shapes (N, K) of a 7B-class model (hidden 3584, 28 q / 4 kv heads of 128, FFN 18944).
QKV, DOWN, GATE_UP = (4608, 3584), (3584, 18944), (37888, 3584)


def randn(gen: torch.Generator, *shape: int, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * scale).to(DEVICE, dtype)


def make(gen: torch.Generator, m: int, n: int, k: int, dtype: torch.dtype, with_bias: bool):
    """x (M, K), weight (N, K) scaled as nn.Linear's init, bias (N,) or None."""
    x = randn(gen, m, k, dtype=dtype)
    w = randn(gen, n, k, dtype=dtype, scale=k ** -0.5)
    b = randn(gen, n, dtype=dtype) if with_bias else None
    return x, w, b


def assert_matches_reference(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> None:
    """|got - exact| within an fp32 sum's error bound over K terms (relative to sum |x_i w_i| +
    |b|) plus the one rounding to the output dtype. A dropped or doubled K step, a wrong column or
    a bias added twice is O(1) of that sum, far outside."""
    assert got.shape == (x.shape[0], w.shape[0]) and got.dtype == x.dtype
    assert not got.isnan().any(), "NaN in the output: an element was not written"
    ref = x.double() @ w.double().T
    magnitude = x.double().abs() @ w.double().abs().T
    if b is not None:
        ref += b.double()
        magnitude += b.double().abs()
    acc_err = 2 * (x.shape[1] + 1) * 2.0 ** -24 * magnitude
    eps = OUT_EPS[got.dtype]
    tol = (1 + eps) * acc_err + eps * ref.abs() + TINY[got.dtype]
    err = (got.double() - ref).abs()
    bad = err > tol
    assert not bad.any(), f"{int(bad.sum())} of {bad.numel()} off; worst {float((err / tol).max()):.3g} x the bound"


def assert_rows_equal(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.shape == want.shape, what
    same = (got == want) | (got.isnan() & want.isnan())
    rows = (~same).any(dim=1).nonzero().flatten().tolist()
    assert not rows, f"{what}: rows {rows[:10]} differ ({len(rows)} of {got.shape[0]})"


# --- against the reference ----------------------------------------------------------------


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("m,n,k", [(1, 1000, 376), (3, 1000, 376), (17, 200, 96), (64, 130, 200), (300, 100, 40)])
def test_linear_matches_reference(m, n, k, dtype, with_bias, gen) -> None:
    x, w, b = make(gen, m, n, k, dtype, with_bias)
    out = torch.full((m, n), float("nan"), dtype=dtype, device=DEVICE)
    got = linear(x, w, b, out=out)
    assert got is out
    assert_matches_reference(got, x, w, b)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_each_way_of_running_the_chunks_gives_the_same_bits(dtype, gen) -> None:
    """Chunks in programs of their own (workspace + sum kernel) or one after the other in one
    program: the same adds in the same order."""
    x, w, b = make(gen, 5, 200, 376, dtype, True)
    cfg = dataclasses.replace(config_for(200, 376, dtype), splits=4)
    assert cfg.chunks(376) == (3, 4)
    parts = linear(x, w, b, config=dataclasses.replace(cfg, split_below=10**9))
    fused = linear(x, w, b, out=torch.full_like(parts, float("nan")), config=dataclasses.replace(cfg, split_below=0))
    assert_matches_reference(parts, x, w, b)
    assert_rows_equal(fused, parts, "fused against parts")


def test_strided_and_transposed_x(gen) -> None:
    """x may be a column slice of a wider buffer (read in place) or not unit-stride along K
    (copied first): the same bits as a contiguous copy."""
    x, w, b = make(gen, 9, 72, 100, torch.float32, True)
    want = linear(x.clone(), w, b)
    wide = torch.zeros(9, 137, device=DEVICE)
    wide[:, 5:105] = x
    assert_rows_equal(linear(wide[:, 5:105], w, b), want, "column slice")
    assert_rows_equal(linear(x.t().contiguous().t(), w, b), want, "transposed storage")


def test_empty_batch(gen) -> None:
    _, w, b = make(gen, 1, 40, 24, torch.float32, True)
    assert linear(torch.empty(0, 24, device=DEVICE), w, b).shape == (0, 40)


# --- batch invariance ------------------------------------------------------------------------


def check_invariance(m: int, n: int, k: int, dtype: torch.dtype, with_bias: bool, cfg: MatmulConfig | None,
                     gen: torch.Generator, singles: int = 4) -> None:
    """Every row of x gives the same bits alone, in prefixes of several sizes, shuffled, and
    behind unrelated rows, as in the whole batch."""
    x, w, b = make(gen, m, n, k, dtype, with_bias)
    full = linear(x, w, b, config=cfg)
    assert_matches_reference(full, x, w, b)
    for i in torch.randperm(m, generator=gen)[:singles].tolist():
        assert_rows_equal(linear(x[i:i + 1], w, b, config=cfg), full[i:i + 1], f"row {i} alone")
    for size in sorted({7, 64, m // 2} - {0, m}):
        if size < m:
            assert_rows_equal(linear(x[:size], w, b, config=cfg), full[:size], f"x[:{size}]")
    perm = torch.randperm(m, generator=gen).to(DEVICE)
    assert_rows_equal(linear(x[perm], w, b, config=cfg), full[perm], "shuffled")
    others = randn(gen, 37, k, dtype=dtype, scale=100.0)  # unrelated rows, much larger
    mixed = linear(torch.cat([others[:20], x, others[20:]]), w, b, config=cfg)
    assert_rows_equal(mixed[20:20 + m], full, "among unrelated rows")


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("launch", ["default", "switching", "one-chunk"])
def test_rows_do_not_depend_on_the_batch(dtype, launch, gen) -> None:
    """Default: the CPU table (3 chunks, each in a program of its own at these sizes). Switching:
    1-row tile counts run the chunks in programs of their own, larger batches one program per
    tile, so the two ways meet in one comparison. One chunk: no workspace at all."""
    n, k = 136, 392
    cfg = config_for(n, k, dtype)
    assert cfg.chunks(k)[1] == 3  # 2 chunks would add the same in either order
    cfg = {"default": cfg, "switching": dataclasses.replace(cfg, split_below=4),
           "one-chunk": dataclasses.replace(cfg, splits=1)}[launch]
    check_invariance(70, n, k, dtype, launch != "one-chunk", cfg, gen)


# --- the launch table and errors -------------------------------------------------------------

MODEL_SHAPES = {  # (N, K) of the projections the table is meant for
    "7B qkv": QKV, "7B o": (3584, 3584), "7B gate_up": GATE_UP, "7B down": DOWN, "7B lm_head": (152064, 3584),
    "1B qkv": (3072, 2048), "1B o": (2048, 2048), "1B gate_up": (16384, 2048), "1B down": (2048, 8192),
    "1B lm_head": (128256, 2048),
}


@pytest.mark.parametrize("capability", [(9, 0), (8, 0), None])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_config_for_fills_the_gpu_at_one_row(capability, dtype) -> None:
    """At M = 1, column tiles x chunks reach PROGRAMS unless the chunks would get shorter than
    MIN_CHUNK_STEPS or more than MAX_SPLITS; no chunk is empty; wide weights keep one chunk."""
    for name, (n, k) in MODEL_SHAPES.items():
        cfg = config_for(n, k, dtype, capability)
        chunk_steps, chunks = cfg.chunks(k)
        steps = tm.cdiv(k, cfg.block_k)
        assert (chunks - 1) * chunk_steps < steps <= chunks * chunk_steps, name
        programs = tm.cdiv(n, cfg.block_n) * chunks
        assert (programs >= tm.PROGRAMS or chunk_steps < 2 * tm.MIN_CHUNK_STEPS
                or chunks == tm.MAX_SPLITS), (name, cfg)
        if tm.cdiv(n, cfg.block_n) >= tm.PROGRAMS:
            assert chunks == 1, (name, cfg)
    cfg = config_for(*QKV, torch.bfloat16, (9, 0))
    assert (cfg.block_m, cfg.block_n, cfg.block_k, cfg.chunks(QKV[1])) == (64, 128, 64, (14, 4))


def test_config_rejects_bad_tiles() -> None:
    for kwargs in [dict(block_m=48), dict(block_n=8), dict(block_k=0), dict(splits=0), dict(num_warps=0)]:
        with pytest.raises(ValueError):
            MatmulConfig(**{**dict(block_m=64, block_n=64, block_k=32, splits=1, num_warps=4, num_stages=2), **kwargs})


def test_rejects_bad_inputs(gen) -> None:
    x, w, b = make(gen, 4, 16, 32, torch.float32, True)
    bad = [
        dict(x=x[None], weight=w),  # 3-D x
        dict(x=x, weight=w[None]),  # 3-D weight
        dict(x=x, weight=w[:, :31]),  # K mismatch
        dict(x=x, weight=w, bias=b[:15]),  # bias size
        dict(x=x, weight=w, bias=b[:, None]),  # bias 2-D
        dict(x=x, weight=w.half()),  # weight dtype
        dict(x=x, weight=w, bias=b.half()),  # bias dtype
        dict(x=x.double(), weight=w.double()),  # unsupported dtype
        dict(x=x.long(), weight=w.long()),
        dict(x=x, weight=w.t().contiguous().t()),  # weight not contiguous
        dict(x=x, weight=w, out=torch.empty(4, 15, device=DEVICE)),  # out shape
        dict(x=x, weight=w, out=torch.empty(4, 16, dtype=torch.half, device=DEVICE)),  # out dtype
        dict(x=x, weight=w, out=torch.empty(16, 4, device=DEVICE).t()),  # out not contiguous
        dict(x=x[:, :0], weight=w[:, :0]),  # K = 0
    ]
    for kwargs in bad:
        with pytest.raises(ValueError):
            linear(**kwargs)


# --- GPU: bf16 at model shapes, graphs, compiles ------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("m", [1, 7, 256])
def test_gpu_matches_reference(m, dtype, gen) -> None:
    for (n, k), with_bias in [(QKV, True), (DOWN, False), ((1000, 376), True)]:
        x, w, b = make(gen, m, n, k, dtype, with_bias)
        out = torch.full((m, n), float("nan"), dtype=dtype, device=DEVICE)
        assert_matches_reference(linear(x, w, b, out=out), x, w, b)


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [QKV, DOWN, GATE_UP])
def test_gpu_rows_do_not_depend_on_the_batch(n, k, gen) -> None:
    """bf16 at model shapes: x[:M] for M in 1, 8, 64, 256, 1000 (both ways of running the chunks
    where the table has several), single rows, shuffled, among other rows."""
    x, w, b = make(gen, 1000, n, k, torch.bfloat16, n == QKV[0])
    full = linear(x, w, b)
    assert_matches_reference(full, x, w, b)
    for m in (1, 8, 64, 256):
        assert_rows_equal(linear(x[:m], w, b), full[:m], f"x[:{m}]")
    for i in (1, 500, 999):
        assert_rows_equal(linear(x[i:i + 1], w, b), full[i:i + 1], f"row {i} alone")
    perm = torch.randperm(1000, generator=gen).to(DEVICE)
    assert_rows_equal(linear(x[perm], w, b), full[perm], "shuffled")
    others = randn(gen, 300, k, dtype=torch.bfloat16, scale=50.0)
    assert_rows_equal(linear(torch.cat([others, x[:64]]), w, b)[300:], full[:64], "behind other rows")


@pytest.mark.gpu
def test_gpu_rows_at_unaligned_addresses(gen) -> None:
    """K * 2 bytes not a multiple of 16: x[1:] starts 8 bytes off, which Triton compiles as a
    variant without 16-byte loads; its rows keep their bits."""
    x, w, b = make(gen, 65, 512, 1004, torch.bfloat16, True)
    full = linear(x, w, b)
    assert x[1:].data_ptr() % 16 != 0
    assert_rows_equal(linear(x[1:], w, b), full[1:], "x[1:]")
    assert_rows_equal(linear(x[3:4], w, b), full[3:4], "x[3:4]")


def _compiled(kernel) -> int | None:
    """Variants of a jitted kernel compiled for the current device (None where this Triton keeps
    them elsewhere)."""
    caches = getattr(kernel, "device_caches", None)
    if caches is None:
        return None
    entry = caches.get(torch.cuda.current_device())
    return 0 if entry is None else len(entry[0])


@pytest.mark.gpu
def test_gpu_one_compile_for_every_m_and_cuda_graphs(gen) -> None:
    """A weight shape no other test uses: calls at M from 1 to 4096 (both ways of running its 5
    chunks) add one variant of each kernel; calls captured in CUDA graphs replay the eager bits."""
    n, k = 2560, 1280
    cfg = config_for(n, k, torch.bfloat16, tm.capability_of(torch.device(DEVICE)))
    assert cfg.chunks(k)[1] > 1
    x, w, b = make(gen, 4096, n, k, torch.bfloat16, True)
    before = (_compiled(tm._linear_kernel), _compiled(tm._sum_chunks_kernel))
    full = linear(x, w, b)
    for m in (1, 2, 3, 17, 64, 100, 255, 256, 1000, 4095):
        assert_rows_equal(linear(x[:m], w, b), full[:m], f"x[:{m}]")
    after = (_compiled(tm._linear_kernel), _compiled(tm._sum_chunks_kernel))
    counted = None not in before  # Triton's device_caches, where this Triton keeps them
    if counted:
        assert (after[0] - before[0], after[1] - before[1]) == (1, 1), (before, after)

    for m in (8, 2048):  # chunks in programs of their own; one program per tile
        xs = x[:m].clone()
        out = torch.empty(m, n, dtype=torch.bfloat16, device=DEVICE)
        linear(xs, w, b, out=out)  # warm (compiled above)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            linear(xs, w, b, out=out)
        for _ in range(2):
            xs.copy_(randn(gen, m, k, dtype=torch.bfloat16))
            out.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            assert_rows_equal(out, linear(xs, w, b), f"graph replay at M={m}")
    if not counted:
        pytest.skip("this Triton keeps no device_caches: the compile count was not checked (the rows and "
                    "the graph replays were)")
    assert (_compiled(tm._linear_kernel), _compiled(tm._sum_chunks_kernel)) == after
