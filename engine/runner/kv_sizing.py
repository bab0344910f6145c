"""How many KV blocks an engine gets: an exact count, a byte budget, or (on CUDA) what the
device's memory fraction leaves once the weights and the peak of a profiling step are counted.

On the CPU without a budget the pool is what the configuration can use, `max_num_seqs` sequences
of the whole context, capped at CPU_KV_CACHE_BYTES: a 1 GiB pool by default held 493k tokens of
the bundled model where 64 x 512 = 32k can ever be in use, and cost its RSS for nothing.

A budget (given, the CPU's default, or CUDA's leftover) that cannot hold one sequence of the
context is refused at start, naming the flag to change (vLLM refuses the same way); an exact
`num_kv_blocks` is taken as given (tests size small pools on purpose, and a prompt that does not
fit is refused as PROMPT_TOO_LONG).
"""

from __future__ import annotations

from collections.abc import Callable

import structlog
import torch

from ..config import EngineConfig
from ..errors import StartupError
from .model_runner import ModelRunner
from .warm_up import profile

log = structlog.get_logger(__name__)

CPU_KV_CACHE_BYTES = 1 << 30  # the most the CPU's KV pool takes when no size is given


def usable_blocks(config: EngineConfig, max_model_len: int) -> int:
    """Blocks that max_num_seqs sequences of the whole context can occupy at once."""
    return config.max_num_seqs * -(-max_model_len // config.block_size)


def num_kv_blocks(config: EngineConfig, device: torch.device, block_bytes: int, max_model_len: int,
                  make_runner: Callable[[int], ModelRunner]) -> int:
    """Blocks of `block_bytes` each (all layers, K and V, scales included). `make_runner(n)`
    builds a runner over a temporary cache of n blocks, for the profiling step on CUDA. Raises
    StartupError when a budget cannot hold one sequence of `max_model_len` tokens."""
    if config.num_kv_blocks:
        return config.num_kv_blocks
    blocks = budget_blocks(config, device, block_bytes, max_model_len)
    if blocks is not None and config.kv_cache_memory_bytes is None:
        log.info("kv_cache_sized", device=str(device), kv_blocks=blocks, kv_cache_tokens=blocks * config.block_size,
                 kv_cache_mib=round(blocks * block_bytes / 2**20, 1), max_num_seqs=config.max_num_seqs,
                 max_model_len=max_model_len, cap_mib=CPU_KV_CACHE_BYTES >> 20)
    if blocks is None:  # CUDA without a byte budget: what the memory fraction leaves
        blocks = _blocks_from_free_memory(config, device, block_bytes, max_model_len, make_runner)
        check_holds_one_sequence(blocks, config, max_model_len,
                                 f"--gpu-memory-fraction {config.gpu_memory_fraction} leaves room for",
                                 "raise --gpu-memory-fraction, give --kv-cache-memory, or lower --max-model-len")
    return blocks


def budget_blocks(config: EngineConfig, device: torch.device, block_bytes: int, max_model_len: int) -> int | None:
    """The pool of a budget known before anything is loaded: --kv-cache-memory, or the CPU's
    default (None on CUDA without --kv-cache-memory: that needs the profiling step). Checked to
    hold one sequence (StartupError otherwise), so the server can refuse before it binds."""
    if config.kv_cache_memory_bytes is not None:
        blocks = config.kv_cache_memory_bytes // block_bytes
        gib = config.kv_cache_memory_bytes / 2**30
        need = -(-max_model_len // config.block_size) * block_bytes / 2**30
        check_holds_one_sequence(blocks, config, max_model_len, f"--kv-cache-memory {gib:.4g} GiB holds",
                                 f"raise --kv-cache-memory to at least {need:.3g} (GiB) or lower --max-model-len")
        return blocks
    if device.type == "cuda":
        return None
    blocks = min(usable_blocks(config, max_model_len), CPU_KV_CACHE_BYTES // block_bytes)
    check_holds_one_sequence(blocks, config, max_model_len,
                             f"the CPU's default KV pool ({CPU_KV_CACHE_BYTES / 2**30:g} GiB at most) holds",
                             "give a larger --kv-cache-memory (GiB) or lower --max-model-len")
    return blocks


def check_holds_one_sequence(blocks: int, config: EngineConfig, max_model_len: int, what: str, fix: str) -> None:
    """Raises StartupError when `blocks` cannot hold one sequence of the whole context; `what`
    names the budget ("--kv-cache-memory 0.01 GiB holds"), `fix` says what to change."""
    need = -(-max_model_len // config.block_size)
    if blocks < need:
        raise StartupError(f"{what} {blocks * config.block_size} tokens of KV cache, fewer than one sequence of "
                           f"{max_model_len} tokens (the context; --max-model-len): {fix}")


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
    profile(runner, lens)
    torch.cuda.synchronize(device)
    activation_peak = torch.cuda.max_memory_allocated(device) - base
    del runner
    torch.cuda.empty_cache()
    budget = int(total * c.gpu_memory_fraction) - used_before - activation_peak
    if budget < block_bytes:
        raise StartupError(
            f"--gpu-memory-fraction {c.gpu_memory_fraction} of {total / 2**30:.1f} GiB leaves no room for the "
            f"KV cache: {used_before / 2**30:.1f} GiB are in use and a step peaks at "
            f"{activation_peak / 2**30:.2f} GiB more; raise --gpu-memory-fraction or free the GPU")
    log.info("kv_cache_sized", gpu_memory_fraction=c.gpu_memory_fraction, total_gib=round(total / 2**30, 2),
             in_use_gib=round(used_before / 2**30, 2), step_peak_gib=round(activation_peak / 2**30, 2),
             kv_cache_gib=round(budget / 2**30, 2))
    return budget // block_bytes
