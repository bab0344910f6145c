"""CUDA graphs for pure decode steps (one new token per sequence) and for speculative decoding's
verify steps, captured at start.

Decode graphs are captured for bucketed batch sizes (1, 2, 4, 8, then multiples of 16 up to
max_num_seqs); each reads its inputs from the staging buffers' device copies at the offsets of
its bucket's layout (engine/staging.py). A batch of B rows replays the smallest bucket >= B; its
padding rows write no slot and attend to nothing.

Verify graphs (only with speculative decoding on) are captured for buckets of B rows up to
min(speculative_max_batch, max_num_seqs), each row W = 1 + K tokens wide (K: proposals per row at
most), in the strided layout `StepStager.stage_verify` writes:

    row i:  | newest token | proposal 1 .. k | padding (W - 1 - k) |   tokens [i W, (i + 1) W)
    rows B.. of the bucket: padding, W tokens each

Every row attends through the extend kernel (no decode rows first, whatever k is): its query run
is the W tokens and its length `start + W`, so the extend kernel finds the row's cached context
(`start`) as it does for the eager step; padding writes no slot (-1), sits after the row's real
tokens (causally invisible to them) at RoPE position 0, and its outputs are never read. What the
extend kernel takes from the host is then fixed per bucket: the token count (B W), the rows, and
max_query_len W (its BLOCK_M); its grid (T // BLOCK_Q + B programs per kv head) and its key loops
(bounds loaded from seq_lens on the device) need no host copy of any length, so one graph serves
every context up to max_model_len and every k <= K. (The decode kernel, whose split count comes
from a host max_seq_len, is not in these graphs.) The graph makes the logits of all B W tokens;
the runner takes each row's 1 + k of them by an index staged with the inputs.

Other steps (prefill chunks, mixed batches, prompt logprobs, batches beyond the largest bucket)
run eagerly. Under tensor parallelism every rank captures the same decode buckets, the
collectives inside, and the workers replay theirs when rank 0 does (engine/tensor_parallel.py);
speculative decoding does not run under tensor parallelism, so no verify graph is captured there.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import structlog
import torch

from engine.attention import AttentionMetadata, PagedAttention
from engine.scheduler import SchedulerOutput
from engine.staging import Packed, StepStager

log = structlog.get_logger(__name__)

# (input ids, positions) -> logits (T, V) of every token: the forward pass a graph captures
Forward = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def graph_buckets(max_batch: int) -> list[int]:
    """Captured decode batch sizes: 1, 2, 4, 8, then every multiple of 16 up to max_batch (which
    is always included), so a batch pads by at most 15 rows."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 16)) + [max_batch]
    return sorted(set(sizes))


def graph_inputs(stager: StepStager, rows: int, width: int,
                 max_model_len: int) -> tuple[AttentionMetadata, torch.Tensor, torch.Tensor]:
    """What the graph of `rows` rows of `width` tokens each (1: decode) reads: the attention
    metadata, input ids and positions as views of the staging buffers' device copies, at the
    offsets of its layout (engine/staging.py), with the block tables' whole-width rows."""
    assert stager.dev_tables is not None, "graphs read the staging buffers' device copies"
    layout = Packed(n_tok=rows * width, rows=rows)
    dev = stager.dev_ints[:layout.end]
    if width == 1:
        # The split count (fixed splits or the batch count: TritonOps.decode) must cover any context length.
        metadata = layout.metadata(dev, stager.dev_tables[:rows], max_query_len=1, max_seq_len=max_model_len,
                                   num_decodes=rows)
    else:
        # Every row through the extend kernel (no decode rows first), its BLOCK_M from
        # max_query_len = width. max_seq_len is not read on that path; the bound it would be:
        metadata = layout.metadata(dev, stager.dev_tables[:rows], max_query_len=width,
                                   max_seq_len=max_model_len + width - 1, num_decodes=0)
    return metadata, dev[layout.ids], dev[layout.positions]


class Graph:
    __slots__ = ("graph", "logits")

    def __init__(self, graph: torch.cuda.CUDAGraph, logits: torch.Tensor) -> None:
        self.graph = graph
        self.logits = logits  # (bucket tokens, vocab) fp32, rewritten by every replay


class CudaGraphs:
    """The captured graphs of one runner: decode graphs by bucket, verify graphs by bucket (rows);
    empty: every step runs eagerly."""

    def __init__(self) -> None:
        self.graphs: dict[int, Graph] = {}  # decode steps, by rows
        self.verify: dict[int, Graph] = {}  # verify steps, by rows of verify_width tokens
        self.verify_width = 0  # tokens per verify row: 1 + K (0: no verify graphs)

    def __bool__(self) -> bool:
        return bool(self.graphs)

    def bucket_for(self, out: SchedulerOutput) -> int | None:
        """The bucket whose graph runs this step: a pure decode with a bucket large enough."""
        if not self.graphs or any(s.num_new_tokens != 1 for s in out.scheduled):
            return None
        b = len(out.scheduled)
        return next((g for g in self.graphs if g >= b), None)

    def verify_bucket_for(self, out: SchedulerOutput) -> int | None:
        """The verify bucket whose graph runs this step: a step with proposals in which every row
        is a decode (it samples, and runs its newest token and its k <= K proposals only), with a
        bucket large enough. A step with prompt chunks beside them runs eagerly."""
        if not self.verify or not out.num_spec_tokens:
            return None
        w = self.verify_width
        if any(not s.sample or s.num_new_tokens != 1 + s.num_spec or s.num_new_tokens > w for s in out.scheduled):
            return None
        b = len(out.scheduled)
        return next((g for g in self.verify if g >= b), None)

    @torch.inference_mode()
    def capture(self, forward: Forward, attention: PagedAttention, stager: StepStager, *, max_num_seqs: int,
                max_model_len: int, verify_rows: int = 0, verify_width: int = 0) -> None:
        """Captures `forward` (with the logits) for every decode bucket and, with `verify_rows`, every
        verify bucket of `verify_width` tokens per row, the most tokens first, into one memory pool.
        Each bucket first runs once eagerly, which also compiles its Triton kernels."""
        if stager.dev_tables is None:
            raise RuntimeError("CUDA graphs need a CUDA device")
        if verify_rows:
            assert verify_width > 1, "a verify row holds the newest token and at least one proposal"
        # (rows, tokens per row): decode buckets (width 1), then verify buckets
        shapes = [(b, 1) for b in graph_buckets(max_num_seqs)]
        shapes += [(b, verify_width) for b in graph_buckets(verify_rows)] if verify_rows else []
        pool = torch.cuda.graph_pool_handle()
        for b, w in sorted(shapes, key=lambda bw: bw[0] * bw[1], reverse=True):
            layout = Packed(n_tok=b * w, rows=b)
            host = stager.host_ints[:layout.end].numpy()
            # Dummy step of b rows, w tokens each, in block 0 (never written: slot -1): a decode
            # with one cached token, or a verify row with nothing cached before its w tokens.
            host[layout.ids], host[layout.positions], host[layout.slots], host[layout.seq_lens] = 0, 0, -1, w
            host[layout.query_start_loc] = np.arange(b + 1) * w
            stager.dev_ints[:layout.end].copy_(stager.host_ints[:layout.end])
            stager.dev_tables[:b].zero_()
            attention.metadata, ids, positions = graph_inputs(stager, b, w, max_model_len)
            try:
                forward(ids, positions)  # warm-up
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    logits = forward(ids, positions)
            finally:
                attention.metadata = None
            (self.graphs if w == 1 else self.verify)[b] = Graph(graph, logits)
        torch.cuda.synchronize()
        self.graphs = dict(sorted(self.graphs.items()))
        self.verify = dict(sorted(self.verify.items()))
        self.verify_width = verify_width if self.verify else 0
        log.info("cuda_graphs_captured", batch_sizes=list(self.graphs), verify_batch_sizes=list(self.verify),
                 verify_tokens_per_row=self.verify_width)

    def replay(self, bucket: int) -> torch.Tensor:
        """Runs the decode bucket's graph on what the staging buffers hold; returns its logits
        (bucket, V)."""
        g = self.graphs[bucket]
        g.graph.replay()
        return g.logits

    def replay_verify(self, bucket: int) -> torch.Tensor:
        """Runs the verify bucket's graph on what the staging buffers hold (`StepStager.stage_verify`);
        returns the logits of all its tokens (bucket * verify_width, V), row by row."""
        g = self.verify[bucket]
        g.graph.replay()
        return g.logits

    def drop(self, device: torch.device) -> None:
        """Releases the captured graphs (every step runs eagerly after this)."""
        if self.graphs or self.verify:
            torch.cuda.synchronize(device)
            self.graphs = {}
            self.verify = {}
            self.verify_width = 0
