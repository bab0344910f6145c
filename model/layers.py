"""Building blocks of a Llama-family decoder layer, on token-packed activations (T, ...)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from model.attention import AttentionBackend
from model.config import ModelConfig
from model.rope import apply_rotary


def _fused(x: torch.Tensor) -> bool:
    """Inference on CUDA: the elementwise ops run as the Triton kernels of kernels.triton_fused
    (one kernel each where eager torch launches 2-5; same roundings). Training (autograd) and the
    CPU keep the torch ops."""
    return x.is_cuda and not torch.is_grad_enabled()


class RMSNorm(nn.Module):
    """x / rms(x) * weight over the last dim; the statistics in fp32, the result in x's dtype.

    With `residual`, the pre-norm block's residual add comes first: s = x + residual, and the call
    returns (norm(s), s). On the fused path s is written into `residual` in place."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if _fused(x) and x.dim() == 2 and x.is_contiguous():
            from kernels.triton_fused import rms_norm

            out, s = rms_norm(x, self.weight, self.eps, residual)
            return out if residual is None else (out, s)
        if residual is None:
            return self._norm(x)
        s = x + residual
        return self._norm(s), s

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # One fused kernel for the statistics and the scaling (F.rms_norm), in fp32 as transformers.
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)


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
        gate_up = self.gate_up_proj(x)
        if _fused(gate_up):
            from kernels.triton_fused import silu_mul

            return self.down_proj(silu_mul(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)  # (T, I) each
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

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                attn: AttentionBackend) -> torch.Tensor:
        """x (T, hidden), rope: (cos, sin) of the tokens' positions (RotaryEmbedding.lookup) ->
        (T, hidden)."""
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        cos, sin = rope
        v = qkv[:, self.q_size + self.kv_size:].view(t, self.num_kv_heads, self.head_dim)  # (T, Hkv, D)
        if self.q_norm is None:  # q and k rotate together: one pass over their heads
            qk = qkv[:, :self.q_size + self.kv_size].view(t, self.num_heads + self.num_kv_heads, self.head_dim)
            if _fused(qk):
                from kernels.triton_fused import rotary_

                rotary_(qk, cos, sin)  # in place, in the qkv output
            else:
                qk = apply_rotary(qk, cos, sin)
            q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]  # (T, Hq, D), (T, Hkv, D)
        else:
            q = self.q_norm(qkv[:, :self.q_size].view(t, self.num_heads, self.head_dim))
            k = self.k_norm(qkv[:, self.q_size:self.q_size + self.kv_size].view(t, self.num_kv_heads, self.head_dim))
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        o = attn(self.layer_idx, q, k, v)  # (T, Hq, D)
        return self.o_proj(o.reshape(t, self.q_size))
