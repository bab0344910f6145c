"""CUDA graphs for pure decode steps (one new token per sequence), captured at start.

Graphs are captured for bucketed batch sizes (1, 2, 4, 8, then multiples of 16 up to
max_num_seqs), largest first, into one memory pool; each reads its inputs from the staging
buffers' device copies at the offsets of its bucket's layout (engine/staging.py). A batch of B
rows replays the smallest bucket >= B; its padding rows write no slot and attend to nothing. Other
steps (prefill chunks, mixed batches, batches beyond the largest bucket) run eagerly. Under tensor
parallelism every rank captures the same buckets, the collectives inside, and the workers replay
theirs when rank 0 does (engine/tensor_parallel.py).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import structlog
import torch

from engine.attention import PagedAttention
from engine.scheduler import SchedulerOutput
from engine.staging import Packed, StepStager

log = structlog.get_logger(__name__)

# (input ids, positions) -> logits (B, V): the forward pass a graph captures
Forward = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def graph_buckets(max_batch: int) -> list[int]:
    """Captured decode batch sizes: 1, 2, 4, 8, then every multiple of 16 up to max_batch (which
    is always included), so a batch pads by at most 15 rows."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 16)) + [max_batch]
    return sorted(set(sizes))


class Graph:
    __slots__ = ("graph", "logits")

    def __init__(self, graph: torch.cuda.CUDAGraph, logits: torch.Tensor) -> None:
        self.graph = graph
        self.logits = logits  # (bucket, vocab) fp32, rewritten by every replay


class CudaGraphs:
    """The captured decode graphs of one runner, by bucket (empty: every step runs eagerly)."""

    def __init__(self) -> None:
        self.graphs: dict[int, Graph] = {}

    def __bool__(self) -> bool:
        return bool(self.graphs)

    def bucket_for(self, out: SchedulerOutput) -> int | None:
        """The bucket whose graph runs this step: a pure decode with a bucket large enough."""
        if not self.graphs or any(s.num_new_tokens != 1 for s in out.scheduled):
            return None
        b = len(out.scheduled)
        return next((g for g in self.graphs if g >= b), None)

    @torch.inference_mode()
    def capture(self, forward: Forward, attention: PagedAttention, stager: StepStager, *, max_num_seqs: int,
                max_model_len: int) -> None:
        """Captures `forward` (with the logits) for every bucket, largest first, into one memory
        pool. Each bucket first runs once eagerly, which also compiles its Triton kernels."""
        if stager.dev_tables is None:
            raise RuntimeError("CUDA graphs need a CUDA device")
        pool = torch.cuda.graph_pool_handle()
        for b in reversed(graph_buckets(max_num_seqs)):
            layout = Packed(n_tok=b, rows=b)
            dev = stager.dev_ints[:layout.end]
            host = stager.host_ints[:layout.end].numpy()
            # Dummy decode of b rows: one cached token each, in block 0 (never written: slot -1).
            host[layout.ids], host[layout.positions], host[layout.slots], host[layout.seq_lens] = 0, 0, -1, 1
            host[layout.query_start_loc] = np.arange(b + 1)
            dev.copy_(stager.host_ints[:layout.end])
            stager.dev_tables[:b].zero_()
            # The split count must serve any context length.
            attention.metadata = layout.metadata(dev, stager.dev_tables[:b], max_query_len=1,
                                                 max_seq_len=max_model_len, num_decodes=b)
            ids, positions = dev[layout.ids], dev[layout.positions]
            try:
                forward(ids, positions)  # warm-up
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    logits = forward(ids, positions)
            finally:
                attention.metadata = None
            self.graphs[b] = Graph(graph, logits)
        torch.cuda.synchronize()
        self.graphs = dict(sorted(self.graphs.items()))
        log.info("cuda_graphs_captured", batch_sizes=list(self.graphs))

    def replay(self, bucket: int) -> torch.Tensor:
        """Runs the bucket's graph on what the staging buffers hold; returns its logits (bucket, V)."""
        g = self.graphs[bucket]
        g.graph.replay()
        return g.logits

    def drop(self, device: torch.device) -> None:
        """Releases the captured graphs (decode steps run eagerly after this)."""
        if self.graphs:
            torch.cuda.synchronize(device)
            self.graphs = {}
