"""The paged KV pool (engine/runner/attention.py reads and writes it).

Layout (one tensor for all layers, so capacity is one number):
    k, v:             (num_layers, num_blocks, block_size, num_kv_heads, head_dim)  int8 | bf16 | fp16 | fp32
    k_scale, v_scale: (num_layers, num_blocks, num_kv_heads, block_size)  fp16, int8 caches only
A token's slot is block_id * block_size + offset; its K/V are quantized once, when written.

"""

from __future__ import annotations

import torch

from pie.kernels import reference

from ..config import KV_CACHE_DTYPES

TORCH_KV_DTYPES = {"int8": torch.int8, "bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
assert tuple(TORCH_KV_DTYPES) == KV_CACHE_DTYPES


class KVCache:
    def __init__(self, *, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, kv_cache_dtype: str, device: torch.device) -> None:
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.kv_cache_dtype = kv_cache_dtype
        dtype = TORCH_KV_DTYPES[kv_cache_dtype]
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.k_scale: torch.Tensor | None = None
        self.v_scale: torch.Tensor | None = None
        if kv_cache_dtype == "int8":
            scale_shape = (num_layers, num_blocks, num_kv_heads, block_size)  # head-major per page
            self.k_scale = torch.zeros(scale_shape, dtype=reference.SCALE_DTYPE, device=device)
            self.v_scale = torch.zeros(scale_shape, dtype=reference.SCALE_DTYPE, device=device)

    @staticmethod
    def bytes_per_block(*, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                        kv_cache_dtype: str) -> int:
        """Bytes one block costs across all layers, K and V, scales included."""
        elem = torch.empty((), dtype=TORCH_KV_DTYPES[kv_cache_dtype]).element_size()
        scale = torch.empty((), dtype=reference.SCALE_DTYPE).element_size() if kv_cache_dtype == "int8" else 0
        per_token_head = head_dim * elem + scale
        return 2 * num_layers * block_size * num_kv_heads * per_token_head

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        ks = self.k_scale[i] if self.k_scale is not None else None
        vs = self.v_scale[i] if self.v_scale is not None else None
        return self.k[i], self.v[i], ks, vs
