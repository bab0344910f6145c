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
        tables = torch.zeros((len(scheduled), max_blocks), dtype=torch.int32)
        for i, s in enumerate(scheduled):
            token_ids.extend(_token_slice(s.request, s.start, s.num_new_tokens))
            query_lens.append(s.num_new_tokens)
            starts.append(s.start)
            tables[i, :len(s.block_table)] = torch.tensor(s.block_table, dtype=torch.int32)
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
        # The one host sync of the step: everything sampled comes back in one transfer.
        ids = result.token_ids.tolist()
        lps = result.logprobs.tolist()
        top_ids = result.top_ids.tolist() if result.top_ids is not None else None
        top_lps = result.top_logprobs.tolist() if result.top_logprobs is not None else None
        sampled: dict[str, SampledToken] = {}
        for j, r in enumerate(reqs):
            n = r.sampling.logprobs
            top = list(zip(top_ids[j][:n], top_lps[j][:n])) if n and top_ids is not None else []
            sampled[r.request_id] = SampledToken(ids[j], lps[j], top)
        return sampled
