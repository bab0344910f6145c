"""The one-row linear kernel (kernels/triton_gemv.py) against x.double() @ w.double().T + bias,
for every way its launch table can cut the work: row blocks that do not divide N, column blocks
that do not divide K, K split among programs (the parts summed by the second kernel) with a last
split shorter than the others, with and without a bias; and one config is the same bits on every
call. Outputs passed in are poisoned with NaN first.

Runs in Triton's CPU interpreter (fp32, fp16; small shapes) when there is no GPU; on the GPU the
bf16 case runs at the Llama-1B shape's projections and inside a CUDA graph.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any @triton.jit runs

import pytest  # noqa: E402

from pie.kernels.triton_gemv import GemvConfig, gemv  # noqa: E402
from tests.kernels.test_triton_matmul import CPU_DTYPES, DEVICE, assert_matches_reference, make  # noqa: E402

CONFIGS = [
    GemvConfig(block_n=16, block_k=128, split_k=1),
    GemvConfig(block_n=4, block_k=64, split_k=3),  # the last split shorter (K 376: 128, 128, 120)
    GemvConfig(block_n=32, block_k=128, split_k=2, num_warps=8, num_stages=2),  # 256 + 120: a block past K
]


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"n{c.block_n}-k{c.block_k}-s{c.split_k}")
def test_one_row_equals_the_exact_product(config, with_bias, dtype, gen):
    x, w, b = make(gen, 1, 100, 376, dtype, with_bias)  # N and K multiples of no block
    out = torch.full((1, 100), float("nan"), dtype=dtype, device=DEVICE)
    got = gemv(x, w, b, config=config, out=out)
    assert got is out
    assert_matches_reference(got, x, w, b)


def test_a_flat_row_and_repeated_calls(gen):
    """x of shape (K,) gives (N,); the parts are summed in split order, so calls agree to the bit."""
    x, w, b = make(gen, 1, 40, 300, torch.float32, True)
    cfg = GemvConfig(block_n=8, block_k=32, split_k=4)
    first = gemv(x.reshape(-1), w, b, config=cfg)
    assert first.shape == (40,)
    assert_matches_reference(first[None], x, w, b)
    assert torch.equal(first, gemv(x.reshape(-1), w, b, config=cfg))


def test_refuses_what_it_cannot_compute(gen):
    x, w, _ = make(gen, 2, 16, 64, torch.float32, False)
    with pytest.raises(AssertionError, match="one row"):
        gemv(x, w)
    with pytest.raises(AssertionError, match="weight"):
        gemv(x[:1], w.half())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA only")
@pytest.mark.parametrize("n,k", [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192)])
@pytest.mark.parametrize("config", [GemvConfig(), GemvConfig(block_n=8, block_k=256, split_k=4)],
                         ids=["default", "split4"])
def test_bf16_projections_and_graph_replay(n, k, config, gen):
    x, w, b = make(gen, 1, n, k, torch.bfloat16, True)
    out = torch.full((1, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    assert_matches_reference(gemv(x, w, b, config=config, out=out), x, w, b)
    want = out.clone()
    out.fill_(float("nan"))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gemv(x, w, b, config=config, out=out)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)
