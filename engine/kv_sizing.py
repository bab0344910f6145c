"""How many KV blocks an engine gets: an exact count, a byte budget, or (on CUDA) what the
device's memory fraction leaves once the weights and the peak of a profiling step are counted."""

from __future__ import annotations

from collections.abc import Callable

import structlog
import torch

from engine.config import EngineConfig
from engine.model_runner import ModelRunner

log = structlog.get_logger(__name__)

CPU_KV_CACHE_BYTES = 1 << 30  # the KV pool on the CPU when no size is given


def num_kv_blocks(config: EngineConfig, device: torch.device, block_bytes: int, max_model_len: int,
                  make_runner: Callable[[int], ModelRunner]) -> int:
    """Blocks of `block_bytes` each (all layers, K and V, scales included). `make_runner(n)`
    builds a runner over a temporary cache of n blocks, for the profiling step on CUDA."""
    if config.num_kv_blocks:
        return config.num_kv_blocks
    if config.kv_cache_memory_bytes is not None:
        return max(1, config.kv_cache_memory_bytes // block_bytes)
    if device.type == "cuda":
        return _blocks_from_free_memory(config, device, block_bytes, max_model_len, make_runner)
    return max(1, CPU_KV_CACHE_BYTES // block_bytes)


def _blocks_from_free_memory(c: EngineConfig, device: torch.device, block_bytes: int, max_model_len: int,
                             make_runner: Callable[[int], ModelRunner]) -> int:
    """KV blocks that fit in gpu_memory_fraction of the device once the weights and the peak of
    a profiling step are counted: one prefill of max_num_batched_tokens tokens (the largest
    activations a step makes) plus logits and sampling for max_num_seqs rows."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    used_before = total - free  # CUDA context, weights, anything else on the device
    n_tok = min(c.max_num_batched_tokens, max_model_len - 1)
    rows = min(c.max_num_seqs, n_tok)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    runner = make_runner(-(-n_tok // c.block_size) + rows)
    lens = [n_tok // rows] * rows
    lens[-1] += n_tok - sum(lens)
    runner.profile(lens)
    torch.cuda.synchronize(device)
    activation_peak = torch.cuda.max_memory_allocated(device) - base
    del runner
    torch.cuda.empty_cache()
    budget = int(total * c.gpu_memory_fraction) - used_before - activation_peak
    if budget < block_bytes:
        raise ValueError(
            f"gpu_memory_fraction {c.gpu_memory_fraction} of {total / 2**30:.1f} GiB leaves no room for the "
            f"KV cache: {used_before / 2**30:.1f} GiB are in use and a step peaks at "
            f"{activation_peak / 2**30:.2f} GiB more")
    log.info("kv_cache_sized", gpu_memory_fraction=c.gpu_memory_fraction, total_gib=round(total / 2**30, 2),
             in_use_gib=round(used_before / 2**30, 2), step_peak_gib=round(activation_peak / 2**30, 2),
             kv_cache_gib=round(budget / 2**30, 2))
    return budget // block_bytes
