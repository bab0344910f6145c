"""Batched sampling on the logits' device, with no host sync inside.

One step samples one token for each of B rows from logits (B, V) fp32. The caller builds a
`SamplingTensors` once per step, calls `sample`, then copies the result to the host once for the
whole batch.

Order of operations on each row (features a batch does not use are skipped through flags computed
on the host, so they cost nothing):

    raw logits ─┬─> log_softmax -> logprobs of the sampled token and the top-n   (raw, as vLLM v1)
                └─> + logit_bias, -inf on EOS / stop ids while step < min_tokens  (one sparse add)
                      -> repetition penalty (prompt + output) -> frequency / presence (output only)
                      -> greedy rows: argmax here
                      -> / temperature -> min_p -> top_k -> top_p -> softmax
                      -> exponential race: argmax(probs / E), E ~ Exp(1) from a hash RNG

With `processed_logprobs` (`pie serve --logprobs-mode processed`) the logprobs are instead the
log_softmax of the logits the token was chosen from: after the filters for sampled rows, after the
penalties for greedy ones (filters and temperature do not apply to greedy rows); a token a filter
removed has -inf.

Randomness is counter-based: the uniform for (row, vocab index v) is a hash of (seed, step, v),
where step is the index of the token being sampled. A seeded request therefore draws the same
tokens whatever else is in the batch and whatever its row, and no per-request torch.Generator
exists. The race `argmax_v p_v / E_v` picks v with probability p_v (the first arrival of
independent exponential clocks with rates p_v), as in gpt-fast `multinomial_sample_one_no_sync`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .tensors import SamplingTensors, apply_logit_adds

# splitmix64 constants (Steele, Lea, Flood 2014), as signed int64 since torch has no uint64 math.
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)
_MIX1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_MIX2 = 0x94D049BB133111EB - (1 << 64)
# 32-bit finalizer constants ("lowbias32", C. Wellons' hash prospector), as signed int32.
_GOLDEN32 = 0x9E3779B9 - (1 << 32)
_MIX32_1 = 0x7FEB352D
_MIX32_2 = 0x846CA68B - (1 << 32)


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of a signed tensor (torch's `>>` is arithmetic: mask off the copied
    sign bits)."""
    bits = 64 if x.dtype == torch.int64 else 32
    return (x >> s) & ((1 << (bits - s)) - 1)


def _mix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64 finalizer on int64 (multiplication wraps mod 2^64, as for uint64)."""
    x = (x ^ _shr(x, 30)) * _MIX1
    x = (x ^ _shr(x, 27)) * _MIX2
    return x ^ _shr(x, 31)


def _mix32_(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 finalizer on int32, in place (multiplication wraps mod 2^32)."""
    x ^= _shr(x, 16)
    x *= _MIX32_1
    x ^= _shr(x, 15)
    x *= _MIX32_2
    x ^= _shr(x, 16)
    return x


def hash_uniform(seed: torch.Tensor, step: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Uniforms in the open interval (0, 1), a pure function of (seed, step, vocab index).

    seed, step: (B,) int64. Returns (B, vocab_size) fp32. Each row gets a 32-bit key from the
    64-bit splitmix64 of (seed, step) (rows collide with probability 2^-32); element v is
    lowbias32(key + v * golden32). The (B, V) part runs in int32, half the memory traffic of int64:
    it is the sampler's largest cost at big vocabularies. The top 23 bits k give
    u = (k + 0.5) / 2^23, exact in fp32, so u is never 0 or 1 (|log u| <= 16.6).
    """
    key64 = _mix64(_mix64(seed) + step * _GOLDEN)  # (B,)
    key = (_shr(key64, 32) ^ (key64 & 0xFFFFFFFF)).to(torch.int32)  # fold to 32 bits (wraps)
    idx = torch.arange(vocab_size, device=seed.device, dtype=torch.int32) * _GOLDEN32  # (V,)
    h = _mix32_(key[:, None] + idx[None, :])  # (B, V) int32
    k = _shr(h, 9).to(torch.float32)  # in [0, 2^23)
    return k.add_(0.5).mul_(1.0 / (1 << 23))


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # (B,) int64, the sampled tokens
    # (B,) fp32, log_softmax at the sampled token of the raw logits (or, with processed_logprobs,
    # of the logits it was chosen from)
    logprobs: torch.Tensor
    top_ids: torch.Tensor | None  # (B, n) int64, n = max_logprobs, most likely first; None if n == 0
    top_logprobs: torch.Tensor | None  # (B, n) fp32 logprobs of top_ids (raw or processed, as above), descending


def apply_penalties(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """Repetition (CTRL/HF: a seen token's logit is divided by the penalty when > 0, multiplied
    when <= 0; over prompt + output), then frequency and presence (OpenAI: logit -= freq * count +
    presence * (count > 0); over the output only). Out of place. logits: (B, V)."""
    if t.seen_mask is not None:
        pen = t.repetition_penalty[:, None]  # (B, 1)
        penalized = torch.where(logits > 0, logits / pen, logits * pen)
        logits = torch.where(t.seen_mask, penalized, logits)
    if t.output_counts is not None:
        counts = t.output_counts
        logits = (logits - t.frequency_penalty[:, None] * counts
                  - t.presence_penalty[:, None] * (counts > 0).to(logits.dtype))
    return logits


def _apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p * (the row's top probability)."""
    probs = torch.softmax(logits, dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p[:, None]
    return logits.masked_fill(probs < threshold, float("-inf"))


def _apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None,
                       top_p: torch.Tensor | None, max_top_k: int) -> torch.Tensor:
    """One descending sort serves both. top_k keeps the k largest logits (ties with the k-th are
    kept too); top_p keeps the smallest prefix whose probability reaches top_p, at least one token.
    A row with top_k == V or top_p == 1 is left as it is. When every row keeps at most
    max_top_k < V tokens, only the top max_top_k are sorted (torch.topk), not the whole row."""
    vocab = logits.shape[-1]
    partial = top_k is not None and max_top_k < vocab // 2
    if partial:
        sorted_logits, order = logits.topk(max_top_k, dim=-1)  # (B, K), descending
    else:
        sorted_logits, order = logits.sort(dim=-1, descending=True)  # (B, V)
    if top_k is not None:
        kth = sorted_logits.gather(1, (top_k.clamp(max=sorted_logits.shape[-1]) - 1)[:, None])
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))  # (B, K)
    if top_p is not None:
        probs = torch.softmax(sorted_logits, dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs  # probability of the strictly better tokens
        drop = (before >= top_p[:, None]) & (top_p < 1.0)[:, None]
        drop[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    out = torch.full_like(logits, float("-inf")) if partial else torch.empty_like(logits)
    return out.scatter_(1, order, sorted_logits)


def sample(logits: torch.Tensor, t: SamplingTensors, *, processed_logprobs: bool = False) -> SamplerOutput:
    """Sample one token per row. logits: (B, V) fp32, left unchanged. No host sync: every branch
    is on a host flag of `t`, never on a tensor value. `processed_logprobs`: report the logprobs
    of the logits each token was chosen from instead of the raw ones (module docstring)."""
    token_ids, chosen_from, _ = choose(logits, t, processed_logprobs=processed_logprobs)
    return logprobs_of(chosen_from, token_ids, t.max_logprobs)


def choose(logits: torch.Tensor, t: SamplingTensors, *, processed_logprobs: bool = False,
           keep_probs: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """`sample` without the logprobs: (token ids (B,), the logits the logprobs are read from (raw,
    or with `processed_logprobs` those each token was chosen from), and with `keep_probs` the
    distribution each sampled row drew from (B, V), softmax of the processed logits; a greedy row's
    is its processed softmax too, which speculative decoding does not read)."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be (B, V), got {tuple(logits.shape)}")
    logits = logits.float()
    raw = logits

    if t.logit_adds is not None:
        logits = apply_logit_adds(logits, t.logit_adds, t.step)
    if t.any_penalties:
        logits = apply_penalties(logits, t)

    kept: torch.Tensor | None = None
    greedy_ids = logits.argmax(dim=-1) if t.any_greedy else None
    if greedy_ids is not None and t.all_greedy:
        token_ids = greedy_ids
        chosen_from = logits
        if keep_probs:
            kept = torch.softmax(logits, dim=-1)
    else:
        unscaled = logits
        logits = filtered(logits, t)
        chosen_from = logits
        if processed_logprobs and greedy_ids is not None:  # greedy rows chose before temperature and filters
            chosen_from = torch.where(t.greedy[:, None], unscaled, logits)
        probs = torch.softmax(logits, dim=-1)
        if keep_probs:
            kept = probs.clone()
        token_ids = race(probs, t.seed, t.step)
        if greedy_ids is not None:
            token_ids = torch.where(t.greedy, greedy_ids, token_ids)
    return token_ids, (chosen_from if processed_logprobs else raw), kept


def filtered(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """Logits after penalties -> / temperature -> min_p -> top_k -> top_p (out of place): what a
    sampled row draws from, through softmax."""
    logits = logits / t.temperature[:, None]
    if t.any_min_p:
        logits = _apply_min_p(logits, t.min_p)
    if t.any_top_k or t.any_top_p:
        logits = _apply_top_k_top_p(logits, t.top_k if t.any_top_k else None,
                                    t.top_p if t.any_top_p else None, t.max_top_k)
    return logits


def race(probs: torch.Tensor, seed: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """A draw from each row of `probs` (B, V), overwritten: the exponential race
    argmax(probs / E), E = -log(u) ~ Exp(1), u the (seed, step) row of `hash_uniform`."""
    exp = hash_uniform(seed, step, probs.shape[-1]).log_().neg_()
    return probs.div_(exp).argmax(dim=-1)


def logprobs_of(logits: torch.Tensor, token_ids: torch.Tensor, n: int) -> SamplerOutput:
    """The sampled tokens with their log_softmax under `logits` (B, V) and the n most likely. With
    n 0 no row asked for logprobs (a token's own logprob goes out only with `logprobs` >= 1): the
    logprobs are zeros, and the two passes over (B, V) that computing them takes (two reads of
    every fp32 logit of the batch) are skipped."""
    if n == 0:
        return SamplerOutput(token_ids=token_ids, logprobs=torch.zeros(token_ids.shape, device=token_ids.device),
                             top_ids=None, top_logprobs=None)
    logsumexp = torch.logsumexp(logits, dim=-1)  # (B,)
    top_ids = top_logprobs = None
    if n > 0:
        top, top_ids = logits.topk(n, dim=-1)  # (B, n), descending
        top_logprobs = top - logsumexp[:, None]
    logprobs = logits.gather(1, token_ids[:, None]).squeeze(1) - logsumexp
    return SamplerOutput(token_ids=token_ids, logprobs=logprobs, top_ids=top_ids, top_logprobs=top_logprobs)

