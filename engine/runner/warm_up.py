"""What a runner runs before it serves: one prefill of every shape the extend kernel compiles for
and one mixed step per decode graph bucket (`warm_up`, so Triton compiles at start and not under
load), and the worst-case step the KV pool's sizing measures (`profile`, engine/runner/kv_sizing.py).
"""

from __future__ import annotations

import structlog

from ..sampling_params import MAX_LOGPROBS, SamplingParams
from ..scheduling.request import Request
from ..scheduling.step import ScheduledRequest, SchedulerOutput
from .cuda_graphs import graph_buckets
from .model_runner import ModelRunner

log = structlog.get_logger(__name__)


def profile(runner: ModelRunner, prompt_lens: list[int]) -> None:
    """One prefill step of sequences with these prompt lengths, sampled with every sampler
    feature on (penalties, logit bias, top-k/top-p/min-p, logprobs, prompt logprobs): what sizing
    the KV pool measures.
    Needs sum(prompt_lens) / block_size blocks in the runner's cache; writes block 0 onward."""
    top = min(MAX_LOGPROBS, runner.vocab_size)
    sampling = SamplingParams(max_tokens=1, temperature=1.0, top_p=0.9, min_p=0.05,
                              repetition_penalty=1.1, frequency_penalty=0.1, presence_penalty=0.1,
                              logprobs=top, prompt_logprobs=top, logit_bias={0: 1.0})
    scheduled, next_block = [], 0
    for i, n in enumerate(prompt_lens):
        blocks = -(-n // runner.block_size)
        req = Request(f"profile-{i}", [1] * n, sampling, max_model_len=runner.max_model_len, seed=i)
        req.block_ids = list(range(next_block, next_block + blocks))  # outside the block manager's pool
        scheduled.append(ScheduledRequest(req, n, 0, True))
        next_block += blocks
    # Every prompt position's logprobs too: the largest slice of prompt logits is part of the peak.
    runner.execute(SchedulerOutput(scheduled=scheduled, num_batched_tokens=sum(prompt_lens),
                                   prompt_logprobs=[s for s in scheduled if s.num_new_tokens > 1]))


def warm_up(runner: ModelRunner) -> None:
    """Prefills of 2, 3, 5, 9, ... tokens, one per tile variant of the extend kernel (its
    BLOCK_M follows the longest query of a step in powers of two), then a step of B decodes
    beside a prompt chunk for every decode graph bucket B (`mixed_step`), so that Triton
    compiles them at start and not under load. Writes the cache's first blocks; nothing refers
    to them yet."""
    n = 2
    while n < runner.max_model_len and n <= runner.max_tokens and -(-n // runner.block_size) <= runner.kv_cache.num_blocks:
        profile(runner, [n])
        n = 2 * n - 1
    per_row = -(-4 // runner.block_size)  # blocks of a mixed_step row
    # (the prompt chunk takes a row: the largest bucket warms up one decode short)
    sizes = sorted({min(b, runner.max_num_seqs - 1) for b in graph_buckets(runner.max_num_seqs)} - {0})
    buckets = [b for b in sizes if b + 3 <= runner.max_tokens and (b + 1) * per_row <= runner.kv_cache.num_blocks]
    for b in buckets:
        mixed_step(runner, b)
    log.info("warmed_up", longest_prefill=(n + 1) // 2, mixed_steps=len(buckets))


def mixed_step(runner: ModelRunner, num_decodes: int) -> None:
    """One step of `num_decodes` decodes at short contexts (the decode kernel's one-split
    launch, at this batch's launch table) beside a 3-token prompt chunk over one cached token
    (the prompt path with a prefix): the kernels a mixed step runs eagerly, which the decode
    graphs (whole-context splits, bucket batches) never compile. Needs (num_decodes + 1) x
    ceil(4 / block_size) blocks of the runner's cache; writes block 0 onward."""
    sampling = SamplingParams(max_tokens=1, temperature=0.0)
    per_row = -(-4 // runner.block_size)
    scheduled = []
    for i in range(num_decodes + 1):
        req = Request(f"warm-{i}", [1] * 4, sampling, max_model_len=runner.max_model_len, seed=i)
        req.block_ids = list(range(i * per_row, (i + 1) * per_row))  # outside the block manager's pool
        start, n = (3, 1) if i < num_decodes else (1, 3)
        req.num_computed_tokens = start
        scheduled.append(ScheduledRequest(req, n, start, True))
    runner.execute(SchedulerOutput(scheduled=scheduled, num_batched_tokens=num_decodes + 3))
