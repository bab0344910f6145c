"""Rotary position embeddings: inverse frequencies for each RoPE variant, and a cos/sin table.

The inverse-frequency functions follow the published formulas (RoFormer; linear position
interpolation; Llama 3.1's wavelength-band smoothing; YaRN) and reproduce transformers'
`ROPE_INIT_FUNCTIONS` operation by operation in fp32, so logits match it to rounding.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .config import ModelConfig


def _base_inv_freq(base: float, dim: int) -> torch.Tensor:
    """theta_i = base ** (-2i / dim), i = 0 .. dim/2 - 1; (dim/2,) fp32."""
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
    return 1.0 / (base ** exponents)


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    """Llama 3.1: long wavelengths (> old_len / low_freq_factor) are slowed by `factor`, short ones
    (< old_len / high_freq_factor) are kept, and the band between is blended linearly in 1/wavelength."""
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn_inv_freq(cfg: ModelConfig, s: dict) -> tuple[torch.Tensor, float]:
    """YaRN: dimensions that turn many times within the original context keep their frequency
    (extrapolate), those that turn less than once are interpolated by `factor`, with a linear ramp
    between; cos/sin are multiplied by an attention factor (0.1 ln(factor) + 1 by default)."""
    dim, base = cfg.head_dim, cfg.rope_theta
    old_len = s["original_max_position_embeddings"]
    factor = s.get("factor") or cfg.max_position_embeddings / old_len

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        if s.get("mscale") and s.get("mscale_all_dim"):
            attention_factor = mscale(factor, s["mscale"]) / mscale(factor, s["mscale_all_dim"])
        else:
            attention_factor = mscale(factor)
    beta_fast = s.get("beta_fast") or 32
    beta_slow = s.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        # the dimension whose wavelength fits `num_rotations` times into the original context
        return (dim * math.log(old_len / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    lo, hi = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    if lo == hi:
        hi += 0.001  # avoid dividing by zero in the ramp

    pos_freqs = base ** (torch.arange(0, dim, 2).to(torch.float32) / dim)
    extrapolated = 1.0 / pos_freqs
    interpolated = 1.0 / (factor * pos_freqs)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - lo) / (hi - lo), 0, 1)
    keep = 1 - ramp  # 1 where the dimension extrapolates (keeps its frequency)
    return interpolated * (1 - keep) + extrapolated * keep, float(attention_factor)


def rope_inv_freq(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """(inv_freq (head_dim/2,) fp32 on the CPU, attention factor multiplying cos and sin)."""
    s = cfg.rope_scaling
    rope_type = "default" if s is None else s["rope_type"]
    if rope_type == "yarn":
        return _yarn_inv_freq(cfg, s)
    inv_freq = _base_inv_freq(cfg.rope_theta, cfg.head_dim)
    if rope_type == "linear":
        inv_freq = inv_freq / s["factor"]  # same as dividing the positions by factor
    elif rope_type == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, s)
    elif rope_type != "default":
        raise ValueError(f"unsupported rope_type {rope_type!r}")
    return inv_freq, 1.0


class RotaryEmbedding(nn.Module):
    """Neox-style (rotate-half) RoPE from a table of cos/sin for every position up to max_positions.

    The table is fp32 (max_positions, head_dim/2); a lookup is cast to the activations' dtype, as
    transformers does, so bf16 runs round like it.
    """

    def __init__(self, cfg: ModelConfig, max_positions: int | None = None) -> None:
        super().__init__()
        max_positions = max_positions or cfg.max_model_len
        inv_freq, attention_factor = rope_inv_freq(cfg)
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]  # (P, D/2)
        self.register_buffer("cos", freqs.cos() * attention_factor, persistent=False)
        self.register_buffer("sin", freqs.sin() * attention_factor, persistent=False)

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of every token, (T, 1, D) in `dtype` (each half of D repeated, as the
        rotate-half form wants); looked up once per forward pass and shared by all layers."""
        cos = self.cos[positions].to(dtype)  # (T, D/2)
        sin = self.sin[positions].to(dtype)
        return torch.cat((cos, cos), dim=-1)[:, None, :], torch.cat((sin, sin), dim=-1)[:, None, :]

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions (T,); q (T, Hq, D), k (T, Hkv, D) -> rotated q, k (same shapes)."""
        cos, sin = self.lookup(positions, q.dtype)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (T, H, D) -> x * cos + rotate_half(x) * sin, where rotate_half(x) = (-x2, x1) for the two
    halves of the last dim (each pair (x1[i], x2[i]) turns by its angle); cos, sin from `lookup`."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin
