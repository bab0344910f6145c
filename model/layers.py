"""Building blocks of a Llama-family decoder layer, on token-packed activations (T, ...)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from model.attention import AttentionBackend
from model.config import ModelConfig
from model.rope import RotaryEmbedding


class RMSNorm(nn.Module):
    """x / rms(x) * weight over the last dim; the statistics in fp32, the result in x's dtype."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class SwiGLUMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), with gate and up fused into one matmul.

    gate_up_proj.weight is (2 * intermediate, hidden): rows [0, I) are gate_proj, rows [I, 2I) up_proj.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)  # (T, I) each
        return self.down_proj(F.silu(gate) * up)


class SelfAttention(nn.Module):
    """Projections, optional q/k norm and RoPE; the attention itself is the backend's.

    qkv_proj.weight is (q_size + 2 * kv_size, hidden): rows are q_proj, then k_proj, then v_proj.
    """

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.o_proj_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding,
                attn: AttentionBackend) -> torch.Tensor:
        """x (T, hidden), positions (T,) -> (T, hidden)."""
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)  # (T, Hq, D)
        k = k.view(t, self.num_kv_heads, self.head_dim)  # (T, Hkv, D)
        v = v.view(t, self.num_kv_heads, self.head_dim)  # (T, Hkv, D)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotary(positions, q, k)
        o = attn(self.layer_idx, q, k, v)  # (T, Hq, D)
        return self.o_proj(o.reshape(t, self.q_size))
