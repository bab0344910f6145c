"""Prefill attention over the paged cache through FlashAttention (torch's built-in FlashAttention-2
varlen kernel): the GPU path for prompt chunks, with `kernels.triton_extend` as the fallback.

Same contract as `paged_extend` without k_new, and as `kernels.reference.paged_attention`: packed
queries of B sequences, each the last q_len_i tokens of its sequence, attending causally to
everything the cache holds for it. Two steps:

1. `gather_pages` copies each sequence's K/V from the pages, as stored (int8 dequantized), into
   contiguous tensors: one pass over seq_len tokens per sequence, against attention's
   q_len x seq_len work.
2. FlashAttention's varlen forward attends from them: cu_seqlens for the queries and the gathered
   keys, causal aligned to the bottom right (query j of a sequence sees keys up to
   seq_len - q_len + j: FlashAttention's rule when the key run is the longer), GQA natively, a
   sliding window as (window - 1, 0).

Over cached prefixes this path runs at about SDPA's speed, faster than the Triton extend kernel;
on a long prompt with nothing cached it trails SDPA, which takes cuDNN's attention there
(`benchmarks/attention.py --extend-only` measures both). One SDPA call per such prompt is not
used: no faster in the kernel benchmark (the per-call host work and copies), and served it brings
occasional long decode steps, as a per-shape plan build in cuDNN would.

Why: the Triton paged extend kernel over int8 pages is slower than SDPA, and prefill is the
compute-bound part of serving. The gathered copy makes any cache dtype a contiguous bf16/fp16 problem, which
FlashAttention solves at the GPU's speed; attention still reads every key as stored, so a prompt
gives the same tokens whether its prefix was computed in this step or read from the cache
(engine/runner/attention.py). vLLM's backends gather and dequantize a cached context into contiguous
buffers for the same reason.

Where it applies (`supported`): CUDA, fp16/bf16 queries, head dims that are multiples of 8 up to
256, FlashAttention built into torch, and not while a CUDA graph is being captured (the gathered
length is a host number that changes every step); and (`fits`) a gathered copy of at most
GATHER_MAX_BYTES. The copy is transient, but its size is the step's prefill sequences' whole
contexts: 200 requests sharing a cached 6,000-token system prompt, 20 new tokens each, gather
1.2M tokens, 4.9 GB at Llama-3.1-8B's shape, where the Triton kernel reads the pages in place.
"""

from __future__ import annotations

import functools

import torch

from .triton_gather import gather_pages

MAX_HEAD_DIM = 256
# The largest gathered K and V together (bytes) this path takes on; more: the Triton extend kernel
GATHER_MAX_BYTES = 256 << 20


def fits(kv_tokens: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> bool:
    """The gathered K and V of `kv_tokens` tokens stay within GATHER_MAX_BYTES."""
    return 2 * kv_tokens * num_kv_heads * head_dim * dtype.itemsize <= GATHER_MAX_BYTES


def supported(q: torch.Tensor) -> bool:
    """This path serves these queries (module docstring)."""
    d = q.shape[-1]
    return (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and d % 8 == 0 and d <= MAX_HEAD_DIM
            and _device_has_flash(q.device.index or 0) and not torch.cuda.is_current_stream_capturing())


@functools.lru_cache(maxsize=8)
def _device_has_flash(index: int) -> bool:
    # asked once per device: every layer of every prompt step asks `supported`
    return torch.backends.cuda.is_flash_attention_available() and torch.cuda.get_device_capability(index) >= (8, 0)


def paged_prefill(
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
    max_query_len: int,
    max_seq_len: int,
    kv_tokens: int,
    key_start_loc: torch.Tensor | None = None,
    window: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of packed queries q (T, Hq, D) over the paged cache -> (T, Hq, D) in
    q.dtype (written into `out` when given). seq_lens (B,) and query_start_loc (B + 1,) int32 on
    the device; max_query_len, max_seq_len and kv_tokens = sum(seq_lens) host ints (no sync).
    Rows of q past query_start_loc[B] (padding) come out undefined. key_start_loc (B + 1,) int32:
    the cumulative sums of seq_lens from 0 when the caller has them (the engine stages them once
    per step), else summed here."""
    cu_k = key_start_loc
    if cu_k is None:
        cu_k = torch.zeros(seq_lens.shape[0] + 1, dtype=torch.int32, device=q.device)
        torch.cumsum(seq_lens, 0, out=cu_k[1:])
    k, v = gather_pages(k_cache, v_cache, k_scale, v_scale, block_tables, seq_lens, cu_k,
                        num_tokens=kv_tokens, max_seq_len=max_seq_len, dtype=q.dtype)
    res = torch.ops.aten._flash_attention_forward(
        q, k, v, query_start_loc, cu_k, max_query_len, max_seq_len, 0.0, True, False, scale=softmax_scale,
        window_size_left=None if window is None else window - 1, window_size_right=None if window is None else 0)[0]
    return res if out is None else out.copy_(res)

