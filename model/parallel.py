"""Tensor parallelism of the decoder (Megatron-style), as the model sees it.

Each of `size` ranks holds a slice of every layer and the whole of the rest:

- attention: query heads split evenly (rank r: heads [r*Hq/N, (r+1)*Hq/N)); KV heads split the
  same way when N divides them, else (N a multiple of Hkv) each KV head is held by the N/Hkv ranks
  whose query heads read it (replicated). q/k/v (and their biases) are column slices of qkv_proj;
  o_proj is a row slice (its input columns), so each rank's o_proj output is a partial sum;
- MLP: the intermediate dimension split evenly: gate/up column slices, down_proj a row slice;
- after o_proj and after down_proj one all-reduce (sum) per layer each; a row-parallel bias is
  held by rank 0 alone (zeros elsewhere), so the sum adds it once;
- the embedding and the LM head: split by vocabulary, ceil(V/N) rows per rank (the last rank's
  share padded with zero rows). A rank embeds the ids in its rows (zeros for the others) and one
  all-reduce sums the embedding; each rank's LM head gives its columns of the logits, gathered
  on every rank (rank 0 samples). Replicated, they would add a large share to a rank's weights,
  nearly its whole share again for an 8B Llama at N=8;
- norms and RoPE: replicated (every rank computes the same hidden state).

A rank's module is an ordinary LlamaForCausalLM built from `local_config` (its head and
intermediate counts), with `TensorParallel` doing the two all-reduces; model/loader.py reads only
its slices of the checkpoint. The attention backend and KV cache of a rank see its heads only.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from .config import ModelConfig


@dataclass(frozen=True, slots=True)
class TensorParallel:
    rank: int
    size: int
    group: Any = None  # the torch.distributed process group; None: the default group

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sums `x` over the ranks, in place."""
        torch.distributed.all_reduce(x, group=self.group)
        return x

    def gather_columns(self, x: torch.Tensor, total: int) -> torch.Tensor:
        """(R, C) on each rank -> (R, total) on every rank: rank r's columns at [r*C, (r+1)*C), the
        padding past `total` cut off."""
        parts = [torch.empty_like(x) for _ in range(self.size)]
        torch.distributed.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=1)[:, :total]


def check_shardable(cfg: ModelConfig, size: int) -> None:
    """ValueError naming what does not divide, for a model that `size` ranks cannot share."""
    if size < 1:
        raise ValueError(f"tensor parallel size must be >= 1, got {size}")
    hq, hkv, inter = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size
    problems = []
    if hq % size:
        problems.append(f"num_attention_heads {hq} is not a multiple of {size}")
    if hkv % size and size % hkv:
        problems.append(f"num_key_value_heads {hkv} neither is a multiple of {size} nor divides it")
    if inter % size:
        problems.append(f"intermediate_size {inter} is not a multiple of {size}")
    if problems:
        raise ValueError(f"--tensor-parallel-size {size} cannot split this model: " + "; ".join(problems))


def q_heads(cfg: ModelConfig, tp: TensorParallel) -> range:
    per = cfg.num_attention_heads // tp.size
    return range(tp.rank * per, (tp.rank + 1) * per)


def kv_heads(cfg: ModelConfig, tp: TensorParallel) -> range:
    """The KV heads rank `tp.rank` holds: its share, or the one head its query heads read."""
    hkv = cfg.num_key_value_heads
    if hkv % tp.size == 0:
        per = hkv // tp.size
        return range(tp.rank * per, (tp.rank + 1) * per)
    head = tp.rank * hkv // tp.size  # N/Hkv consecutive ranks share one KV head
    return range(head, head + 1)


def intermediate(cfg: ModelConfig, tp: TensorParallel) -> range:
    per = cfg.intermediate_size // tp.size
    return range(tp.rank * per, (tp.rank + 1) * per)


def vocab_per_rank(cfg: ModelConfig, size: int) -> int:
    """Rows of the embedding and LM head on every rank (the last rank's tail is padding)."""
    return -(-cfg.vocab_size // size)


def vocab(cfg: ModelConfig, tp: TensorParallel) -> range:
    """The token ids whose embedding and LM head rows rank `tp.rank` holds (fewer than
    vocab_per_rank on the last rank when N does not divide the vocabulary)."""
    per = vocab_per_rank(cfg, tp.size)
    return range(min(tp.rank * per, cfg.vocab_size), min((tp.rank + 1) * per, cfg.vocab_size))


def local_config(cfg: ModelConfig, tp: TensorParallel) -> ModelConfig:
    """The config of one rank's module: its query heads, KV heads and intermediate width."""
    check_shardable(cfg, tp.size)
    return dataclasses.replace(cfg, num_attention_heads=len(q_heads(cfg, tp)),
                               num_key_value_heads=len(kv_heads(cfg, tp)),
                               intermediate_size=len(intermediate(cfg, tp)))
