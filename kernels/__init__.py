"""Paged KV cache ops: pure functions on tensors with documented shapes; they know nothing of
requests or models.

The cache of one layer is a pair of tensors `k_cache`, `v_cache` of shape
(num_blocks, block_size, num_kv_heads, head_dim), stored as int8 (the default), bfloat16, float16
or float32. An int8 cache carries `k_scale`, `v_scale` of shape (num_blocks, num_kv_heads,
block_size) in float16 (head-major per page: a kernel reads one page's scales of one kv head
contiguously): one symmetric scale per (token, kv head), computed once when the token is written
(scale = fp16(absmax / 127), floored), so earlier tokens are never re-quantized; other dtypes pass
None. A token lives at slot = block_id * block_size + offset, and a slot of -1 marks padding that
writes skip. `reference` holds the torch versions used on the CPU and as test oracles for the
Triton kernels (`triton_cache_write`, `triton_decode`, `triton_extend`, sharing `triton_tile`).

One op is not about the cache: `apply_token_bitmask_` forbids tokens in the logits from structured
output's token masks (one bit per vocabulary entry; `triton_bitmask` is its kernel).
"""

from kernels.reference import (
    apply_token_bitmask_,
    dequantize,
    paged_attention,
    paged_attention_decode,
    quantize_per_token_head,
    write_kv_cache,
)

__all__ = [
    "apply_token_bitmask_",
    "dequantize",
    "paged_attention",
    "paged_attention_decode",
    "quantize_per_token_head",
    "write_kv_cache",
]
