"""One row through a linear layer: out = x @ weight.T + bias for x of one row, in Triton.

A user alone decodes one row a step, and each step reads every weight once: the step is a chain
of matrix-vector products whose bound is the weights' bytes over the copy bandwidth. A GEMM
library's kernels at one row leave part of that bandwidth unused and may split K with a reduce
kernel of their own. This kernel streams the weight rows with no tensor cores (one row of x gives
nothing to share):

    grid (cdiv(N, BLOCK_N), SPLIT_K)
    program (n, s): acc[BLOCK_N] = sum over its K share, BLOCK_K columns at a time, of
                    W[rows, cols] * x[cols], in fp32
    SPLIT_K == 1:   out[rows] = rnd(acc + bias)
    SPLIT_K  > 1:   part[s, rows] = acc; `_sum_parts_kernel` adds the parts in split order, then
                    the bias, and rounds once

The weight's dtype is x's (bf16, fp16 or fp32); the sums are fp32 in a fixed order for a given
config (no atomics), so a call is the same bits every time. Not promised: equal bits to F.linear
(a different order, equally accurate). `GemvConfig` is the launch table; benchmarks/gemv.py times
configs against F.linear on the GPU, and the engine does not use this kernel yet.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .triton_tile import cdiv


@dataclass(frozen=True, slots=True)
class GemvConfig:
    block_n: int = 16  # weight rows per program
    block_k: int = 512  # columns per load (a power of two)
    split_k: int = 1  # programs along K per row block (> 1: a second kernel sums their parts)
    num_warps: int = 4
    num_stages: int = 3  # software-pipelining depth of the weight loads


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, out_ptr, part_ptr,
                 N: tl.constexpr, K: tl.constexpr, K_SHARE: tl.constexpr, HAS_BIAS: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                 NUM_STAGES: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    split = tl.program_id(1)
    k_start = split * K_SHARE
    k_end = tl.minimum(k_start + K_SHARE, K)
    acc = tl.zeros((BLOCK_N,), tl.float32)
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * K
    for k0 in tl.range(k_start, k_end, BLOCK_K, num_stages=NUM_STAGES):
        cols = k0 + tl.arange(0, BLOCK_K)
        col_ok = cols < k_end
        x = tl.load(x_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        w = tl.load(w_rows + cols[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0.0,
                    eviction_policy="evict_first").to(tl.float32)  # (BLOCK_N, BLOCK_K), read once
        acc += tl.sum(w * x[None, :], axis=1)
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(b_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + rows, acc.to(out_ptr.dtype.element_ty), mask=row_ok)
    else:
        tl.store(part_ptr + split * N + rows, acc, mask=row_ok)


@triton.jit
def _sum_parts_kernel(part_ptr, b_ptr, out_ptr, N: tl.constexpr, SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                      BLOCK: tl.constexpr):
    """out = rnd(part[0] + part[1] + ... + part[SPLIT_K - 1] + bias), in that order."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    acc = tl.load(part_ptr + offs, mask=ok, other=0.0)
    for s in tl.static_range(1, SPLIT_K):
        acc += tl.load(part_ptr + s * N + offs, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
         config: GemvConfig = GemvConfig(), out: torch.Tensor | None = None) -> torch.Tensor:
    """x (1, K) or (K,) -> (1, N) (or (N,)) = x @ weight.T + bias; weight (N, K) contiguous, x's
    dtype. `out`: where to write (a CUDA graph keeps its address). Nothing syncs with the host."""
    n, k = weight.shape
    flat = x.reshape(-1)
    assert flat.shape == (k,), f"x must hold one row of {k}, got {tuple(x.shape)}"
    assert flat.stride(0) == 1 and weight.is_contiguous(), "x's row and the weight must be contiguous"
    assert weight.dtype == x.dtype and (bias is None or (bias.shape == (n,) and bias.is_contiguous())), (
        f"weight {weight.dtype} vs x {x.dtype}, bias {None if bias is None else tuple(bias.shape)}")
    cfg = config
    assert cfg.block_k & (cfg.block_k - 1) == 0 and cfg.block_n & (cfg.block_n - 1) == 0, "power-of-two blocks"
    shape = (*x.shape[:-1], n)
    if out is None:
        out = torch.empty(shape, dtype=x.dtype, device=x.device)
    assert out.shape == shape and out.dtype == x.dtype and out.is_contiguous(), f"out must be {shape} {x.dtype}"
    # each split's share of K in whole BLOCK_K steps (the last split may be shorter)
    share = cdiv(cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k
    splits = cdiv(k, share)
    part = out if splits == 1 else torch.empty((splits, n), dtype=torch.float32, device=x.device)
    b = bias if bias is not None else out  # unused without a bias
    _gemv_kernel[(cdiv(n, cfg.block_n), splits)](
        flat, weight, b, out, part, N=n, K=k, K_SHARE=share, HAS_BIAS=bias is not None,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=splits, NUM_STAGES=cfg.num_stages,
        num_warps=cfg.num_warps)
    if splits > 1:
        _sum_parts_kernel[(cdiv(n, 1024),)](part, b, out, N=n, SPLIT_K=splits, HAS_BIAS=bias is not None,
                                            BLOCK=1024, num_warps=4)
    return out
