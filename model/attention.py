"""The contract between the model and whatever does attention (and owns the KV cache).

The model never sees a KV cache or sequence boundaries. Each layer hands its backend the packed
q/k/v of the step's tokens; the backend, set up by its owner for this step (which tokens belong to
which sequence, where their K/V go, how much context each sequence already has), stores k/v and
attends causally. The softmax scale is not passed per call: a backend is built with it, taken from
`ModelConfig.attn_scale` (also `LlamaForCausalLM.attn_scale`), head_dim ** -0.5 for every supported
family.

Token packing of a step with three sequences (no batch dim, no padding):

    tokens:    | seq 0 (5) | seq 1 (17)        | seq 2 (33)                        |
    positions:  0 1 2 3 4   0 1 ... 16          0 1 ... 32       (or context_len + i with a cache)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
import torch.nn.functional as F


class AttentionBackend(Protocol):
    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention of one layer over the step's packed tokens.

        q: (T, num_heads, head_dim); k, v: (T, num_kv_heads, head_dim); q and k after q/k norm and
        RoPE. Returns (T, num_heads, head_dim) in q's dtype. num_heads is a multiple of num_kv_heads
        (grouped-query attention: query head h reads kv head h // (num_heads // num_kv_heads)).
        """
        ...


class DenseCausalAttention:
    """Reference backend without a cache: each packed sequence attends to itself, causally.

    For tests and for single-pass scoring of whole sequences. `seq_lens` lists the packed
    sequences' lengths in order (they must sum to T); `scale` is the softmax scale.
    """

    def __init__(self, seq_lens: Sequence[int], scale: float) -> None:
        if any(n <= 0 for n in seq_lens):
            raise ValueError(f"sequence lengths must be positive, got {list(seq_lens)}")
        self.seq_lens = list(seq_lens)
        self.scale = scale

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        total = sum(self.seq_lens)
        if q.shape[0] != total:
            raise ValueError(f"got {q.shape[0]} tokens but the sequence lengths sum to {total}")
        group = q.shape[1] // k.shape[1]
        outs = []
        for qs, ks, vs in zip(q.split(self.seq_lens), k.split(self.seq_lens), v.split(self.seq_lens)):
            # (L, H, D) -> (H, L, D), kv heads repeated so that query head h reads kv head h // group
            ks = ks.repeat_interleave(group, dim=1).transpose(0, 1)
            vs = vs.repeat_interleave(group, dim=1).transpose(0, 1)
            o = F.scaled_dot_product_attention(qs.transpose(0, 1), ks, vs, is_causal=True, scale=self.scale)
            outs.append(o.transpose(0, 1))  # (L, H, D)
        return torch.cat(outs, dim=0)


class BatchedCausalAttention:
    """Backend for training: B sequences of the same length L packed as T = B * L tokens.

    The packed q/k/v are viewed as (B, L, H, D) and attended with one fused causal SDPA call (no
    per-sequence loop, no cache), grouped-query heads handled by SDPA itself. Same layers, same
    parameters as serving: only the attention call differs.
    """

    def __init__(self, batch_size: int, seq_len: int, scale: float) -> None:
        if batch_size <= 0 or seq_len <= 0:
            raise ValueError(f"batch_size and seq_len must be positive, got {batch_size}, {seq_len}")
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.scale = scale

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        b, n = self.batch_size, self.seq_len
        if q.shape[0] != b * n:
            raise ValueError(f"got {q.shape[0]} tokens, expected batch {b} x length {n}")
        # (B*L, H, D) -> (B, H, L, D)
        qb = q.view(b, n, q.shape[1], q.shape[2]).transpose(1, 2)
        kb = k.view(b, n, k.shape[1], k.shape[2]).transpose(1, 2)
        vb = v.view(b, n, v.shape[1], v.shape[2]).transpose(1, 2)
        o = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=self.scale,
                                           enable_gqa=q.shape[1] != k.shape[1])
        return o.transpose(1, 2).reshape(b * n, q.shape[1], q.shape[2])  # (B*L, H, D)
