"""The sampler's inputs of one step (`SamplingTensors`): every row's parameters, penalties' token
counts, logit biases and stop-id masks, built on the host once per step and copied to the logits'
device in a few transfers. engine/sample/sampler.py reads them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from ..device import to_device
from ..sampling_params import SamplingParams


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
        floats = torch.tensor(
            [[p.temperature, p.top_p, p.min_p, p.repetition_penalty, p.presence_penalty,
              p.frequency_penalty] for p in params],
            dtype=torch.float32).reshape(n, 6)
        ints = torch.tensor(
            [[s, st, p.top_k if p.top_k > 0 else vocab_size, p.logprobs]
             for p, s, st in zip(params, seeds, steps)],
            dtype=torch.int64).reshape(n, 4)
        floats, ints = to_device(floats, device), to_device(ints, device)
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
                               vocab_size, device, _pending_for(pending_ids, rows_freq, vocab_size))
            counts = torch.zeros(n * vocab_size, dtype=torch.float32, device=device)
            counts.index_add_(0, flat, torch.ones(flat.shape, dtype=torch.float32, device=device))
            output_counts = counts.view(n, vocab_size)
        seen_mask = None
        if any(rows_rep):
            flat = _flat_index([[pr, o] if use else [] for pr, o, use in zip(prompt_ids, output_ids, rows_rep)],
                               vocab_size, device, _pending_for(pending_ids, rows_rep, vocab_size))
            seen = torch.zeros(n * vocab_size, dtype=torch.bool, device=device)
            seen.index_fill_(0, flat, True)  # not seen[flat] = True: that copies the True from the host, a sync
            seen_mask = seen.view(n, vocab_size)

        greedy_host = [p.temperature == 0.0 for p in params]
        return cls(
            temperature=temperature, greedy=greedy, top_k=top_k, top_p=top_p, min_p=min_p,
            repetition_penalty=rep, presence_penalty=pres, frequency_penalty=freq,
            seed=seed, step=step, num_logprobs=num_logprobs,
            output_counts=output_counts, seen_mask=seen_mask,
            logit_adds=LogitAdds.build(params, steps, eos_token_ids, vocab_size, device),
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
              eos_token_ids: Sequence[Sequence[int]] | None, vocab_size: int,
              device: torch.device) -> LogitAdds | None:
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
        ints = to_device(torch.tensor([index, until], dtype=torch.int64), device)  # (2, N)
        floats = to_device(torch.tensor(bias, dtype=torch.float32), device)
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
    rows_t, src_t = to_device(torch.tensor(keep, dtype=torch.int64), ids.device).unbind(1)
    return ids.index_select(0, src_t).to(torch.int64) + rows_t * vocab_size


def _flat_index(rows: list[list[list[int]]], vocab_size: int, device: torch.device,
                extra: torch.Tensor | None = None) -> torch.Tensor:
    """row * vocab_size + token id for every id of every row (each row given as a few id lists),
    as one int64 tensor on `device`; `extra` (flat indices already on the device) is appended."""
    lengths = [sum(len(part) for part in parts) for parts in rows]
    # np.fromiter over a chain: much faster than torch.tensor on a Python list of ints.
    ids = np.fromiter(chain.from_iterable(chain.from_iterable(rows)), dtype=np.int64, count=sum(lengths))
    row = np.repeat(np.arange(len(rows), dtype=np.int64), lengths)
    flat = to_device(torch.from_numpy(ids + row * vocab_size), device)
    return flat if extra is None else torch.cat((flat, extra))
