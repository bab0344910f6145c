"""A batch-invariant linear layer in Triton: out = x @ weight.T + bias, where the bits of a row of
`out` depend on that row of x, the weights and the weight shape, never on the other rows in the call.

Why: cuBLAS (behind torch's F.linear on CUDA) picks its GEMM kernel by all of (M, N, K): tile
shapes, split-K and stream-K decompositions change with the number of rows M, and with them the
order in which the K products of an output element are summed. fp32 sums are not associative, so
a token's projection rounds differently when it shares the step with 7 tokens than with 300, and
sampling with a fixed seed can then part ways on a near tie (benchmarks/seed_consistency.py).

What this kernel fixes: every output element is summed in one order that depends only on
(N, K, dtype) and the launch table `config_for` (which reads the device's compute capability,
never M). K is cut into fixed chunks of whole BLOCK_K steps, each chunk accumulated in fp32 in step
order by tl.dot, the chunk sums added in chunk order, then the bias in fp32, then one rounding:

    K:   |<-- chunk 0 -->|<-- chunk 1 -->| ... |<- chunk C-1 ->|     (the last chunk may be shorter)
    s_c  = fp32 accumulation of chunk c's BLOCK_K steps, in order (tl.dot into one accumulator)
    out  = rnd_dtype( ((((0 + s_0) + s_1) + ... + s_{C-1}) + bias) )

torch's F.linear with a bias on CUDA adds it in the GEMM epilogue in fp32 the same way. The tile
shape (BLOCK_M, BLOCK_N, BLOCK_K, num_warps) is one per weight shape, so the MMA instruction and
the order inside it are the same for every M; a row's position in its tile (or which tile) does not
enter its sum, and rows past M are loaded as zeros and never stored.

How the chunks run changes with M, and may, because it changes no arithmetic:
- few tiles (small M, decode): one program per (tile, chunk) writes s_c to an fp32 workspace
  (C, M, N); `_sum_chunks_kernel` adds them in chunk order, adds the bias and rounds. So even M = 1
  launches C programs per column tile, enough to keep every SM reading weights.
- many tiles (prefill): one program per tile accumulates its chunks one after the other and adds
  each sum into a running fp32 total in registers, the same adds in the same order.
`MatmulConfig.split_below` is the tile count below which the first way runs.

Compilation: M and the workspace switch are not specialized on (`do_not_specialize`), N and K are
compile-time constants, so each (weight shape, dtype, bias or not) compiles once and any M reuses
it; nothing syncs with the host or allocates from values (the workspace is sized by M alone), so
calls can be captured in a CUDA graph. Pointers keep Triton's 16-byte alignment specialization
(vectorized loads): a row slice of a contiguous (M, K) activation moves its pointer by whole rows,
K * itemsize bytes, a multiple of 16 whenever K is a multiple of 8, so no step compiles anew.

Not promised: equal bits to F.linear (a different order, equally accurate), across compute
capabilities or Triton versions (another MMA instruction or schedule), or between two configs;
nor invariance of the model as a whole, which needs the attention kernels' fixed splits too.
fp32 inputs use IEEE dots (no TF32). In the CPU interpreter tl.dot is a BLAS matmul whose rows
round differently by their position in the tile, so there each step's products are summed by an
elementwise reduction instead (one order for every row): the invariance tests hold on the CPU, and
tl.dot's own rows are checked on the GPU. bf16 there (its bf16 arithmetic is wrong) is computed
in fp32 and truncated when stored; tests compare fp32 and fp16 on the CPU.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .triton_tile import cdiv, dot_types

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
PROGRAMS = 128  # programs an M = 1 call aims to launch: about one per SM of the largest GPUs
MIN_CHUNK_STEPS = 4  # BLOCK_K steps per chunk at least: shorter chunks cost more in sums than they gain
MAX_SPLITS = 16
REDUCE_BLOCK = 1024  # elements of `out` per program of _sum_chunks_kernel


@dataclass(frozen=True, slots=True)
class MatmulConfig:
    """The launch table of one weight shape: the tile and the K chunks fix the bits; split_below
    and num_stages only how the work is spread and overlapped."""

    block_m: int  # rows of x per tile: one value for every M (it sets the MMA instruction's shape)
    block_n: int  # weight rows (output columns) per tile
    block_k: int  # K per tl.dot step
    splits: int  # K is summed in this many chunks of whole BLOCK_K steps (fewer if K is short)
    num_warps: int
    num_stages: int  # software-pipelining depth of the K loop
    group_m: int = 8  # row tiles run side by side per column strip, for L2 reuse (order only)
    split_below: int = PROGRAMS  # chunks get programs of their own when fewer tiles than this

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {value}")
        if self.splits < 1 or self.num_warps < 1 or self.num_stages < 1 or self.group_m < 1:
            raise ValueError(f"splits, num_warps, num_stages and group_m must be >= 1: {self}")

    def chunks(self, k: int) -> tuple[int, int]:
        """(BLOCK_K steps per chunk, chunks) for K = k: whole steps, no chunk empty."""
        steps = cdiv(k, self.block_k)
        chunk_steps = cdiv(steps, self.splits)
        return chunk_steps, cdiv(steps, chunk_steps)


@functools.cache
def config_for(n: int, k: int, dtype: torch.dtype, capability: tuple[int, int] | None = None) -> MatmulConfig:
    """The launch table for weight (n, k) of `dtype` on a GPU of compute `capability` (None: the
    CPU interpreter). It never sees M: this is what makes the bits independent of the batch.

    16-bit on the GPU: 64 x 128 tiles of 64-deep K steps, one warpgroup (4 warps), 4 stages. 64
    rows are the least a Hopper warpgroup MMA takes, so decode (M <= 64: one row tile) pays for 64
    rows of tensor-core work, a fraction of the time its weight read takes; prefill gets a tile where
    each loaded element feeds 43 multiply-adds. N below 1024 takes 64-wide tiles. fp32 (IEEE
    FMA dots): 64 x 64 x 32 over 8 warps (over 4, its two accumulators spill). The CPU
    interpreter: small tiles, little masked work.

    K chunks: enough that an M = 1 call launches PROGRAMS programs (column tiles x chunks), with at
    least MIN_CHUNK_STEPS steps per chunk and at most MAX_SPLITS chunks. Weights with many columns
    (gate/up, the LM head) fill the GPU with column tiles alone and keep one chunk.
    """
    if capability is None:
        block_m, block_n, block_k, warps, stages = 32, 64, 32, 4, 1
    elif dtype == torch.float32:
        block_m, block_n, block_k, warps, stages = 64, 64, 32, 8, 3
    else:
        block_m, block_k, warps = 64, 64, 4
        block_n = 128 if n >= 1024 else 64
        stages = 4 if capability >= (9, 0) else 3
    return MatmulConfig(block_m, block_n, block_k, splits_for(n, k, block_n, block_k), warps, stages)


def splits_for(n: int, k: int, block_n: int, block_k: int) -> int:
    """K chunks for weight (n, k) in (block_n, block_k) tiles: `config_for`'s rule."""
    steps = cdiv(k, block_k)
    splits = max(1, min(cdiv(PROGRAMS, cdiv(n, block_n)), steps // MIN_CHUNK_STEPS, MAX_SPLITS))
    return cdiv(steps, cdiv(steps, splits))  # no empty chunk


@triton.jit
def _chunk_sum(x_rows, w_cols, row_ok, col_ok, first, last, K: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
               DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr, MMA: tl.constexpr):
    """fp32 (BLOCK_M, BLOCK_N) sum of K steps [first, last), in step order, from zero."""
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    offs_k = tl.arange(0, BLOCK_K)
    for step in range(first, last):
        ks = step * BLOCK_K + offs_k
        if EVEN_K:
            x_mask = row_ok[:, None]
            w_mask = col_ok[None, :]
        else:
            x_mask = row_ok[:, None] & (ks < K)[None, :]
            w_mask = col_ok[None, :] & (ks < K)[:, None]
        a = tl.load(x_rows + ks[None, :], mask=x_mask, other=0.0)  # (BLOCK_M, BLOCK_K)
        if EVEN_N and EVEN_K:
            b = tl.load(w_cols + ks[:, None])  # (BLOCK_K, BLOCK_N): W^T read in place
        else:
            b = tl.load(w_cols + ks[:, None], mask=w_mask, other=0.0)
        if MMA:
            acc = tl.dot(a.to(DOT_DTYPE), b.to(DOT_DTYPE), acc, input_precision=PRECISION)
        else:  # the interpreter: products summed over the step elementwise, the same for every row
            acc += tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
    return acc


@triton.jit
def _store_out(total, b_ptr, out_ptr, cols, col_ok, out_off, out_mask, HAS_BIAS: tl.constexpr):
    """total (+ bias, in fp32), rounded once to out's dtype."""
    if HAS_BIAS:
        total += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + out_off, total.to(out_ptr.dtype.element_ty), mask=out_mask)


# M changes every step and to_parts with it (both are only loop bounds and a branch): not
# specialized, so any M runs the one compiled kernel.
@triton.jit(do_not_specialize=["M", "to_parts"])
def _linear_kernel(x_ptr, w_ptr, b_ptr, out_ptr, part_ptr, M, stride_xm, to_parts,
                   N: tl.constexpr, K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, CHUNK_STEPS: tl.constexpr, CHUNKS: tl.constexpr,
                   GROUP_M: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_DTYPE: tl.constexpr,
                   PRECISION: tl.constexpr, MMA: tl.constexpr):
    """Program (tile, chunk). to_parts: this chunk's sum into part_ptr (CHUNKS, M, N) fp32, else
    (chunk 0 of a one-column grid) all chunks in order, the bias, and the rounded tile of out."""
    STEPS: tl.constexpr = (K + BLOCK_K - 1) // BLOCK_K
    TILES_N: tl.constexpr = (N + BLOCK_N - 1) // BLOCK_N
    EVEN_K: tl.constexpr = K % BLOCK_K == 0
    EVEN_N: tl.constexpr = N % BLOCK_N == 0
    # Grouped order: GROUP_M row tiles walk each column strip together, so a strip of W is read
    # from memory once per group (the order of programs; no effect on any sum).
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    group = pid // (GROUP_M * TILES_N)
    first_m = group * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * TILES_N)) % group_rows
    pid_n = (pid % (GROUP_M * TILES_N)) // group_rows

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm  # (BLOCK_M, 1)
    w_cols = w_ptr + cols.to(tl.int64)[None, :] * K  # (1, BLOCK_N): W is (N, K) contiguous
    out_off = rows.to(tl.int64)[:, None] * N + cols[None, :]  # (BLOCK_M, BLOCK_N) in (M, N)
    out_mask = row_ok[:, None] & col_ok[None, :]

    if CHUNKS == 1:
        total = _chunk_sum(x_rows, w_cols, row_ok, col_ok, 0, STEPS, K, BLOCK_M, BLOCK_N, BLOCK_K,
                           EVEN_K, EVEN_N, DOT_DTYPE, PRECISION, MMA)
        _store_out(total, b_ptr, out_ptr, cols, col_ok, out_off, out_mask, HAS_BIAS)
    elif to_parts:
        chunk = tl.program_id(1)
        part = _chunk_sum(x_rows, w_cols, row_ok, col_ok, chunk * CHUNK_STEPS,
                          tl.minimum((chunk + 1) * CHUNK_STEPS, STEPS), K, BLOCK_M, BLOCK_N, BLOCK_K,
                          EVEN_K, EVEN_N, DOT_DTYPE, PRECISION, MMA)
        tl.store(part_ptr + chunk.to(tl.int64) * M * N + out_off, part, mask=out_mask)
    else:
        total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for chunk in range(CHUNKS):  # _sum_chunks_kernel's adds, in its order
            total += _chunk_sum(x_rows, w_cols, row_ok, col_ok, chunk * CHUNK_STEPS,
                                tl.minimum((chunk + 1) * CHUNK_STEPS, STEPS), K, BLOCK_M, BLOCK_N,
                                BLOCK_K, EVEN_K, EVEN_N, DOT_DTYPE, PRECISION, MMA)
        _store_out(total, b_ptr, out_ptr, cols, col_ok, out_off, out_mask, HAS_BIAS)


@triton.jit(do_not_specialize=["numel"])
def _sum_chunks_kernel(part_ptr, b_ptr, out_ptr, numel, N: tl.constexpr, CHUNKS: tl.constexpr,
                       HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    """out = rnd(((0 + part[0]) + part[1]) + ... + bias) over BLOCK elements of the flat (M, N)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < numel
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for chunk in tl.static_range(CHUNKS):
        total += tl.load(part_ptr + chunk * numel.to(tl.int64) + offs, mask=ok, other=0.0)
    if HAS_BIAS:
        total += tl.load(b_ptr + offs % N, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, total.to(out_ptr.dtype.element_ty), mask=ok)


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


@functools.lru_cache(maxsize=8)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


@functools.lru_cache(maxsize=8)
def _no_parts(device: torch.device) -> torch.Tensor:
    """An fp32 stand-in for the workspace when there is none (the kernel never touches it): every
    call then passes part_ptr with one type, so the two ways of running share one compile."""
    return torch.empty(4, dtype=torch.float32, device=device)


def capability_of(device: torch.device) -> tuple[int, int] | None:
    """What `config_for` reads of a device: its compute capability, None for the CPU."""
    if device.type != "cuda":
        return None
    return _capability(device.index if device.index is not None else torch.cuda.current_device())


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           out: torch.Tensor | None = None, config: MatmulConfig | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) with bits per row independent of the batch (module docstring).

    x (M, K) bf16/fp16/fp32 with unit stride along K (any row stride; otherwise it is copied
    contiguous first); weight (N, K) contiguous, as nn.Linear stores it; bias (N,) or None; all of
    one dtype and device. out (M, N) contiguous in that dtype is allocated unless given. config:
    the launch table (default `config_for(N, K, dtype, capability)`; another config gives other
    bits, equally invariant).
    """
    _check(x.dim() == 2, f"x must be (M, K), got shape {tuple(x.shape)}")
    _check(weight.dim() == 2, f"weight must be (N, K), got shape {tuple(weight.shape)}")
    m, k = x.shape
    n = weight.shape[0]
    _check(weight.shape[1] == k, f"weight must be (N, {k}) for x of shape {tuple(x.shape)}, got {tuple(weight.shape)}")
    _check(x.dtype in DTYPES, f"x must be bf16, fp16 or fp32, got {x.dtype}")
    _check(n > 0 and k > 0, f"N and K must be positive, got weight of shape {tuple(weight.shape)}")
    _check(weight.is_contiguous(), "weight must be contiguous (N, K)")
    others = {"weight": weight}
    if bias is not None:
        _check(bias.shape == (n,), f"bias must be ({n},), got {tuple(bias.shape)}")
        _check(bias.is_contiguous(), "bias must be contiguous")
        others["bias"] = bias
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    else:
        _check(out.shape == (m, n), f"out must be {(m, n)}, got {tuple(out.shape)}")
        _check(out.is_contiguous(), "out must be contiguous")
        others["out"] = out
    for name, other in others.items():
        _check(other.dtype == x.dtype, f"{name} must be {x.dtype}, got {other.dtype}")
        _check(other.device == x.device, f"{name} is on {other.device}, x on {x.device}")
    if m == 0:
        return out
    if x.stride(1) != 1:
        x = x.contiguous()
    cfg = config or config_for(n, k, x.dtype, capability_of(x.device))
    chunk_steps, chunks = cfg.chunks(k)
    tiles = cdiv(m, cfg.block_m) * cdiv(n, cfg.block_n)
    to_parts = chunks > 1 and tiles < cfg.split_below
    parts = torch.empty((chunks, m, n), dtype=torch.float32, device=x.device) if to_parts else _no_parts(x.device)
    dot_dtype, precision = dot_types(x.dtype, x.is_cuda)
    has_bias = bias is not None
    _linear_kernel[(tiles, chunks if to_parts else 1)](
        x, weight, bias if has_bias else out, out, parts, m, x.stride(0), int(to_parts),
        N=n, K=k, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, CHUNK_STEPS=chunk_steps,
        CHUNKS=chunks, GROUP_M=cfg.group_m, HAS_BIAS=has_bias, DOT_DTYPE=dot_dtype, PRECISION=precision,
        MMA=x.is_cuda, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if to_parts:
        _sum_chunks_kernel[(cdiv(m * n, REDUCE_BLOCK),)](
            parts, bias if has_bias else out, out, m * n, N=n, CHUNKS=chunks, HAS_BIAS=has_bias,
            BLOCK=REDUCE_BLOCK, num_warps=4)
    return out
