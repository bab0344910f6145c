"""Turns a SchedulerOutput into one forward pass and one batched sample.

Step inputs are built vectorized from per-request slices (a loop over requests, never over tokens):
token ids, positions, the slot of every new token, padded block tables, sequence lengths and query
offsets. The only device->host synchronization of a step is reading the sampled ids back.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.request import Request
from engine.kv_cache import AttentionMetadata, KVCache, PagedAttention
from engine.sampler import SamplingTensors, sample
from engine.scheduler import SchedulerOutput


@dataclass(slots=True)
class SampledToken:
    token_id: int
    logprob: float  # log-probability of token_id under the raw model distribution
    top: list[tuple[int, float]]  # top-n (token id, logprob), best first; empty unless asked


def _token_slice(req: Request, start: int, n: int) -> list[int]:
    """Tokens [start, start + n) of prompt + output, without concatenating the whole sequence."""
    p = req.num_prompt_tokens
    if start >= p:
        return req.output_token_ids[start - p:start - p + n]
    if start + n <= p:
        return req.prompt_token_ids[start:start + n]
    return req.prompt_token_ids[start:] + req.output_token_ids[:start + n - p]


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv_cache: KVCache, *, vocab_size: int,
                 softmax_scale: float, device: torch.device, attention_backend: str = "auto") -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = kv_cache.block_size
        self.vocab_size = vocab_size
        self.device = device
        self.attention = PagedAttention(kv_cache, softmax_scale, attention_backend)

    def _prepare(self, out: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        scheduled = out.scheduled
        token_ids: list[int] = []
        query_lens: list[int] = []
        starts: list[int] = []
        max_blocks = max(len(s.block_table) for s in scheduled)
        padded_tables: list[list[int]] = []
        for s in scheduled:
            token_ids.extend(_token_slice(s.request, s.start, s.num_new_tokens))
            query_lens.append(s.num_new_tokens)
            starts.append(s.start)
            padded_tables.append(s.block_table + [0] * (max_blocks - len(s.block_table)))
        tables = torch.tensor(padded_tables, dtype=torch.int32)  # (B, max_blocks), one conversion
        q_lens = torch.tensor(query_lens, dtype=torch.int64)
        start_t = torch.tensor(starts, dtype=torch.int64)
        # Per token: which sequence it belongs to and its position in that sequence.
        seq_idx = torch.repeat_interleave(torch.arange(len(scheduled)), q_lens)  # (T,)
        qsl = torch.zeros(len(scheduled) + 1, dtype=torch.int64)
        torch.cumsum(q_lens, 0, out=qsl[1:])
        positions = start_t[seq_idx] + (torch.arange(int(qsl[-1])) - qsl[:-1][seq_idx])  # (T,)
        blocks = tables[seq_idx, positions // self.block_size].to(torch.int64)
        slots = blocks * self.block_size + positions % self.block_size  # (T,)
        dev = self.device
        md = AttentionMetadata(
            slot_mapping=slots.to(dev, non_blocking=True),
            block_tables=tables.to(dev, non_blocking=True),
            seq_lens=(start_t + q_lens).to(torch.int32).to(dev, non_blocking=True),
            query_start_loc=qsl.to(torch.int32).to(dev, non_blocking=True),
            max_query_len=max(query_lens),
            max_seq_len=max(st + n for st, n in zip(starts, query_lens)),
        )
        input_ids = torch.tensor(token_ids, dtype=torch.int64).to(dev, non_blocking=True)
        return input_ids, positions.to(dev, non_blocking=True), md

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, seeds: dict[str, int]) -> dict[str, SampledToken]:
        """Runs the scheduled tokens; returns the sampled token of every request that reached the
        end of its known tokens this step (prefill chunks in the middle of a prompt sample nothing)."""
        input_ids, positions, md = self._prepare(out)
        self.attention.metadata = md
        try:
            hidden = self.model(input_ids, positions, self.attention)  # (T, hidden)
        finally:
            self.attention.metadata = None
        rows = [i for i, s in enumerate(out.scheduled) if s.sample]
        if not rows:
            return {}
        last = (md.query_start_loc[1:].to(torch.int64) - 1)[torch.tensor(rows, device=self.device)]
        logits = self.model.compute_logits(hidden[last])  # (R, V) fp32
        reqs = [out.scheduled[i].request for i in rows]
        tensors = SamplingTensors.build(
            params=[r.sampling for r in reqs],
            seeds=[seeds[r.request_id] for r in reqs],
            steps=[r.num_output_tokens for r in reqs],
            prompt_ids=[r.prompt_token_ids for r in reqs],
            output_ids=[r.output_token_ids for r in reqs],
            vocab_size=logits.shape[-1],
            device=logits.device,
        )
        result = sample(logits, tensors)
        # The one host sync of the step: everything sampled comes back in one transfer, packed as
        # float64 columns (token ids are exact in float64): id, logprob, then n top ids, n top logprobs.
        cols = [result.token_ids.double()[:, None], result.logprobs.double()[:, None]]
        n_top = 0
        if result.top_ids is not None:
            n_top = result.top_ids.shape[1]
            cols += [result.top_ids.double(), result.top_logprobs.double()]
        rows_back = torch.cat(cols, dim=1).tolist()
        sampled: dict[str, SampledToken] = {}
        for r, row in zip(reqs, rows_back):
            n = min(r.sampling.logprobs, n_top)
            top = [(int(t), lp) for t, lp in zip(row[2:2 + n], row[2 + n_top:2 + n_top + n])]
            sampled[r.request_id] = SampledToken(int(row[0]), row[1], top)
        return sampled
