"""Structured output's token masks applied to the logits on the device, before sampling.

llguidance fills one bit per vocabulary entry for each constrained row (token v is bit v % 32 of
int32 word v // 32; a 152k vocabulary is 4,750 words, 19 KB per row). The host copies those
words to the device; this kernel expands them in place: every token whose bit is 0 gets a logit of
-inf, so no sampling parameter (temperature, top-k/p, min-p, penalties) can bring it back, and
greedy rows take the best allowed token. Only the forbidden entries are written: no logit is read.

One program per (mask row, block of BLOCK tokens): it reads BLOCK / 32 words (each loaded by the
32 lanes of its tokens, served from cache) and writes -inf where a bit is 0. It never syncs with
the host and allocates nothing, and it runs after a CUDA graph's replay on the graph's logits.
`kernels.reference.apply_token_bitmask_` is its torch twin (the CPU path and the tests' oracle).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BLOCK = 1024  # tokens per program: 32 mask words


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


@triton.jit
def _apply_token_bitmask_kernel(logits_ptr, mask_ptr, rows_ptr, stride_logits, stride_mask, vocab,
                                BLOCK: tl.constexpr):
    s = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < vocab
    row = tl.load(rows_ptr + s).to(tl.int64)
    words = tl.load(mask_ptr + s.to(tl.int64) * stride_mask + cols // 32, mask=inside, other=-1)
    forbidden = ((words >> (cols % 32)) & 1) == 0
    neg_inf = tl.full((BLOCK,), float("-inf"), tl.float32).to(logits_ptr.dtype.element_ty)
    tl.store(logits_ptr + row * stride_logits + cols, neg_inf, mask=inside & forbidden)


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """logits[rows[s], v] = -inf where bit v of bitmask[s] is 0, in place; returns logits.

    logits (B, V) fp32/bf16/fp16 with a unit stride along V (a row stride of its own: a slice of
    a CUDA graph's output is fine); bitmask (S, W) int32 contiguous with W = ceil(V / 32); rows
    (S,) int32 or int64, contiguous, distinct, each in [0, B); all on one device.
    """
    _check(logits.dim() == 2, f"logits must be (B, V), got shape {tuple(logits.shape)}")
    b, vocab = logits.shape
    _check(logits.dtype in DTYPES, f"logits must be fp32, bf16 or fp16, got {logits.dtype}")
    _check(logits.stride(1) == 1, f"logits need a unit stride along V, got strides {logits.stride()}")
    _check(bitmask.dim() == 2, f"bitmask must be (S, W), got shape {tuple(bitmask.shape)}")
    num_masks, words = bitmask.shape
    _check(bitmask.dtype == torch.int32, f"bitmask must be int32, got {bitmask.dtype}")
    _check(bitmask.is_contiguous(), "bitmask must be contiguous")
    _check(words == triton.cdiv(vocab, 32), f"bitmask has {words} words per row; V = {vocab} needs "
                                            f"{triton.cdiv(vocab, 32)}")
    _check(rows.shape == (num_masks,), f"rows must be ({num_masks},), got {tuple(rows.shape)}")
    _check(rows.dtype in (torch.int32, torch.int64), f"rows must be int32 or int64, got {rows.dtype}")
    _check(rows.is_contiguous(), "rows must be contiguous")
    for name, t in (("bitmask", bitmask), ("rows", rows)):
        _check(t.device == logits.device, f"{name} is on {t.device}, logits on {logits.device}")
    if num_masks == 0 or b == 0:
        return logits
    _apply_token_bitmask_kernel[(num_masks, triton.cdiv(vocab, BLOCK))](
        logits, bitmask, rows, logits.stride(0), bitmask.stride(0), vocab, BLOCK=BLOCK, num_warps=4)
    return logits
