"""The INT8 decode roofline (issue 46): what a decode step must read, streamed by kernels that do
nothing else, then the attention's pieces added to that stream one at a time.

    python3 -m benchmarks.int8_roofline --stream --buildup [--out DIR]    # one GPU call (~5-8 min)
    python3 -m benchmarks.int8_roofline --ncu [--best DIR/roofline.json]  # Nsight Compute, GPU
    TRITON_INTERPRET=0 python -m benchmarks.int8_roofline --asm           # sm_90 registers, no GPU
    python -m benchmarks.int8_roofline --stream --buildup --tiny          # CPU interpreter

Every kernel here is one Triton kernel, `_roofline_kernel`, one program per (kv head, sequence,
split) as in kernels/triton_decode.py, over pie's pages (num_blocks, PAGE, Hkv, D) (or head-major
(num_blocks, Hkv, PAGE, D) with --head-major) gathered through a block table of shuffled pages;
tiles of TILE tokens span TILE / PAGE pages. Its constexpr STEP adds the pieces cumulatively:

    0 stream     K and V tiles reduced into a register accumulator (int8 pages read as 32-bit
                 words and xor-ed: no conversion at all; 16-bit pages summed in fp32)
    1 + scales   the fp16 per-(token, head) scales loaded and summed as well
    2 + convert  int8 -> 16-bit per element, times the token's scale, summed in fp32: `cvt16`
                 (.to(fp16)), `cvt32` (.to(fp32)), `bias-int` (1152 + x by xor 0x80 and the fp16
                 exponent of 1024 as plain integer ops), `bias-asm` (the same by triton_tile's
                 inline PTX, 3 instructions per 4 values; plain casts in the interpreter)
    3 + QK^T     K into tl.dot against the G = Hq / Hkv query heads padded to `rows` rows
                 (triton_tile.int8_scores: K read as 1152 + K, or int8 tensor cores), scores
                 times the keys' scales, summed; V still converted and summed as in 2
    4 + softmax  the online softmax over those scores (running max and sum; lse written)
    5 + P V      P times the V scales into the fp16 dot with 1152 + V (triton_tile.int8_pv): the
                 whole stage 1 of flash-decoding, normalized partial outputs and base-2 lse
    6 + merge    stage 2: triton_decode's split merge, to the attention output

Each step writes a small result that depends on every byte it read (a per-program xor or sum, the
lse, the outputs), and each is checked against a torch computation of the same thing on fresh
random ragged inputs with its outputs poisoned first (step 6 against kernels/reference.py's
attention). A step's time minus the previous one's is what that piece costs; the step that costs
most is the one to redesign. Two readings to keep in mind: steps 2-4 hold V's converted tile in a
(TILE, D) fp32 register accumulator, which step 5's dot replaces (step 5's difference is the dot
net of that accumulator: compare registers with --asm or --ncu); and Triton software-pipelines only
loads that feed a dot, so num_stages changes nothing in steps 0-2 (the same PTX at 1-4 stages,
triton 3.6 and 3.7) and is swept only from step 3 on: the stream kernels keep bytes in flight by
their tile, warps and programs per SM alone.

`--stream` times the stream kinds (bf16 pages; int8 raw words; int8 converted each way) at B64
ctx4096 Hq32 Hkv8 D128, and a contiguous read-only reduction over 2 GiB (the read bandwidth every
percentage is taken against) and torch's device copy (read + write). `--buildup` times each step
at B64 ctx4096, B256 ctx4096 and B1 ctx32768 beside the shipped kernel (paged_decode, int8 and
bf16 pages, default launch table). Sweeps are pruned: tile x splits at 4 warps and 3 stages, then
warps x stages (and for the dot steps the rows) at the best, then the splits again; the other
shapes sweep tile x splits at the first shape's best warps, stages and rows. A time is the median
of --repeats replays of a CUDA graph of 24 calls (how the engine runs decode; no L2 flush between
calls, so inputs smaller than 3x L2 rotate through copies). "% read" is the bytes a kernel must
read (K and V, plus scales where it loads them) over its time, against the contiguous reduction;
"% copy" is attention.py's figure (K, V, scales, q and out against the copy's read + write rate).
The markdown (roofline.md) and JSON (roofline.json) in --out are rewritten after every row, so a
call cut short keeps what it measured; --budget-s stops starting new sweep points in time to write.

`--ncu` runs chosen cases (stream kinds, steps, `shipped-int8`, `shipped-bf16`) once each under
`ncu --set full`, at the launch --best names (a roofline.json of an earlier call), and prints
benchmarks/ncu_decode.py's table: DRAM throughput, registers, achieved warps per SM, stall reasons.
`--asm` compiles the kernels for sm_90 without a GPU (benchmarks/kernel_asm.py's stand-in driver):
registers, spills and shared memory per tile, and the compile time the GPU call will spend.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch

if not torch.cuda.is_available():  # the interpreter must be on before any kernel is defined
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton
import triton.language as tl

import pie.kernels.triton_decode as td
from benchmarks.common import make_parser, require_cuda
from pie.kernels.reference import paged_attention_decode
from pie.kernels.triton_tile import (
    INT8_BIAS,
    int8_biased,
    int8_pv,
    int8_query,
    int8_scores,
    load,
    online_softmax,
)

NEEDS_GPU = False  # read by `pie bench`: --tiny and --asm run on the CPU; the GPU modes check for one
LOG2E = 1.4426950408889634
CONV = {"cvt16": 0, "cvt32": 1, "bias-int": 2, "bias-asm": 3}  # int8 -> float per element (step 2)
KMODE = {"cast": 0, "bias": 1, "imma": 2}  # triton_tile.int8_scores' K_MODE (steps 3-6)


# ---------------------------------------------------------------------------------------- kernels

@triton.jit
def _convert(x, CONV: tl.constexpr, ASM: tl.constexpr):
    """An int8 tile as fp32: x itself (CONV 0 via fp16, 1 directly) or 1152 + x (2 by integer
    ops, 3 by triton_tile's PTX); the caller takes 1152 x the scale sum off once."""
    if CONV == 0:
        return x.to(tl.float16).to(tl.float32)
    elif CONV == 1:
        return x.to(tl.float32)
    elif CONV == 2:
        u = (x.to(tl.uint8, bitcast=True) ^ 0x80).to(tl.uint16) | 0x6400  # fp16 bits of 1024 + (x + 128)
        return u.to(tl.float16, bitcast=True).to(tl.float32)
    else:
        return int8_biased(x, tl.float16, ASM, True).to(tl.float32)


@triton.jit
def _tile(a, b2, sk, sv, m_i, l_i, q, q2, qa, qa2, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_row, h, start, end,
          STEP: tl.constexpr, WORDS: tl.constexpr, KCONV: tl.constexpr, VCONV: tl.constexpr, KMODE: tl.constexpr,
          HKV: tl.constexpr, PAGE: tl.constexpr, W: tl.constexpr, TILE: tl.constexpr, HEAD_MAJOR: tl.constexpr,
          QK_DTYPE: tl.constexpr, PV_DTYPE: tl.constexpr, PRECISION: tl.constexpr, ASM: tl.constexpr,
          MASKED: tl.constexpr):
    """Tokens [start, start + TILE) of one sequence (only those < end when MASKED) into the
    accumulators of STEP: a (the step's own), b2 (V converted, steps 3-4), sk / sv (scale sums),
    m_i / l_i (softmax)."""
    offs_n = start + tl.arange(0, TILE)
    key_ok = offs_n < end
    page = load(bt_row + offs_n // PAGE, key_ok, 0, MASKED).to(tl.int64)
    slot = offs_n % PAGE
    if HEAD_MAJOR:
        row = page * (HKV * PAGE * W) + h * (PAGE * W) + slot * W  # (TILE,) first element of each token's row
    else:
        row = page * (PAGE * HKV * W) + slot * (HKV * W) + h * W
    ptrs = row[:, None] + tl.arange(0, W)[None, :]  # (TILE, W)
    ok = key_ok[:, None]
    srow = page * (HKV * PAGE) + h * PAGE + slot  # scales (num_blocks, HKV, PAGE)
    if STEP <= 1:
        k = load(k_ptr + ptrs, ok, 0, MASKED)
        v = load(v_ptr + ptrs, ok, 0, MASKED)
        if WORDS:
            a = a ^ k ^ v
        else:
            a += k.to(tl.float32) + v.to(tl.float32)
        if STEP == 1:
            sk += load(ks_ptr + srow, key_ok, 0.0, MASKED).to(tl.float32)
            sv += load(vs_ptr + srow, key_ok, 0.0, MASKED).to(tl.float32)
    elif STEP == 2:
        ks = load(ks_ptr + srow, key_ok, 0.0, MASKED).to(tl.float32)
        vs = load(vs_ptr + srow, key_ok, 0.0, MASKED).to(tl.float32)
        k = load(k_ptr + ptrs, ok, 0, MASKED)
        v = load(v_ptr + ptrs, ok, 0, MASKED)
        a += _convert(k, KCONV, ASM) * ks[:, None] + _convert(v, VCONV, ASM) * vs[:, None]
        sk += ks
        sv += vs
    else:
        kt = tl.trans(load(k_ptr + ptrs, ok, 0, MASKED))  # (D, TILE)
        s = int8_scores(q, q2, qa, qa2, kt, KMODE, QK_DTYPE, PRECISION, ASM)  # (BLOCK_M, TILE), log2 units
        s = s * load(ks_ptr + srow, key_ok, 0.0, MASKED).to(tl.float32)[None, :]
        vs = load(vs_ptr + srow, key_ok, 0.0, MASKED).to(tl.float32)
        alpha = l_i  # placeholder below step 4
        p = s
        if STEP == 3:
            a += s
        else:
            if MASKED:
                s = tl.where(key_ok[None, :], s, float("-inf"))
            p, alpha, m_i, l_i = online_softmax(s, m_i, l_i, False)  # a split's first tile shows a key
        v = load(v_ptr + ptrs, ok, 0, MASKED)  # V after the scores, as triton_decode loads it
        if STEP <= 4:
            b2 += _convert(v, VCONV, ASM) * vs[:, None]
            sv += vs
        else:
            a = a * alpha[:, None] + int8_pv(p, v, vs, 2, PV_DTYPE, PRECISION, ASM, False)  # V_MODE 2: 1152 + V
    return a, b2, sk, sv, m_i, l_i


@triton.jit(do_not_specialize=["num_splits"])
def _roofline_kernel(
    q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr, lens_ptr, red_i_ptr, red_f_ptr, part_ptr, lse_ptr,
    qk_scale, stride_bt, num_splits,
    STEP: tl.constexpr, WORDS: tl.constexpr, KCONV: tl.constexpr, VCONV: tl.constexpr, KMODE: tl.constexpr,
    G: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr, PAGE: tl.constexpr, W: tl.constexpr, D: tl.constexpr,
    BLOCK_M: tl.constexpr, TILE: tl.constexpr, HEAD_MAJOR: tl.constexpr, QK_DTYPE: tl.constexpr,
    PV_DTYPE: tl.constexpr, PRECISION: tl.constexpr, ASM: tl.constexpr,
):
    """Split `split` of sequence b for kv head h: the sequence's tiles shared evenly over the
    splits (whole tiles; only its last one masked). Outputs, per program slot (b, h, split):
    red_i (xor of the words, steps 0-1 on int8), red_f[2] (step 0 on 16-bit pages: the sum;
    1: the K and V scale sums; 2: the converted, scaled sum; 3: the scores' sum and V's; 4: V's),
    and per query head lse (steps 4-5) and part (the normalized partial output, step 5)."""
    h = tl.program_id(0)
    b = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(lens_ptr + b)
    per = tl.cdiv(tl.cdiv(seq_len, TILE), num_splits)  # tiles per split
    start = split * per * TILE
    end = tl.minimum(start + per * TILE, seq_len)
    full_end = start + tl.maximum(end - start, 0) // TILE * TILE
    bt_row = bt_ptr + b.to(tl.int64) * stride_bt

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    heads = h * G + offs_m  # the kv head's query heads, padded to BLOCK_M rows
    q = tl.zeros((BLOCK_M, D), tl.float32)
    q2 = q
    qa = tl.zeros((BLOCK_M,), tl.float32)
    qa2 = qa
    if STEP >= 3:  # q pre-scaled by softmax_scale * log2(e), in the form int8_scores' mode takes
        qf = tl.load(q_ptr + b.to(tl.int64) * (HQ * D) + heads[:, None] * D + offs_d[None, :],
                     mask=(offs_m < G)[:, None], other=0.0).to(tl.float32) * qk_scale
        if KMODE == 2:  # int8 tensor cores: q = qa * q1 + qa2 * q2, two int8 terms per head
            q, q2, qa, qa2 = int8_query(qf)
        else:
            q = qf.to(QK_DTYPE)
            q2 = q
            if KMODE == 1:
                qa = INT8_BIAS * tl.sum(q.to(tl.float32), axis=1)

    if STEP <= 1 and WORDS:
        a = tl.zeros((TILE, W), tl.int32)
    elif STEP <= 2:
        a = tl.zeros((TILE, W), tl.float32)
    elif STEP <= 4:
        a = tl.zeros((BLOCK_M, TILE), tl.float32)
    else:
        a = tl.zeros((BLOCK_M, D), tl.float32)
    b2 = tl.zeros((TILE, D), tl.float32)
    sk = tl.zeros((TILE,), tl.float32)
    sv = tl.zeros((TILE,), tl.float32)
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    for t in range(start, full_end, TILE):
        a, b2, sk, sv, m_i, l_i = _tile(
            a, b2, sk, sv, m_i, l_i, q, q2, qa, qa2, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_row, h, t, end,
            STEP, WORDS, KCONV, VCONV, KMODE, HKV, PAGE, W, TILE, HEAD_MAJOR, QK_DTYPE, PV_DTYPE, PRECISION, ASM,
            False)
    if full_end < end:
        a, b2, sk, sv, m_i, l_i = _tile(
            a, b2, sk, sv, m_i, l_i, q, q2, qa, qa2, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_row, h, full_end, end,
            STEP, WORDS, KCONV, VCONV, KMODE, HKV, PAGE, W, TILE, HEAD_MAJOR, QK_DTYPE, PV_DTYPE, PRECISION, ASM,
            True)

    slot_ = (b.to(tl.int64) * HKV + h) * num_splits + split
    v_bias = 0.0
    if VCONV >= 2:
        v_bias = INT8_BIAS * D * tl.sum(sv, axis=0)
    if STEP <= 1:
        if WORDS:
            tl.store(red_i_ptr + slot_, tl.xor_sum(tl.xor_sum(a, axis=1), axis=0))
        else:
            tl.store(red_f_ptr + 2 * slot_, tl.sum(tl.sum(a, axis=1), axis=0))
        if STEP == 1:
            tl.store(red_f_ptr + 2 * slot_, tl.sum(sk, axis=0))
            tl.store(red_f_ptr + 2 * slot_ + 1, tl.sum(sv, axis=0))
    elif STEP == 2:
        k_bias = 0.0
        if KCONV >= 2:
            k_bias = INT8_BIAS * W * tl.sum(sk, axis=0)
        tl.store(red_f_ptr + 2 * slot_, tl.sum(tl.sum(a, axis=1), axis=0) - k_bias - v_bias)
    elif STEP == 3:
        tl.store(red_f_ptr + 2 * slot_, tl.sum(tl.sum(a, axis=1), axis=0))
        tl.store(red_f_ptr + 2 * slot_ + 1, tl.sum(tl.sum(b2, axis=1), axis=0) - v_bias)
    else:
        rows = (b.to(tl.int64) * HQ + heads) * num_splits + split  # (BLOCK_M,) into (B, HQ, splits)
        has = l_i > 0.0  # an empty split: lse -inf, part 0
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + rows, lse, mask=offs_m < G)
        if STEP == 4:
            tl.store(red_f_ptr + 2 * slot_ + 1, tl.sum(tl.sum(b2, axis=1), axis=0) - v_bias)
        else:
            o = a / tl.where(has, l_i, 1.0)[:, None]
            tl.store(part_ptr + rows[:, None] * D + offs_d[None, :], o, mask=(offs_m < G)[:, None])


@triton.jit
def _contig_kernel(x_ptr, out_ptr, words_per_prog, BLOCK: tl.constexpr):
    """Program p xors words [p * words_per_prog, (p + 1) * words_per_prog) of x (int32): the
    read-only bandwidth every percentage is taken against."""
    base = x_ptr + tl.program_id(0).to(tl.int64) * words_per_prog
    acc = tl.zeros((BLOCK,), tl.int32)
    for i in range(0, words_per_prog, BLOCK):
        acc = acc ^ tl.load(base + i + tl.arange(0, BLOCK))
    tl.store(out_ptr + tl.program_id(0), tl.xor_sum(acc, axis=0))


# ----------------------------------------------------------------------------- what is launched

@dataclass(frozen=True)
class Dims:
    """Head counts, head dim and page size of every launch."""

    hq: int
    hkv: int
    d: int
    page: int


GPU_DIMS = Dims(32, 8, 128, 16)
TINY_DIMS = Dims(4, 2, 32, 16)


@dataclass(frozen=True)
class Spec:
    """One row: a stream kind or a build-up step and its conversions."""

    key: str
    step: int  # 0..6 (see the docstring)
    pages: str = "int8"  # "int8" or "bf16" (step 0 only)
    kconv: str = "cvt16"  # step 2: K's conversion (a key of CONV)
    vconv: str = "bias-asm"  # steps 2-4: V's conversion
    kmode: str = "bias"  # steps 3-6: a key of KMODE
    head_major: bool = False
    prev: str = ""  # the row this one adds a piece to (its time difference is the piece's cost)
    what: str = ""

    @property
    def words(self) -> bool:
        return self.step <= 1 and self.pages == "int8"


@dataclass(frozen=True)
class Launch:
    """Launch parameters of one timed point."""

    tile: int
    warps: int
    stages: int
    splits: int
    rows: int = 16  # BLOCK_M, the dot's query rows (steps 3-6)

    def text(self) -> str:
        return f"{self.tile} / {self.warps} / {self.stages} / {self.splits} / {self.rows}"


def stream_specs(head_major: bool) -> list[Spec]:
    kinds = [Spec("bf16", 0, pages="bf16", what="bf16 pages, summed in fp32"),
             Spec("int8-raw", 0, what="int8 pages as 32-bit words, xor (no conversion)")]
    kinds += [Spec(f"int8-{c}", 2, kconv=c, vconv=c, what=f"int8 converted ({c}), times the scales")
              for c in ("cvt16", "cvt32", "bias-int", "bias-asm")]
    if head_major:
        kinds += [replace(s, key=f"{s.key}-hm", head_major=True, what=s.what + ", head-major pages") for s in kinds]
    return kinds


def buildup_specs(kmodes: list[str]) -> list[Spec]:
    """The rows of the build-up, most telling first (a call cut short keeps those)."""
    rows = [Spec("step0", 0, what="stream (int8 words)"),
            Spec("step1", 1, prev="step0", what="+ scales"),
            Spec("step2-bias-asm", 2, kconv="bias-asm", vconv="bias-asm", prev="step1", what="+ convert (1152 + x, PTX)")]
    for m in kmodes:
        rows += [Spec(f"step3-{m}", 3, kmode=m, prev="step2-bias-asm", what=f"+ QK^T (K {m})"),
                 Spec(f"step4-{m}", 4, kmode=m, prev=f"step3-{m}", what="+ online softmax"),
                 Spec(f"step5-{m}", 5, kmode=m, prev=f"step4-{m}", what="+ P V (stage 1 whole)"),
                 Spec(f"step6-{m}", 6, kmode=m, prev=f"step5-{m}", what="+ split merge (stage 2)")]
    rows += [Spec("step2-cvt16", 2, kconv="cvt16", vconv="cvt16", prev="step1", what="+ convert (.to(fp16))"),
             Spec("step2-bias-int", 2, kconv="bias-int", vconv="bias-int", prev="step1",
                  what="+ convert (1152 + x, integer ops)")]
    return rows


@dataclass
class Inputs:
    """Random paged inputs: shuffled pages, one block-table row per sequence."""

    dims: Dims
    q: torch.Tensor  # (B, HQ, D) bf16 on the GPU, fp32 in the interpreter
    k: torch.Tensor  # (num_blocks, PAGE, HKV, D) int8; v the same
    v: torch.Tensor
    ks: torch.Tensor  # (num_blocks, HKV, PAGE) fp16; vs the same
    vs: torch.Tensor
    table: torch.Tensor  # (B, max_blocks) int32, columns a multiple of 16 (one compile for every shape)
    lens: torch.Tensor  # (B,) int32
    k16: torch.Tensor | None = None  # bf16 pages, for the bf16 stream
    v16: torch.Tensor | None = None
    hm: dict | None = None  # head-major copies (num_blocks, HKV, PAGE, D) by name

    @property
    def batch(self) -> int:
        return self.q.shape[0]

    def pages(self, spec: Spec) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(K, V, row width W in elements) as the spec's kernel reads them."""
        src = self.hm if spec.head_major else {"k": self.k, "v": self.v, "k16": self.k16, "v16": self.v16}
        assert src is not None, "head-major pages not made"
        if spec.pages == "bf16":
            return src["k16"], src["v16"], self.dims.d
        if spec.words:
            return src["k"].view(torch.int32), src["v"].view(torch.int32), self.dims.d // 4
        return src["k"], src["v"], self.dims.d


def make_inputs(dims: Dims, lens: list[int], device: str, gen: torch.Generator, bf16: bool = False,
                head_major: bool = False, q_dtype: torch.dtype | None = None) -> Inputs:
    """Sequences of `lens` keys over shuffled pages: int8 K/V (every value -128..127), fp16 scales
    in [0.001, 0.021), q (B, HQ, D) in q_dtype (default: bf16 on the GPU, fp32 in the interpreter),
    and bf16 pages and head-major copies where asked."""
    page = dims.page
    if device != "cpu":  # large inputs are drawn on the device (seeded from gen: a run replays)
        gen = torch.Generator(device).manual_seed(int(torch.randint(2**62, (1,), generator=gen)))
    nbs = [td.cdiv(n, page) for n in lens]
    nb = sum(nbs)
    perm = torch.randperm(nb, generator=gen, device=device).int().cpu()
    width = td.cdiv(max(nbs), 16) * 16
    table = torch.zeros(len(lens), width, dtype=torch.int32)
    used = 0
    for i, n in enumerate(nbs):
        table[i, :n] = perm[used:used + n]
        used += n
    shape = (nb, page, dims.hkv, dims.d)

    def rand_int8():
        return torch.randint(-128, 128, shape, dtype=torch.int8, generator=gen, device=device)

    def rand_scale():
        return (torch.rand(nb, dims.hkv, page, generator=gen, device=device) * 0.02 + 0.001).half()

    k, v, ks, vs = rand_int8(), rand_int8(), rand_scale(), rand_scale()  # drawn where they are used
    q_dtype = q_dtype or (torch.bfloat16 if device == "cuda" else torch.float32)
    q = torch.randn(len(lens), dims.hq, dims.d, generator=gen, device=device).to(q_dtype)
    k16 = v16 = None
    if bf16:
        k16 = torch.randn(shape, generator=gen, device=device).bfloat16()
        v16 = torch.randn(shape, generator=gen, device=device).bfloat16()
    x = Inputs(dims, q, k, v, ks, vs, table, torch.tensor(lens, dtype=torch.int32), k16, v16)
    if head_major:
        x.hm = {name: t.transpose(1, 2).contiguous() for name, t in
                (("k", k), ("v", v), ("k16", k16), ("v16", v16)) if t is not None}
    for name, t in vars(x).items():  # to the device
        if isinstance(t, torch.Tensor):
            setattr(x, name, t.to(device))
    if x.hm:
        x.hm = {name: t.to(device) for name, t in x.hm.items()}
    return x


@dataclass
class Outputs:
    """What the kernels write, for one (batch, splits)."""

    red_i: torch.Tensor  # (B, HKV, splits) int32
    red_f: torch.Tensor  # (B, HKV, splits, 2) fp32
    part: torch.Tensor  # (B, HQ, splits, D) fp32
    lse: torch.Tensor  # (B, HQ, splits) fp32
    out: torch.Tensor  # (B, HQ, D) q.dtype

    @staticmethod
    def make(x: Inputs, splits: int) -> Outputs:
        b, d, dev = x.batch, x.dims, x.q.device
        return Outputs(torch.zeros(b, d.hkv, splits, dtype=torch.int32, device=dev),
                       torch.zeros(b, d.hkv, splits, 2, device=dev),
                       torch.zeros(b, d.hq, splits, d.d, device=dev), torch.zeros(b, d.hq, splits, device=dev),
                       torch.zeros_like(x.q))

    def poison(self) -> None:
        for t in (self.red_f, self.part, self.lse, self.out):
            t.fill_(float("nan"))
        self.red_i.fill_(0x5A5A5A5A)


def launch(spec: Spec, x: Inputs, lc: Launch, o: Outputs, warmup: bool = False):
    """One call of the spec's kernels (step 6: stage 1, then triton_decode's stage 2); with
    warmup, compile stage 1 only (the --asm mode)."""
    dims = x.dims
    on_gpu = x.q.device.type == "cuda" or warmup
    k, v, w = x.pages(spec)
    half = tl.float16 if on_gpu else tl.float32  # the interpreter's dots in fp32 (its bf16/fp16 math is not the GPU's)
    grid = (dims.hkv, x.batch, lc.splits)
    args = (x.q, k, v, x.ks, x.vs, x.table, x.lens, o.red_i, o.red_f, o.part, o.lse,
            dims.d ** -0.5 * LOG2E, x.table.stride(0), lc.splits)
    # the switches a step does not read are 0: one compile for the same code
    kw = dict(STEP=min(spec.step, 5), WORDS=spec.words, KCONV=CONV[spec.kconv] if spec.step == 2 else 0,
              VCONV=CONV[spec.vconv] if 2 <= spec.step <= 4 else 0, KMODE=KMODE[spec.kmode] if spec.step >= 3 else 0,
              G=dims.hq // dims.hkv, HQ=dims.hq, HKV=dims.hkv, PAGE=dims.page, W=w, D=dims.d,
              BLOCK_M=lc.rows, TILE=lc.tile, HEAD_MAJOR=spec.head_major, QK_DTYPE=half, PV_DTYPE=half,
              PRECISION=None if on_gpu else "ieee", ASM=on_gpu, num_warps=lc.warps, num_stages=lc.stages)
    if warmup:
        return _roofline_kernel.warmup(*args, grid=grid, **kw)
    _roofline_kernel[grid](*args, **kw)
    if spec.step == 6:
        assert lc.splits >= 2, "stage 2 merges two splits or more"
        td._decode_stage2[(x.batch, dims.hq)](
            o.part, o.lse, o.out, x.lens, o.out.stride(0), o.out.stride(1), lc.splits,
            HQ=dims.hq, SPLIT_TOKENS=0, SPLITS_P2=td.next_pow2(lc.splits), D=dims.d, D_PAD=dims.d,
            WINDOW=0, BLOCK_N=16, MIN_TILES=1,  # (every split merged: the window and tile go unread)
            num_warps=4 if lc.splits <= 64 else 8)
    return None


def read_bytes(spec: Spec, dims: Dims, tokens: int) -> int:
    """What the spec's kernel must read for `tokens` keys of every kv head: K and V (and scales)."""
    kv = 2 * tokens * dims.hkv * dims.d * (2 if spec.pages == "bf16" else 1)
    return kv + (2 * tokens * dims.hkv * 2 if spec.step >= 1 else 0)


# ------------------------------------------------------------------------- the torch reference

def split_range(n: int, tile: int, splits: int, s: int) -> tuple[int, int]:
    per = td.cdiv(td.cdiv(n, tile), splits)
    lo = min(s * per * tile, n)
    return lo, min(lo + per * tile, n)


def expected(spec: Spec, x: Inputs, lc: Launch) -> dict[str, torch.Tensor]:
    """What the spec's kernel must write, in float64 on the CPU (xor in int32), with `mag`: the
    sum of absolute terms behind each red_f entry (its rounding scale; the biased conversions sum
    1152 + x)."""
    dims, g = x.dims, x.dims.hq // x.dims.hkv
    k_bias = 1152.0 if CONV[spec.kconv] >= 2 else 0.0
    v_bias = 1152.0 if CONV[spec.vconv] >= 2 else 0.0
    k, v, _ = x.pages(spec)
    k, v = k.cpu(), v.cpu()
    ks, vs, table = x.ks.cpu().double(), x.vs.cpu().double(), x.table.cpu().long()
    qs = x.q.cpu().double() * (dims.d ** -0.5 * LOG2E)
    lens = x.lens.tolist()
    b_n, s_n = len(lens), lc.splits
    red_i = torch.zeros(b_n, dims.hkv, s_n, dtype=torch.int32)
    red_f = torch.zeros(b_n, dims.hkv, s_n, 2, dtype=torch.float64)
    mag = torch.zeros_like(red_f)
    lse = torch.full((b_n, dims.hq, s_n), float("-inf"), dtype=torch.float64)
    part = torch.zeros(b_n, dims.hq, s_n, dims.d, dtype=torch.float64)
    for b, n in enumerate(lens):
        pos = torch.arange(n)
        pages, slots = table[b, pos // dims.page], pos % dims.page
        if spec.head_major:
            kg, vg = k[pages, :, slots], v[pages, :, slots]  # (n, HKV, W)
        else:
            kg, vg = k[pages, slots], v[pages, slots]
        ksg, vsg = ks[pages, :, slots], vs[pages, :, slots]  # (n, HKV)
        for h in range(dims.hkv):
            for s in range(s_n):
                lo, hi = split_range(n, lc.tile, s_n, s)
                kk, vv, kss, vss = kg[lo:hi, h], vg[lo:hi, h], ksg[lo:hi, h], vsg[lo:hi, h]
                if spec.words:
                    red_i[b, h, s] = int(np.bitwise_xor.reduce(torch.cat([kk, vv]).reshape(-1).numpy(), initial=0))
                kd, vd = kk.double(), vv.double()
                if spec.step == 0 and not spec.words:
                    red_f[b, h, s, 0] = (kd + vd).sum()
                    mag[b, h, s, 0] = (kd.abs() + vd.abs()).sum()
                elif spec.step == 1:
                    red_f[b, h, s] = torch.stack([kss.sum(), vss.sum()])
                    mag[b, h, s] = red_f[b, h, s]
                elif spec.step == 2:
                    red_f[b, h, s, 0] = (kd * kss[:, None]).sum() + (vd * vss[:, None]).sum()
                    mag[b, h, s, 0] = (((kd.abs() + k_bias) * kss[:, None]).sum()
                                       + ((vd.abs() + v_bias) * vss[:, None]).sum())
                if spec.step in (3, 4):
                    red_f[b, h, s, 1] = (vd * vss[:, None]).sum()
                    mag[b, h, s, 1] = ((vd.abs() + v_bias) * vss[:, None]).sum()
                if spec.step >= 3:
                    qh = qs[b, h * g:(h + 1) * g]  # (G, D)
                    sc = (qh @ kd.T) * kss[None, :]  # (G, n_split)
                    if spec.step == 3:
                        red_f[b, h, s, 0] = sc.sum()
                        mag[b, h, s, 0] = ((qh.abs() @ kd.abs().T) * kss[None, :]).sum()
                    elif hi > lo:
                        m = sc.max(dim=1, keepdim=True).values
                        p = torch.exp2(sc - m)
                        lse[b, h * g:(h + 1) * g, s] = m[:, 0] + torch.log2(p.sum(1))
                        part[b, h * g:(h + 1) * g, s] = (p @ (vd * vss[:, None])) / p.sum(1, keepdim=True)
    return dict(red_i=red_i, red_f=red_f, mag=mag, lse=lse, part=part)


def check(spec: Spec, x: Inputs, lc: Launch) -> float:
    """The largest error of the spec's kernel on x, each output against its own scale (inf for
    an unwritten output or a wrong xor): red_f over its terms' magnitude, lse in log2 units, part
    and out over the largest |value|."""
    o = Outputs.make(x, lc.splits)
    o.poison()
    launch(spec, x, lc, o)
    ref = expected(spec, x, lc)
    err = 0.0
    if spec.words:
        if not torch.equal(o.red_i.cpu(), ref["red_i"]):
            return float("inf")
    f = o.red_f.cpu().double()
    written = {0: [] if spec.words else [0], 1: [0, 1], 2: [0], 3: [0, 1], 4: [1]}  # red_f columns by step
    for c in written.get(spec.step, []):
        got, want, scale = f[..., c], ref["red_f"][..., c], ref["mag"][..., c] + 1e-30
        if not torch.isfinite(got).all():
            return float("inf")
        err = max(err, ((got - want).abs() / scale).max().item())
    if spec.step >= 4:
        got, want = o.lse.cpu().double(), ref["lse"]
        if torch.isnan(got).any() or not torch.equal(torch.isinf(got), torch.isinf(want)):
            return float("inf")
        fin = torch.isfinite(want)
        err = max(err, (got[fin] - want[fin]).abs().max().item() if fin.any() else 0.0)
    if spec.step == 5:
        got, want = o.part.cpu().double(), ref["part"]
        if not torch.isfinite(got).all():
            return float("inf")
        err = max(err, ((got - want).abs().max() / want.abs().max()).item())
    if spec.step == 6:
        want = paged_attention_decode(x.q.float(), x.k, x.v, x.ks, x.vs, x.table, x.lens, x.dims.d ** -0.5).double()
        got = o.out.double()
        if not torch.isfinite(got).all():
            return float("inf")
        err = max(err, ((got - want).abs().max() / want.abs().max()).item())
    return err


def contig_reference(words_per_prog: int, buf: torch.Tensor) -> torch.Tensor:
    """The contiguous kernel's xor per program."""
    a = buf.cpu().numpy().reshape(-1, words_per_prog)
    return torch.from_numpy(np.bitwise_xor.reduce(a, axis=1).astype(np.int32))


# -------------------------------------------------------------------------------------- timing

class Clock:
    """Times a call: on the GPU the median of `repeats` replays of a CUDA graph of CALLS calls,
    cycling through the input sets; in the interpreter one call's wall time (meaningless as a
    figure, it only exercises the path)."""

    CALLS = 24

    def __init__(self, on_gpu: bool, repeats: int) -> None:
        self.on_gpu, self.repeats = on_gpu, repeats

    def ms(self, calls: list) -> float:
        if not self.on_gpu:
            t0 = time.perf_counter()
            calls[0]()
            return (time.perf_counter() - t0) * 1e3
        for fn in calls:  # compile and load outside the capture
            fn()
        torch.cuda.synchronize()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                for i in range(self.CALLS):
                    calls[i % len(calls)]()
        torch.cuda.current_stream().wait_stream(stream)
        times = []
        for _ in range(self.repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / self.CALLS)
        del graph
        return statistics.median(times)


class Budget:
    """Wall seconds left before the sweeps stop starting new points."""

    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def over(self) -> bool:
        return time.monotonic() > self.end


@dataclass(frozen=True)
class Space:
    """The launch values a sweep tries."""

    tiles: tuple[int, ...]
    splits: tuple[int, ...]
    warps: tuple[int, ...]
    stages: tuple[int, ...]
    base: tuple[int, int] = (4, 3)  # warps, stages of the first phase


def sweep(measure, space: Space, budget: Budget, rows: tuple[int, ...] = (16,), fixed: Launch | None = None) -> dict:
    """{Launch: ms or an error text}; `measure` returns None for a point that does not apply.
    Without `fixed`: tile x splits at the base warps and stages, then warps x stages (and `rows`)
    at the best, then the splits again at the best. With `fixed`: tile x splits at fixed's warps,
    stages and rows."""
    res: dict[Launch, float | str] = {}
    skipped: set[Launch] = set()

    def run(lc: Launch) -> None:
        if lc in res or lc in skipped or budget.over():
            return
        try:
            ms = measure(lc)
        except Exception as exc:  # noqa: BLE001 - a point that does not compile or run is reported
            res[lc] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:100] if str(exc) else ''}"
            return
        if ms is None:
            skipped.add(lc)
        else:
            res[lc] = ms

    w0, s0 = (fixed.warps, fixed.stages) if fixed else space.base
    r0 = fixed.rows if fixed else rows[0]
    for tile in space.tiles:
        for splits in space.splits:
            run(Launch(tile, w0, s0, splits, r0))
    if fixed is not None:
        return res
    top = best_of(res)[0]
    if top is None:
        return res
    for w in space.warps:
        for st in space.stages:
            run(replace(top, warps=w, stages=st))
    top = best_of(res)[0] or top
    for r in rows:
        run(replace(top, rows=r))
    top = best_of(res)[0] or top
    for splits in space.splits:
        run(replace(top, splits=splits))
    return res


def best_of(res: dict) -> tuple[Launch | None, float]:
    """The fastest point of a sweep and its time (None, inf where none ran)."""
    timed = [(ms, lc) for lc, ms in res.items() if isinstance(ms, float)]
    if not timed:
        return None, float("inf")
    ms, lc = min(timed, key=lambda t: t[0])
    return lc, ms


# ------------------------------------------------------------------------------------- reports

class Report:
    """The markdown and JSON in --out, rewritten after every line and row."""

    def __init__(self, out_dir: str, name: str = "roofline") -> None:
        os.makedirs(out_dir, exist_ok=True)
        self.md, self.js = os.path.join(out_dir, f"{name}.md"), os.path.join(out_dir, f"{name}.json")
        self.lines: list[str] = []
        self.data: dict = {"stream": {}, "buildup": {}, "best": {}, "checks": {}, "errors": {}}

    def log(self, msg: str = "") -> None:
        print(msg, flush=True)
        self.lines.append(msg)
        self.save()

    def save(self) -> None:
        with open(self.md, "w") as f:
            f.write("\n".join(self.lines) + "\n")
        with open(self.js, "w") as f:
            json.dump(self.data, f, indent=1)


def pct(x: float) -> str:
    return f"{100 * x:.0f}%"


# ------------------------------------------------------------------------------------ the modes

@dataclass(frozen=True)
class Setup:
    """What every mode shares: sizes and the sweep space, by --tiny."""

    dims: Dims
    device: str
    stream_shape: tuple[int, int]  # batch, ctx
    shapes: tuple[tuple[int, int], ...]  # the build-up's
    space: Space
    contig_words: int  # int32 words of the contiguous reduction
    check_lens: tuple[int, ...]  # ragged: one key, a partial split, empty splits
    check_launch: Launch


def make_setup(tiny: bool, shapes: str | None, device: str) -> Setup:
    def parse(text: str) -> tuple[tuple[int, int], ...]:
        return tuple((int(b), int(c)) for b, c in (s.split("x") for s in text.split(",")))

    if tiny:
        return Setup(TINY_DIMS, device, (2, 64), parse(shapes or "2x64"), Space((16, 32), (2, 4), (4,), (2,), (4, 2)),
                     1 << 14, (1, 45, 100), Launch(32, 4, 2, 3, 16))
    return Setup(GPU_DIMS, device, (64, 4096), parse(shapes or "64x4096,256x4096,1x32768"),
                 Space((16, 32, 64, 128), (4, 8, 16, 32, 64, 128), (2, 4, 8), (2, 3, 4)), 1 << 29, (1, 45, 300),
                 Launch(32, 4, 3, 3, 16))


def space_for(setup: Setup, spec: Spec, batch: int) -> Space:
    """The sweep of one row at one batch size. Stages only for the dot steps: Triton pipelines
    only loads that feed a dot, and the stream kernels' PTX is the same at 1-4 stages (--asm,
    triton 3.6 and 3.7). Splits by the programs a split gives (batch x kv heads): a few sequences
    need more splits each, many fewer."""
    space = setup.space
    if spec.step <= 2:
        space = replace(space, stages=(space.base[1],))
    if setup.device == "cuda":
        programs = batch * setup.dims.hkv
        if programs < 64:
            space = replace(space, splits=(16, 32, 64, 128, 256))
        elif programs >= 1024:
            space = replace(space, splits=(2, 4, 8, 16, 32, 64))
    return space


def input_sets(setup: Setup, batch: int, ctx: int, gen: torch.Generator, bf16: bool = False,
               head_major: bool = False) -> list[Inputs]:
    """Enough copies of the inputs that back-to-back calls do not find them in L2 (3x its size)."""
    n = 1
    if setup.device == "cuda":
        l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 << 20)
        n = max(1, min(4, math.ceil(3 * l2 / read_bytes(Spec("x", 1), setup.dims, batch * ctx))))
    return [make_inputs(setup.dims, [ctx] * batch, setup.device, gen, bf16, head_major) for _ in range(n)]


def bandwidths(setup: Setup, clock: Clock, rep: Report) -> tuple[float, float]:
    """(contiguous read-only bytes/s, best over a small sweep and checked; torch copy read + write
    bytes/s)."""
    dev, words = setup.device, setup.contig_words
    buf = torch.randint(-2**31, 2**31 - 1, (words,), dtype=torch.int32, device=dev)
    full = words >= 1 << 24  # not --tiny
    points = [(chunk, block, w) for chunk in ((1 << 14, 1 << 16, 1 << 18) if full else (1 << 12,))
              for block in ((1024, 4096) if full else (256,)) for w in ((4, 8) if full else (4,))]
    best = float("inf")
    for n, (chunk, block, w) in enumerate(points):
        out = torch.zeros(words // chunk, dtype=torch.int32, device=dev)

        def fn(chunk=chunk, block=block, w=w, out=out):
            _contig_kernel[(words // chunk,)](buf, out, chunk, BLOCK=block, num_warps=w)

        if n == 0:
            fn()
            assert torch.equal(out.cpu(), contig_reference(chunk, buf)), "the contiguous reduction is wrong"
        best = min(best, clock.ms([fn]))
    read_bw = 4 * words / (best * 1e-3)
    dst = torch.empty_like(buf)
    copy_bw = 2 * 4 * words / (clock.ms([lambda: dst.copy_(buf)]) * 1e-3)
    rep.data["read_bw"], rep.data["copy_bw"] = read_bw, copy_bw
    rep.log(f"contiguous read-only reduction over {4 * words >> 20} MiB: {read_bw / 1e9:,.0f} GB/s (best of "
            f"{len(points)} launches); torch copy (read + write): {copy_bw / 1e9:,.0f} GB/s")
    return read_bw, copy_bw


def run_checks(specs: list[Spec], setup: Setup, rep: Report, gen: torch.Generator) -> None:
    """Each spec against torch on fresh ragged inputs (three splits: partial and empty ones)."""
    x = make_inputs(setup.dims, list(setup.check_lens), setup.device, gen,
                    bf16=any(s.pages == "bf16" for s in specs), head_major=any(s.head_major for s in specs))
    for spec in specs:
        try:
            err = check(spec, x, setup.check_launch)
        except Exception as exc:  # noqa: BLE001 - reported, and the row is still timed
            err = float("inf")
            rep.data["errors"][f"check {spec.key}"] = f"{type(exc).__name__}: {exc}"[:300]
        rep.data["checks"][spec.key] = err
        rep.log(f"check {spec.key:16s} {err:.2e} {'ok' if err <= tolerance(spec, setup.device) else 'FAIL'}")


def tolerance(spec: Spec, device: str) -> float:
    """A check's bound: fp16 operands (and q in two int8 terms) in the GPU's dots; the
    interpreter's fp32 dots, q's int8 terms still rounded; fp32 sums of exact values."""
    if spec.step >= 3:
        return 2e-2 if device == "cuda" else 1e-3
    return 1e-5


def timed_rows(specs: list[Spec], setup: Setup, xs: list[Inputs], clock: Clock, budget: Budget,
               fixed: dict[str, Launch] | None = None):
    """Sweep each spec over xs (one shape): yields (spec, {Launch: ms or error text})."""
    batch, ctx = xs[0].batch, int(xs[0].lens[0])
    rows = tuple(sorted({16, td.next_pow2(setup.dims.hq // setup.dims.hkv)}, reverse=True))
    outs: dict[int, Outputs] = {}
    for spec in specs:
        def measure(lc: Launch, spec=spec) -> float | None:
            if lc.splits > td.cdiv(ctx, lc.tile) or (spec.step == 6 and lc.splits < 2):
                return None  # splits without a tile, or nothing to merge
            o = outs.setdefault(lc.splits, Outputs.make(xs[0], lc.splits))
            return clock.ms([lambda x=x: launch(spec, x, lc, o) for x in xs])

        yield spec, sweep(measure, space_for(setup, spec, batch), budget, rows if spec.step >= 3 else (16,),
                          (fixed or {}).get(spec.key))


def run_stream(setup: Setup, args, clock: Clock, rep: Report, budget: Budget, bw: tuple[float, float]) -> None:
    read_bw, copy_bw = bw
    specs = [s for s in stream_specs(args.head_major) if not args.kinds or s.key in args.kinds.split(",")]
    gen = torch.Generator().manual_seed(args.seed)
    rep.log("\n## checks of the stream kinds (max error over its scale; ragged lengths, 3 splits)")
    run_checks(specs, setup, rep, gen)
    batch, ctx = setup.stream_shape
    xs = input_sets(setup, batch, ctx, gen, bf16=any(s.pages == "bf16" for s in specs), head_major=args.head_major)
    rep.log(f"\n## stream: B{batch} ctx{ctx} Hkv{setup.dims.hkv} D{setup.dims.d}, page {setup.dims.page}, "
            f"shuffled pages, {len(xs)} input set(s)")
    rep.log("| kind | ms | GB/s | % read | % copy | tile / warps / stages / splits | points |")
    rep.log("|---|---|---|---|---|---|---|")
    for spec, res in timed_rows(specs, setup, xs, clock, budget):
        lc, ms = best_of(res)
        nbytes = read_bytes(spec, setup.dims, batch * ctx)
        per_tile = {}
        for tile in setup.space.tiles:
            lt, mt = best_of({k: v for k, v in res.items() if k.tile == tile})
            if lt is not None:
                per_tile[tile] = dict(ms=mt, launch=asdict(lt), read_frac=nbytes / (mt * 1e-3) / read_bw)
        rep.data["stream"][spec.key] = dict(what=spec.what, ms=ms, bytes=nbytes, launch=lc and asdict(lc),
                                            per_tile=per_tile, points={k.text(): v for k, v in res.items()})
        if lc is None:
            rep.log(f"| {spec.key} | - | | | | | {len(res)}: {next(iter(res.values()), 'over budget')} |")
            continue
        rep.data["best"].setdefault("stream", {})[spec.key] = asdict(lc)
        rate = nbytes / (ms * 1e-3)
        rep.log(f"| {spec.key} | {ms:.4f} | {rate / 1e9:,.0f} | {pct(rate / read_bw)} | {pct(rate / copy_bw)} | "
                f"{lc.tile} / {lc.warps} / {lc.stages} / {lc.splits} | {len(res)} |")
    xs.clear()
    rep.log("\n## stream, best per tile (ms, % read, warps / splits)")
    for key, entry in rep.data["stream"].items():
        cells = [f"{t} tok {v['ms']:.4f} {pct(v['read_frac'])} ({v['launch']['warps']} / {v['launch']['splits']})"
                 for t, v in entry["per_tile"].items()]
        rep.log(f"- {key}: " + "; ".join(cells))


def run_buildup(setup: Setup, args, clock: Clock, rep: Report, budget: Budget, bw: tuple[float, float]) -> None:
    read_bw, copy_bw = bw
    specs = [s for s in buildup_specs(args.kmodes.split(",")) if not args.steps or s.key in args.steps.split(",")]
    gen = torch.Generator().manual_seed(args.seed + 1)
    rep.log("\n## checks of the build-up steps (max error over its scale; step 6 against the fp32 reference "
            "attention; ragged lengths, 3 splits)")
    run_checks(specs, setup, rep, gen)
    dims = setup.dims
    first: dict[str, Launch] = {}  # the first shape's best: the other shapes sweep tile x splits at it
    for batch, ctx in setup.shapes:
        label = f"B{batch} ctx{ctx}"
        xs = input_sets(setup, batch, ctx, gen, bf16=True)
        tokens = batch * ctx
        int8_bytes = 2 * tokens * dims.hkv * dims.d
        qo_bytes = 2 * xs[0].q.numel() * xs[0].q.element_size()
        table = rep.data["buildup"].setdefault(label, {})
        rep.log(f"\n## build-up: {label} Hq{dims.hq} Hkv{dims.hkv} D{dims.d}, {len(xs)} input set(s); % read: int8 "
                f"K+V bytes over the contiguous read rate; % copy: attention.py's")
        rep.log("| row | step | ms | + ms | % read | % copy | tile / warps / stages / splits / rows | points |")
        rep.log("|---|---|---|---|---|---|---|---|")
        x = xs[0]
        for name, k, v, ks, vs in (("shipped-int8", x.k, x.v, x.ks, x.vs), ("shipped-bf16", x.k16, x.v16, None, None)):
            out = torch.empty_like(x.q)
            ms = clock.ms([lambda k=k, v=v, ks=ks, vs=vs, out=out: td.paged_decode(
                x.q, k, v, ks, vs, x.table, x.lens, dims.d ** -0.5, max_seq_len=ctx, out=out)])
            nbytes = 2 * k.numel() * k.element_size() + (2 * ks.numel() * 2 if ks is not None else 0) + qo_bytes
            table[name] = dict(ms=ms)
            rep.log(f"| {name} | paged_decode, its launch table | {ms:.4f} | | "
                    f"{pct(int8_bytes / (ms * 1e-3) / read_bw)} | {pct(nbytes / (ms * 1e-3) / copy_bw)} | | |")
        for spec, res in timed_rows(specs, setup, xs, clock, budget, first):
            lc, ms = best_of(res)
            table[spec.key] = dict(what=spec.what, ms=ms, launch=lc and asdict(lc),
                                   points={k.text(): v for k, v in res.items()})
            if lc is None:
                rep.log(f"| {spec.key} | {spec.what} | - | | | | | {len(res)}: {next(iter(res.values()), 'over budget')} |")
                continue
            first.setdefault(spec.key, lc)
            rep.data["best"].setdefault(label, {})[spec.key] = asdict(lc)
            prev = table.get(spec.prev, {}).get("ms", math.inf)
            nbytes = read_bytes(spec, dims, tokens) + (qo_bytes if spec.step >= 3 else 0)
            rep.log(f"| {spec.key} | {spec.what} | {ms:.4f} | {f'{ms - prev:+.4f}' if prev < math.inf else ''} | "
                    f"{pct(int8_bytes / (ms * 1e-3) / read_bw)} | {pct(nbytes / (ms * 1e-3) / copy_bw)} | {lc.text()} | "
                    f"{len(res)} |")
        xs.clear()
        if setup.device == "cuda":
            torch.cuda.empty_cache()


# ------------------------------------------------------------------------- ncu, asm and main

DEFAULT_NCU = "int8-raw,step2-bias-asm,step5-bias,step5-imma,shipped-int8,shipped-bf16"
DEFAULT_LAUNCH = Launch(32, 4, 3, 32, 16)


def all_specs() -> dict[str, Spec]:
    return {s.key: s for s in stream_specs(True) + buildup_specs(list(KMODE))}


def case_launch(case: str, best: dict, label: str) -> tuple[str, Launch]:
    """A --ncu case `KEY[@TILE/WARPS/STAGES/SPLITS[/ROWS]]`: its launch as written, else the best
    of --best at that shape (or the stream's), else DEFAULT_LAUNCH."""
    key, _, given = case.partition("@")
    if given:
        return key, Launch(*(int(v) for v in given.split("/")))
    found = best.get(label, {}).get(key) or best.get("stream", {}).get(key)
    return key, Launch(**found) if found else DEFAULT_LAUNCH


def ncu_launch(args, setup: Setup) -> None:
    """What ncu runs: every case once to compile, then once to be profiled, at --ncu-shape (each
    case's inputs freed before the next: ncu saves and restores device memory)."""
    best = json.loads(Path(args.best).read_text()).get("best", {}) if args.best else {}
    batch, ctx = (int(v) for v in args.ncu_shape.split("x"))
    label = f"B{batch} ctx{ctx}"
    specs = all_specs()
    gen = torch.Generator().manual_seed(0)
    for _ in range(2):
        for case in args.ncu_cases.split(","):
            key, lc = case_launch(case, best, label)
            bf16 = key in ("bf16", "bf16-hm", "shipped-bf16")
            x = make_inputs(setup.dims, [ctx] * batch, setup.device, gen, bf16=bf16, head_major=key.endswith("-hm"))
            if key.startswith("shipped-"):
                k, v, ks, vs = (x.k16, x.v16, None, None) if bf16 else (x.k, x.v, x.ks, x.vs)
                td.paged_decode(x.q, k, v, ks, vs, x.table, x.lens, setup.dims.d ** -0.5, max_seq_len=ctx)
            else:
                launch(specs[key], x, lc, Outputs.make(x, lc.splits))
            if setup.device == "cuda":
                torch.cuda.synchronize()


def run_ncu(args, rep: Report) -> int:
    from benchmarks.ncu_decode import report as ncu_table

    raw = os.path.join(os.path.dirname(rep.md), "roofline_ncu_raw.csv")
    cases = args.ncu_cases.split(",")
    ncu = shutil.which("ncu") or "/usr/local/cuda/bin/ncu"
    cmd = [ncu, "--set", "full", "--clock-control", "none", "-k", "regex:_roofline_kernel|_decode_stage1",
           "--launch-skip", str(len(cases)), "--launch-count", str(len(cases)), "--csv", "--page", "raw",
           sys.executable, "-m", "benchmarks.int8_roofline", "--ncu-launch", "--ncu-cases", args.ncu_cases, "--ncu-shape", args.ncu_shape]
    if args.best:
        cmd += ["--best", args.best]
    res = subprocess.run(cmd, capture_output=True, text=True)
    lines = [line for line in res.stdout.splitlines() if line.startswith('"')]  # the CSV, not ncu's notes
    if res.returncode != 0 or not lines or not lines[0].startswith('"ID"'):
        print(res.stdout[-3000:], res.stderr[-3000:], sep="\n")
        return 1
    with open(raw, "w") as f:
        f.write("\n".join(lines) + "\n")
    best = json.loads(Path(args.best).read_text()).get("best", {}) if args.best else {}
    label = "B{} ctx{}".format(*args.ncu_shape.split("x"))
    named = [f"{key} @{lc.text()}" if not key.startswith("shipped") else key
             for key, lc in (case_launch(c, best, label) for c in cases)]
    rep.log(f"## Nsight Compute at {label} (launch: tile / warps / stages / splits / rows)")
    rep.log(ncu_table(raw, named))
    return 0


def run_asm(args, setup: Setup, rep: Report) -> int:
    """Compile every kernel of the sweeps for sm_90 on this machine: registers, spills, shared
    memory, the main loop's instructions per key, and the compile time."""
    from triton.runtime import driver

    from benchmarks.kernel_asm import _Sm90, sass_report

    driver.set_active(_Sm90())
    dims = GPU_DIMS
    gen = torch.Generator().manual_seed(0)
    x = make_inputs(dims, [256, 256], "cpu", gen, bf16=True, head_major=True, q_dtype=torch.bfloat16)
    specs, seen = [], set()
    for spec in stream_specs(args.head_major) + buildup_specs(args.kmodes.split(",")):
        sig = (spec.step if spec.step < 6 else 5, spec.pages, spec.kconv if spec.step == 2 else "",
               spec.vconv if 2 <= spec.step <= 4 else "", spec.kmode if spec.step >= 3 else "", spec.head_major)
        if sig not in seen and (not args.steps or spec.key in args.steps.split(",")):
            seen.add(sig)
            specs.append(spec)
    rep.log(f"triton {triton.__version__}, sm_90, Hq{dims.hq} Hkv{dims.hkv} D{dims.d} page {dims.page}")
    rep.log("| kernel | tile / warps / stages / rows | regs | stack | smem | loop instr/thread | warp-instr/key | compile s |")
    rep.log("|---|---|---|---|---|---|---|---|")
    total = 0.0
    for spec in specs:
        for tile in setup.space.tiles:
            for rows in ((16, 4) if spec.step >= 3 else (16,)):
                lc = Launch(tile, *setup.space.base, 2, rows)
                t0 = time.perf_counter()
                try:
                    kernel = launch(spec, x, lc, Outputs.make(x, 2), warmup=True)
                except Exception as exc:  # noqa: BLE001
                    rep.log(f"| {spec.key} | {lc.tile} / {lc.warps} / {lc.stages} / {rows} | {type(exc).__name__}: "
                            f"{str(exc).splitlines()[0][:100] if str(exc) else ''} |")
                    continue
                secs = time.perf_counter() - t0
                total += secs
                usage, loops = sass_report(kernel.asm["cubin"])
                n = loops[0][0] if loops else 0
                rep.log(f"| {spec.key} | {lc.tile} / {lc.warps} / {lc.stages} / {rows} | {usage.get('reg')} | "
                        f"{usage.get('stack')} | {kernel.metadata.shared} | {n} | {n * lc.warps / lc.tile:.1f} | "
                        f"{secs:.1f} |")
    rep.log(f"compile time in all: {total:.0f} s")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = make_parser(__doc__)
    ap.add_argument("--stream", action="store_true", help="time the stream kinds and the bandwidth references")
    ap.add_argument("--buildup", action="store_true", help="time the build-up steps and the shipped kernel at --shapes")
    ap.add_argument("--ncu", action="store_true", help="profile --ncu-cases under Nsight Compute (GPU, ncu on the PATH)")
    ap.add_argument("--asm", action="store_true",
                    help="compile the kernels for sm_90 without a GPU and report registers, spills and compile time "
                         "(run with TRITON_INTERPRET=0)")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes and sweeps (the CPU interpreter, in seconds)")
    ap.add_argument("--out", default=None, metavar="DIR", help="folder for roofline.md and .json (default: $OUT, else /tmp)")
    ap.add_argument("--repeats", type=int, default=3, help="graph replays per time, their median taken")
    ap.add_argument("--budget-s", type=float, default=480.0,
                    help="seconds after which no new sweep point starts (the stream part gets 40%% of it with --buildup)")
    ap.add_argument("--kinds", default=None, help="comma-separated stream kinds (default: all)")
    ap.add_argument("--head-major", action="store_true", help="the stream kinds over head-major pages as well")
    ap.add_argument("--steps", default=None, help="comma-separated build-up rows, e.g. step0,step5-imma (default: all)")
    ap.add_argument("--kmodes", default="bias,imma", help="K's forms in the dot steps, of " + ", ".join(KMODE))
    ap.add_argument("--shapes", default=None,
                    help="build-up shapes BxCTX,... (default: 64x4096,256x4096,1x32768; 2x64 with --tiny)")
    ap.add_argument("--seed", type=int, default=None, help="seed of the random inputs (default: a fresh one, printed)")
    ap.add_argument("--ncu-cases", default=DEFAULT_NCU,
                    help="--ncu cases: stream kinds, build-up rows, shipped-int8, shipped-bf16, each "
                         "KEY[@TILE/WARPS/STAGES/SPLITS/ROWS]")
    ap.add_argument("--ncu-shape", default="64x4096", help="--ncu shape BxCTX")
    ap.add_argument("--best", default=None, metavar="JSON",
                    help="a roofline.json whose best launches the --ncu cases take (default: none: "
                         + DEFAULT_LAUNCH.text() + ")")
    ap.add_argument("--ncu-launch", action="store_true", help="(internal) launch the --ncu cases; what ncu runs")
    args = ap.parse_args(argv)
    if not (args.stream or args.buildup or args.ncu or args.asm or args.ncu_launch):
        ap.error("give --stream, --buildup, --ncu or --asm")
    setup = make_setup(args.tiny, args.shapes, "cuda" if torch.cuda.is_available() else "cpu")
    if args.ncu_launch:
        ncu_launch(args, setup)
        return 0
    if args.asm and os.environ.get("TRITON_INTERPRET") == "1":
        ap.exit(2, "--asm compiles for the GPU: run it with TRITON_INTERPRET=0\n")
    rep = Report(args.out or os.environ.get("OUT", "/tmp"), "roofline_asm" if args.asm else
                 "roofline_ncu" if args.ncu else "roofline")
    if args.asm:
        return run_asm(args, setup, rep)
    if args.ncu or not args.tiny:
        require_cuda(ap)
    if args.ncu:
        return run_ncu(args, rep)
    if args.seed is None:
        args.seed = int.from_bytes(os.urandom(3), "little")
    on_gpu = setup.device == "cuda"
    device = torch.cuda.get_device_name() if on_gpu else "CPU (Triton interpreter)"
    rep.data["meta"] = dict(device=device, torch=torch.__version__, triton=triton.__version__, seed=args.seed,
                            dims=asdict(setup.dims), shapes=setup.shapes, budget_s=args.budget_s, repeats=args.repeats)
    rep.log(f"# int8 decode roofline: {device}, torch {torch.__version__}, triton {triton.__version__}, "
            f"seed {args.seed}")
    clock = Clock(on_gpu, args.repeats)
    t0 = time.monotonic()
    bw = bandwidths(setup, clock, rep)
    if args.stream:
        share = 0.4 if args.buildup else 1.0
        run_stream(setup, args, clock, rep, Budget(args.budget_s * share - (time.monotonic() - t0)), bw)
    if args.buildup:
        run_buildup(setup, args, clock, rep, Budget(args.budget_s - (time.monotonic() - t0)), bw)
    rep.data["wall_s"] = time.monotonic() - t0
    rep.log(f"\nwall {rep.data['wall_s']:.0f} s; figures: {rep.md}, {rep.js}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
