"""Building blocks of a Llama-family decoder layer, on token-packed activations (T, ...)."""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from .attention import AttentionBackend
from .config import ModelConfig
from .lora import LoraHook
from .parallel import TensorParallel
from .rope import apply_rotary


class FusedOps(Protocol):
    """The elementwise work around a layer's matmuls done in one kernel each, where eager torch
    launches 2-5. Like the attention backend, the model's owner supplies them
    (`LlamaForCausalLM.use_fused_ops`; the engine passes kernels.triton_fused on CUDA); they must
    reproduce the torch ops' roundings. Without them, and whenever autograd records, the layers
    run the torch ops."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """x (T, H) contiguous -> (rms_norm(x + residual), x + residual written into residual);
        without residual, (rms_norm(x), x)."""
        ...

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up (T, 2I), gate then up -> silu(gate) * up (T, I)."""
        ...

    def rotary_(self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate-half RoPE of qk (T, heads, D) in place."""
        ...


class Matmul(Protocol):
    """F.linear's product by another kernel (`LlamaForCausalLM.use_batch_invariant`; the engine's
    batch-invariant mode passes kernels.triton_matmul.linear)."""

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x (T, K), weight (N, K), bias (N,) or None -> (T, N) in x's dtype."""
        ...


class Linear(nn.Linear):
    """nn.Linear (the same parameters and names) whose product the model's owner may supply:
    `matmul`, whose rows must not depend on how many rows a step carries in the batch-invariant
    mode. Without one, and whenever autograd records, F.linear. With `lora` (model/lora.py's
    bank attached), each row then gets the delta of its step's adapter slot."""

    matmul: Matmul | None = None
    lora: LoraHook | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled():
            return F.linear(x, self.weight, self.bias)
        if self.matmul is None:
            y = F.linear(x, self.weight, self.bias)
        else:
            y = self.matmul(x.reshape(-1, x.shape[-1]), self.weight, self.bias).view(*x.shape[:-1], -1)
        return y if self.lora is None else self.lora.add_(y, x)


def _fused(module: RMSNorm | SwiGLUMLP | SelfAttention) -> FusedOps | None:
    """The module's fused ops when it should use them: given, and no autograd recording."""
    ops = module.fused
    return None if ops is None or torch.is_grad_enabled() else ops


class RMSNorm(nn.Module):
    """x / rms(x) * weight over the last dim; the statistics in fp32, the result in x's dtype.

    With `residual`, the pre-norm block's residual add comes first: s = x + residual, and the call
    returns (norm(s), s). On the fused path s is written into `residual` in place."""

    fused: FusedOps | None = None
    # Every row through the fused kernel (one program a row), copied contiguous where it is not (the
    # q/k norms' heads): the batch-invariant mode, where torch's reduction may round a row by the
    # number of rows beside it.
    per_row = False

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        ops = _fused(self)
        if ops is not None and x.dim() == 2 and x.is_contiguous():
            out, s = ops.rms_norm(x, self.weight, self.eps, residual)
            return out if residual is None else (out, s)
        if ops is not None and self.per_row and residual is None:
            return ops.rms_norm(x.reshape(-1, x.shape[-1]).contiguous(), self.weight, self.eps, None)[0].view(x.shape)
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

    fused: FusedOps | None = None

    def __init__(self, cfg: ModelConfig, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.tp = tp  # down_proj is row-parallel: its partial outputs are summed over the ranks
        self.intermediate_size = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        ops = _fused(self)
        if ops is not None:
            out = self.down_proj(ops.silu_mul(gate_up))
        else:
            gate, up = gate_up.split(self.intermediate_size, dim=-1)  # (T, I) each
            out = self.down_proj(F.silu(gate) * up)
        return out if self.tp is None else self.tp.all_reduce(out)


class SelfAttention(nn.Module):
    """Projections, optional q/k norm and RoPE; the attention itself is the backend's.

    qkv_proj.weight is (q_size + 2 * kv_size, hidden): rows are q_proj, then k_proj, then v_proj.
    """

    fused: FusedOps | None = None

    def __init__(self, cfg: ModelConfig, layer_idx: int, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.tp = tp  # o_proj is row-parallel: its partial outputs are summed over the ranks
        self.layer_idx = layer_idx
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=cfg.o_proj_bias)
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
            ops = _fused(self)
            if ops is not None:
                ops.rotary_(qk, cos, sin)  # in place, in the qkv output
            else:
                qk = apply_rotary(qk, cos, sin)
            q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]  # (T, Hq, D), (T, Hkv, D)
        else:
            q = self.q_norm(qkv[:, :self.q_size].view(t, self.num_heads, self.head_dim))
            k = self.k_norm(qkv[:, self.q_size:self.q_size + self.kv_size].view(t, self.num_kv_heads, self.head_dim))
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        o = attn(self.layer_idx, q, k, v)  # (T, Hq, D)
        out = self.o_proj(o.reshape(t, self.q_size))
        return out if self.tp is None else self.tp.all_reduce(out)
