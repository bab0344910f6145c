"""K/V channel smoothing folded into the weights, for caches that quantize per (token, head).

Real checkpoints have a few K channels one or two orders of magnitude larger than the rest
("massive activations"). A
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

Smoothing helps a model whose few massive K channels spend every token's int8 range, and costs one
whose channels matter unevenly: a trained checkpoint (SmolLM2-135M-Instruct) lost more perplexity
to it than to plain int8 pages, while random models with massive channels kept far more greedy
agreement with it than without. So by default (`choose`) the calibration pass also decides, per
layer and kv head, whether K's factors and V's are worth it: it attends the calibration tokens
with K and V rounded to int8 as the cache stores them, plainly and smoothed, and keeps each factor
only where the attention output comes closer to the exact one (K's factors per
layer where they are shared). The choice is the measured error's, on this checkpoint's own
activations.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .attention import DenseCausalAttention
from .llama import LlamaForCausalLM

MIN_LOG2, MAX_LOG2 = -6, 10  # factors in [1/64, 1024]
# With `choose`, a head's K (or V) factors are kept where they bring its int8 attention error
# below this share of the error without them. The head's error is a proxy of the model's (the
# output projection and the layers after it weigh the channels unevenly): most heads' factors
# change it a little either way and, kept at a looser share, still cost top-1 agreement end to
# end; massive K channels' factors cut it many-fold, far below this share.
KEEP_BELOW = 0.5

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
    """Per-layer factors: k[i] and v[i] are (Hkv, D) powers of two (K's equal within RoPE pairs);
    a kv head whose smoothing was not kept has factors of 1."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    # With `choose`: over all layers, the int8 attention error (squared, relative to the exact
    # output's) plainly, and with the factors kept; None where the factors were not chosen.
    error_plain: float | None = None
    error_kept: float | None = None

    def log2_range(self) -> tuple[int, int]:
        logs = torch.cat([torch.log2(t).flatten() for t in self.k + self.v])
        return int(logs.min()), int(logs.max())

    def heads_smoothed(self) -> tuple[int, int, int]:
        """(kv heads whose K is smoothed, whose V is, all kv heads) over the layers."""
        k = sum(int((t != 1).any(-1).sum()) for t in self.k)
        v = sum(int((t != 1).any(-1).sum()) for t in self.v)
        return k, v, sum(t.shape[0] for t in self.k)


def int8_roundtrip(x: torch.Tensor) -> torch.Tensor:
    """x (T, H, D) as an int8 cache stores and reads it: one fp16 scale per (token, head),
    absmax / 127 (floored at 2^-14), values rounded half away from zero (the pages' rule, which
    kernels.reference.quantize_per_token_head defines; model/ does not import kernels/)."""
    xf = x.float()
    scale = (xf.abs().amax(-1, keepdim=True) / 127.0).clamp_min(2.0 ** -14).half().float()
    y = xf / scale
    return (torch.sign(y) * torch.floor(y.abs() + 0.5)).clamp(-127, 127) * scale


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of one kv head's query heads: q (G, T, D), k and v (T, D) -> (G, T, D)."""
    return torch.nn.functional.scaled_dot_product_attention(q, k[None], v[None], is_causal=True, scale=scale)


def _choose(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, s_k: torch.Tensor, s_v: torch.Tensor, scale: float,
            shared_k: bool) -> tuple[torch.Tensor, torch.Tensor, float, float]:
    """Which of one layer's factors to keep. q (T, Hq, D), k and v (T, Hkv, D), as the attention
    receives them; s_k, s_v (Hkv, D). Each kv head is attended four ways, K and V each plain or
    smoothed, both rounded to int8 (smoothed: q * s_k against K / s_k, the output's channels times
    s_v), and each factor kept where it brings the output closer to the exact one; with `shared_k`
    (one set of K factors for all heads) K's choice is the layer's. Returns the factors kept (1
    where not), and the squared error plainly and as kept, over the exact output's squared norm."""
    hkv = k.shape[1]
    group = q.shape[1] // hkv
    qf, kf, vf = q.float(), k.float(), v.float()
    errors = torch.empty(hkv, 2, 2, dtype=torch.float64)  # [head, K smoothed, V smoothed]
    total = 0.0
    for h in range(hkv):
        qh = qf[:, h * group:(h + 1) * group].transpose(0, 1)  # (G, T, D)
        exact = _attend(qh, kf[:, h], vf[:, h], scale)
        total += float(exact.double().square().sum())
        for a in (0, 1):
            fk = s_k[h].to(kf) if a else torch.ones_like(s_k[h]).to(kf)
            kq = int8_roundtrip((kf[:, h] / fk)[:, None])[:, 0]
            for b in (0, 1):
                fv = s_v[h].to(vf) if b else torch.ones_like(s_v[h]).to(vf)
                vq = int8_roundtrip((vf[:, h] / fv)[:, None])[:, 0]
                out = _attend(qh * fk, kq, vq, scale) * fv
                errors[h, a, b] = float((out - exact).double().square().sum())
    # K first (with V plain), then V under K's choice; a factor is kept only where it cuts the
    # error below KEEP_BELOW of the other's.
    if shared_k:  # the layer's K choice
        keep = bool(errors[:, 1, 0].sum() < KEEP_BELOW * errors[:, 0, 0].sum())
        a = torch.full((hkv,), int(keep), dtype=torch.long)
    else:
        a = (errors[:, 1, 0] < KEEP_BELOW * errors[:, 0, 0]).long()
    rows = torch.arange(hkv)
    b = (errors[rows, a, 1] < KEEP_BELOW * errors[rows, a, 0]).long()
    kept_err = float(errors[rows, a, b].sum())
    keep_k = a.bool()[:, None].to(s_k.device)
    keep_v = b.bool()[:, None].to(s_v.device)
    ones_k, ones_v = torch.ones_like(s_k), torch.ones_like(s_v)
    return (torch.where(keep_k, s_k, ones_k), torch.where(keep_v, s_v, ones_v),
            float(errors[:, 0, 0].sum()) / total, kept_err / total)


class _Recorder(DenseCausalAttention):
    """Dense causal attention that also derives, per layer, the smoothing factors from the RMS of
    every K and V channel over the tokens it sees (and, with `choose`, keeps those that help)."""

    def __init__(self, seq_lens: list[int], scale: float, *, qk_norm: bool, choose: bool) -> None:
        super().__init__(seq_lens, scale)
        self.qk_norm, self.choose = qk_norm, choose
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}
        self.error_plain = self.error_kept = 0.0

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        rms_k = k.double().square().mean(0).sqrt().cpu()  # (Hkv, D)
        rms_v = v.double().square().mean(0).sqrt().cpu()
        s_k = factors_from_rms(rms_k, pairs=True, shared=self.qk_norm)
        s_v = factors_from_rms(rms_v, pairs=False, shared=False)
        if self.choose:
            s_k, s_v, plain, kept = _choose(q, k, v, s_k, s_v, self.scale, shared_k=self.qk_norm)
            self.error_plain += plain
            self.error_kept += kept
        self.k[layer_idx], self.v[layer_idx] = s_k, s_v
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
def calibrate(model: LlamaForCausalLM, token_ids: list[int], *, choose: bool = True) -> KVSmoothing:
    """Runs `token_ids` through the model (one sequence) and derives the smoothing factors; with
    `choose`, keeps each layer's and kv head's only where it lowers the int8 attention error (the
    module docstring). A layer's choice sees its input as the unsmoothed model computes it (the
    factors fold in after the pass): each layer is judged on its own."""
    device = model.embed_tokens.weight.device
    ids = torch.tensor(token_ids, dtype=torch.int64, device=device)
    rec = _Recorder([len(token_ids)], model.attn_scale, qk_norm=model.config.qk_norm, choose=choose)
    model(ids, torch.arange(len(token_ids), device=device), rec)
    layers = range(model.config.num_hidden_layers)
    return KVSmoothing(k=[rec.k[i] for i in layers], v=[rec.v[i] for i in layers],
                       error_plain=rec.error_plain if choose else None, error_kept=rec.error_kept if choose else None)


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
