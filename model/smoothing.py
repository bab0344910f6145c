"""K/V channel smoothing folded into the weights, for caches that quantize per (token, head).

Real checkpoints have a few K channels 10-100x larger than the rest ("massive activations"). A
per-(token, head) int8 scale is set by the largest channel, so those few spend the range that the
others need. Attention scores only see q . k, so dividing K channel c by s_c and multiplying the
matching Q channel by s_c changes nothing, and the division can live in the weights (QServe's
SmoothAttention; SmoothQuant's migration for activations):

    k_c = x . W_k[c] (+ b_k[c])          ->  W_k[c] / s_c,  b_k[c] / s_c
    q_c of every query head of the group ->  W_q[c] * s_c,  b_q[c] * s_c
    Qwen3 (a per-head RMSNorm before RoPE would undo the projection's scaling):
                                         ->  k_norm.weight[c] / s_c,  q_norm.weight[c] * s_c

RoPE rotates channels c and c + D/2 together, so both get one factor, which then commutes with the
rotation. V's channels are smoothed the same way against o_proj: v_c / t_c and o_proj's input
column of channel c (of every query head of the group) * t_c.

The factors come from the statistics of a calibration forward pass (`calibrate`): the RMS of each
channel (pair) over its tokens, divided by the geometric mean over the head's channels, rounded to a
power of two (so folding them into bf16 or fp16 weights is exact) and clamped. Qwen3's norms are
shared by all heads, so its factors are too (the RMS pooled over heads).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from pie.model.attention import DenseCausalAttention
from pie.model.llama import LlamaForCausalLM

MIN_LOG2, MAX_LOG2 = -6, 10  # factors in [1/64, 1024]

# What `calibrate` runs through the model when the caller brings no tokens of its own: ordinary
# prose, so that the tokens a real checkpoint sees most often are represented.
CALIBRATION_TEXT = (
    "The city library opens at nine in the morning. On most days a few students are already "
    "waiting on the steps with coffee, notebooks and laptops, talking about exams, football and "
    "the weather. Inside, the reading room is quiet; sunlight falls across long wooden tables. "
    "A librarian sorts returned books onto a cart: a history of the Roman empire, two novels, a "
    "guide to growing tomatoes, and a worn atlas with a torn cover. 'Could you help me find "
    "articles about river pollution?' asks a young man. She shows him the database, explains how "
    "to search by year and topic, and writes the call number of a report on a slip of paper. At "
    "noon the room fills up, and by evening only the night staff remain, switching off the lamps "
    "one row at a time. In 2021 the library lent 48,000 books; in 2023, nearly 61,500."
)


@dataclass(slots=True)
class KVSmoothing:
    """Per-layer factors: k[i] and v[i] are (Hkv, D) powers of two (K's equal within RoPE pairs)."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]

    def log2_range(self) -> tuple[int, int]:
        logs = torch.cat([torch.log2(t).flatten() for t in self.k + self.v])
        return int(logs.min()), int(logs.max())


class _Recorder(DenseCausalAttention):
    """Dense causal attention that also accumulates, per layer, the sum of squares of every K and V
    channel over the tokens it sees: (Hkv, D) each, in fp64."""

    def __init__(self, seq_lens: list[int], scale: float) -> None:
        super().__init__(seq_lens, scale)
        self.k_sq: dict[int, torch.Tensor] = {}
        self.v_sq: dict[int, torch.Tensor] = {}
        self.tokens = sum(seq_lens)

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.k_sq[layer_idx] = k.double().square().sum(0).cpu()  # (Hkv, D)
        self.v_sq[layer_idx] = v.double().square().sum(0).cpu()
        return super().__call__(layer_idx, q, k, v)


def factors_from_rms(rms: torch.Tensor, pairs: bool, shared: bool = False) -> torch.Tensor:
    """rms (Hkv, D) -> power-of-two factors (Hkv, D): channel RMS over the head's geometric mean."""
    if pairs:  # one factor per RoPE pair (c, c + D/2)
        half = rms.shape[-1] // 2
        pair = torch.sqrt((rms[:, :half] ** 2 + rms[:, half:] ** 2) / 2)
        rms = torch.cat([pair, pair], dim=-1)
    if shared:  # one set for all heads (Qwen3's norms are per channel, not per head)
        rms = torch.sqrt((rms ** 2).mean(0, keepdim=True)).expand_as(rms)
    floor = rms.max() * 1e-6 + 1e-30  # a dead channel must not get an unbounded factor
    log = torch.log2(rms.clamp_min(floor))
    rel = log - log.mean(dim=-1, keepdim=True)  # against the geometric mean of the head's channels
    return torch.exp2(torch.round(rel).clamp(MIN_LOG2, MAX_LOG2)).float()


@torch.inference_mode()
def calibrate(model: LlamaForCausalLM, token_ids: list[int]) -> KVSmoothing:
    """Runs `token_ids` through the model (one sequence) and derives the smoothing factors."""
    device = model.embed_tokens.weight.device
    ids = torch.tensor(token_ids, dtype=torch.int64, device=device)
    rec = _Recorder([len(token_ids)], model.attn_scale)
    model(ids, torch.arange(len(token_ids), device=device), rec)
    n = rec.tokens
    qk_norm = model.config.qk_norm
    layers = range(model.config.num_hidden_layers)
    return KVSmoothing(
        k=[factors_from_rms(torch.sqrt(rec.k_sq[i] / n), pairs=True, shared=qk_norm) for i in layers],
        v=[factors_from_rms(torch.sqrt(rec.v_sq[i] / n), pairs=False, shared=False) for i in layers])


@torch.no_grad()
def fold(model: LlamaForCausalLM, smoothing: KVSmoothing) -> None:
    """Divides K and V channels by their factors and multiplies the matching Q channels and
    o_proj input columns by them, in place: the model computes the same function (exactly: the
    factors are powers of two), with K and V channels of even magnitude."""
    cfg = model.config
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    for layer, s_k, s_v in zip(model.layers, smoothing.k, smoothing.v):
        attn = layer.self_attn
        w, b = attn.qkv_proj.weight, attn.qkv_proj.bias
        # Per query head: the factors of its kv head, (Hq * D,) in row order.
        q_k = s_k.repeat_interleave(group, dim=0).reshape(-1).to(w.device)
        q_v = s_v.repeat_interleave(group, dim=0).reshape(-1).to(w.device)
        k_rows = slice(cfg.q_size, cfg.q_size + cfg.kv_size)
        v_rows = slice(cfg.q_size + cfg.kv_size, cfg.q_size + 2 * cfg.kv_size)
        if cfg.qk_norm:
            attn.k_norm.weight.div_(s_k[0].to(w.device, w.dtype))
            attn.q_norm.weight.mul_(s_k[0].to(w.device, w.dtype))
        else:
            w[k_rows].div_(s_k.reshape(-1, 1).to(w.device, w.dtype))
            w[:cfg.q_size].mul_(q_k[:, None].to(w.dtype))
            if b is not None:
                b[k_rows].div_(s_k.reshape(-1).to(w.device, b.dtype))
                b[:cfg.q_size].mul_(q_k.to(b.dtype))
        w[v_rows].div_(s_v.reshape(-1, 1).to(w.device, w.dtype))
        if b is not None:
            b[v_rows].div_(s_v.reshape(-1).to(w.device, b.dtype))
        attn.o_proj.weight.mul_(q_v[None, :].to(attn.o_proj.weight.dtype))


def calibration_tokens(encode, vocab_size: int, length: int = 256) -> list[int]:
    """About `length` tokens of CALIBRATION_TEXT (repeated as needed) through `encode`, kept
    inside the model's vocabulary."""
    ids = [t for t in encode(CALIBRATION_TEXT) if 0 <= t < vocab_size]
    if not ids:
        raise ValueError("the calibration text encodes to no token of this vocabulary")
    return (ids * math.ceil(length / len(ids)))[:length]
