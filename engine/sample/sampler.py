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

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from pie.engine.sampling_params import SamplingParams

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
class SamplingTensors:
    """Per-row sampling parameters of one step, on the logits' device. B rows, V vocab entries."""

    temperature: torch.Tensor  # (B,) fp32; greedy rows hold 1.0 (they never divide)
    greedy: torch.Tensor  # (B,) bool; temperature == 0: argmax after penalties
    top_k: torch.Tensor  # (B,) int64 in [1, V]; 0 (off) is stored as V
    top_p: torch.Tensor  # (B,) fp32 in (0, 1]
    min_p: torch.Tensor  # (B,) fp32 in [0, 1]
    repetition_penalty: torch.Tensor  # (B,) fp32; 1 = off
    presence_penalty: torch.Tensor  # (B,) fp32; 0 = off
    frequency_penalty: torch.Tensor  # (B,) fp32; 0 = off
    seed: torch.Tensor  # (B,) int64; the engine picks a random one for unseeded requests
    step: torch.Tensor  # (B,) int64; index of the token being sampled (= output tokens so far)
    num_logprobs: torch.Tensor  # (B,) int64; top-n logprobs each row asked for
    output_counts: torch.Tensor | None  # (B, V) fp32 occurrences in the output; None = no freq/pres
    seen_mask: torch.Tensor | None  # (B, V) bool, in prompt or output; None = no repetition penalty
    logit_adds: LogitAdds | None  # logit_bias and min_tokens; None = no row uses either
    # Host-side flags, so that features nobody in the batch uses cost nothing.
    all_greedy: bool
    any_greedy: bool
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool
    max_top_k: int  # largest top_k of the sampled rows (V if one has it off): bounds the sort
    max_logprobs: int  # columns of SamplerOutput.top_ids; 0 = none

    @property
    def any_penalties(self) -> bool:
        return self.output_counts is not None or self.seen_mask is not None

    def next_step(self) -> SamplingTensors:
        """The same rows one token later (only `step` moves; without penalties, nothing else
        depends on the tokens). One device op instead of a rebuild from the requests."""
        if self.any_penalties:
            raise ValueError("penalty tables depend on the new tokens: build them again")
        return dataclasses.replace(self, step=self.step + 1)

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        seeds: list[int],
        steps: list[int],
        prompt_ids: list[list[int]],
        output_ids: list[list[int]],
        vocab_size: int,
        device: torch.device | str,
        pending_ids: tuple[list[int], list[int], torch.Tensor] | None = None,
        eos_token_ids: Sequence[Sequence[int]] | None = None,
    ) -> SamplingTensors:
        """Gather one step's parameters into tensors: two host->device copies for the scalars and
        at most two padded id tensors for the penalties (only rows that use them are filled), and
        one more for logit_bias / min_tokens (`LogitAdds.build`).

        eos_token_ids: each row's end-of-sequence ids (Request.eos_token_ids), which min_tokens holds
        back with the row's stop_token_ids unless the row ignores EOS; None: no row has any.

        pending_ids: (rows, sources, ids) for rows whose newest output id is still on the device
        (async scheduling: a placeholder, not in its host list): row rows[i]'s id is
        ids[sources[i]], ids a tensor on `device`. Only rows that use a penalty read it, on the
        device, without a host round trip."""
        n = len(params)
        if not (len(seeds) == len(steps) == len(prompt_ids) == len(output_ids) == n):
            raise ValueError("params, seeds, steps, prompt_ids and output_ids differ in length")
        device = torch.device(device)
        pin = device.type == "cuda"
        floats = torch.tensor(
            [[p.temperature, p.top_p, p.min_p, p.repetition_penalty, p.presence_penalty,
              p.frequency_penalty] for p in params],
            dtype=torch.float32).reshape(n, 6)
        ints = torch.tensor(
            [[s, st, p.top_k if p.top_k > 0 else vocab_size, p.logprobs]
             for p, s, st in zip(params, seeds, steps)],
            dtype=torch.int64).reshape(n, 4)
        if pin:
            floats, ints = floats.pin_memory(), ints.pin_memory()
        floats = floats.to(device, non_blocking=True)
        ints = ints.to(device, non_blocking=True)
        temperature, top_p, min_p, rep, pres, freq = floats.unbind(1)
        seed, step, top_k, num_logprobs = ints.unbind(1)
        greedy = temperature == 0.0
        temperature = torch.where(greedy, torch.ones_like(temperature), temperature)

        # Penalty tables: the ids of the rows that use them, flattened, one index_put/index_add on
        # the flattened (B * V) table; no Python loop over tokens.
        rows_freq = [p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 for p in params]
        rows_rep = [p.repetition_penalty != 1.0 for p in params]
        output_counts = None
        if any(rows_freq):
            flat = _flat_index([[o] if use else [] for o, use in zip(output_ids, rows_freq)],
                               vocab_size, device, pin, _pending_for(pending_ids, rows_freq, vocab_size))
            counts = torch.zeros(n * vocab_size, dtype=torch.float32, device=device)
            counts.index_add_(0, flat, torch.ones(flat.shape, dtype=torch.float32, device=device))
            output_counts = counts.view(n, vocab_size)
        seen_mask = None
        if any(rows_rep):
            flat = _flat_index([[pr, o] if use else [] for pr, o, use in zip(prompt_ids, output_ids, rows_rep)],
                               vocab_size, device, pin, _pending_for(pending_ids, rows_rep, vocab_size))
            seen = torch.zeros(n * vocab_size, dtype=torch.bool, device=device)
            seen[flat] = True
            seen_mask = seen.view(n, vocab_size)

        greedy_host = [p.temperature == 0.0 for p in params]
        return cls(
            temperature=temperature, greedy=greedy, top_k=top_k, top_p=top_p, min_p=min_p,
            repetition_penalty=rep, presence_penalty=pres, frequency_penalty=freq,
            seed=seed, step=step, num_logprobs=num_logprobs,
            output_counts=output_counts, seen_mask=seen_mask,
            logit_adds=LogitAdds.build(params, steps, eos_token_ids, vocab_size, device, pin),
            all_greedy=all(greedy_host), any_greedy=any(greedy_host),
            any_top_k=any(0 < p.top_k < vocab_size and p.temperature != 0.0 for p in params),
            any_top_p=any(p.top_p < 1.0 and p.temperature != 0.0 for p in params),
            any_min_p=any(p.min_p > 0.0 and p.temperature != 0.0 for p in params),
            max_top_k=max((p.top_k if 0 < p.top_k < vocab_size else vocab_size
                           for p in params if p.temperature != 0.0), default=vocab_size),
            max_logprobs=max((p.logprobs for p in params), default=0),
        )


@dataclass
class LogitAdds:
    """logit_bias and min_tokens of a batch as one sparse add on the flattened (B * V) logits: N
    entries, each a (row, token id) with a bias, or -inf while its row has produced fewer than
    `min_tokens` tokens. Only rows that use either have entries; the rest pay nothing.

    The -inf entries are decided on the device from the rows' step counters, so `next_step` (steady
    decode, no rebuild) lifts the suppression by itself once a row reaches its min_tokens."""

    index: torch.Tensor  # (N,) int64: row * V + token id
    bias: torch.Tensor  # (N,) fp32: the entry's logit_bias; 0 for an entry that min_tokens alone adds
    row: torch.Tensor | None  # (N,) int64: each entry's row; None when no entry is suppressible
    min_tokens: torch.Tensor | None  # (N,) int64: -inf while its row's step is below this (0: never)

    @classmethod
    def build(cls, params: Sequence[SamplingParams], steps: Sequence[int],
              eos_token_ids: Sequence[Sequence[int]] | None, vocab_size: int, device: torch.device,
              pin: bool) -> LogitAdds | None:
        """The entries of the rows with a logit_bias, or a min_tokens they have not reached (their
        EOS ids unless they ignore EOS, and their stop_token_ids); None when there is none."""
        index: list[int] = []
        bias: list[float] = []
        until: list[int] = []
        for i, (p, step) in enumerate(zip(params, steps)):
            if not p.logit_bias and p.min_tokens <= step:
                continue  # the common case: one comparison per row
            base = i * vocab_size
            for token, b in p.logit_bias.items():
                index.append(base + token)
                bias.append(b)
                until.append(0)
            if p.min_tokens > step:
                stops = set(p.stop_token_ids)
                if not p.ignore_eos and eos_token_ids is not None:
                    stops.update(eos_token_ids[i])
                for token in stops:
                    index.append(base + token)
                    bias.append(0.0)
                    until.append(p.min_tokens)
        if not index:
            return None
        ints = torch.tensor([index, until], dtype=torch.int64)  # (2, N)
        floats = torch.tensor(bias, dtype=torch.float32)
        if pin:
            ints, floats = ints.pin_memory(), floats.pin_memory()
        ints = ints.to(device, non_blocking=True)
        floats = floats.to(device, non_blocking=True)
        idx, min_tokens = ints.unbind(0)
        if not any(until):
            return cls(idx, floats, None, None)
        return cls(idx, floats, torch.div(idx, vocab_size, rounding_mode="floor"), min_tokens)


def apply_logit_adds(logits: torch.Tensor, adds: LogitAdds, step: torch.Tensor) -> torch.Tensor:
    """logits (B, V) + the batch's logit_bias, with -inf on the EOS / stop ids of rows still below
    their min_tokens (step: (B,) tokens each row has produced). Out of place; no host sync."""
    add = adds.bias
    if adds.row is not None and adds.min_tokens is not None:
        held = step.index_select(0, adds.row) < adds.min_tokens  # (N,)
        add = add.masked_fill(held, float("-inf"))
    return logits.reshape(-1).index_add(0, adds.index, add).view_as(logits)


def _pending_for(pending_ids: tuple[list[int], list[int], torch.Tensor] | None, use: list[bool],
                 vocab_size: int) -> torch.Tensor | None:
    """Flat indices (row * vocab_size + id) of the device-side ids of the rows that use a table."""
    if pending_ids is None:
        return None
    rows, sources, ids = pending_ids
    keep = [(r, src) for r, src in zip(rows, sources) if use[r]]
    if not keep:
        return None
    rows_t, src_t = torch.tensor(keep, dtype=torch.int64, device=ids.device).unbind(1)
    return ids.index_select(0, src_t).to(torch.int64) + rows_t * vocab_size


def _flat_index(rows: list[list[list[int]]], vocab_size: int, device: torch.device,
                pin: bool, extra: torch.Tensor | None = None) -> torch.Tensor:
    """row * vocab_size + token id for every id of every row (each row given as a few id lists),
    as one int64 tensor on `device`; `extra` (flat indices already on the device) is appended."""
    lengths = [sum(len(part) for part in parts) for parts in rows]
    # np.fromiter over a chain is ~6x faster than torch.tensor on a Python list of ints.
    ids = np.fromiter(chain.from_iterable(chain.from_iterable(rows)), dtype=np.int64, count=sum(lengths))
    row = np.repeat(np.arange(len(rows), dtype=np.int64), lengths)
    flat = torch.from_numpy(ids + row * vocab_size)
    if pin:
        flat = flat.pin_memory()
    flat = flat.to(device, non_blocking=True)
    return flat if extra is None else torch.cat((flat, extra))


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
    """The sampled tokens with their log_softmax under `logits` (B, V) and the n most likely."""
    logsumexp = torch.logsumexp(logits, dim=-1)  # (B,)
    top_ids = top_logprobs = None
    if n > 0:
        top, top_ids = logits.topk(n, dim=-1)  # (B, n), descending
        top_logprobs = top - logsumexp[:, None]
    logprobs = logits.gather(1, token_ids[:, None]).squeeze(1) - logsumexp
    return SamplerOutput(token_ids=token_ids, logprobs=logprobs, top_ids=top_ids, top_logprobs=top_logprobs)

