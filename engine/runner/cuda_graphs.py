"""CUDA graphs for pure decode steps (one new token per sequence) and for speculative decoding's
verify steps, captured at start.

Decode graphs are captured for bucketed batch sizes (1, 2, 4, 8, then multiples of 16 up to
max_num_seqs); each reads its inputs from the staging buffers' device copies at the offsets of
its bucket's layout (engine/runner/step_layout.py). A batch of B rows replays the smallest bucket >= B; its
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

Steps that carry prompt tokens (prefill chunks, mixed batches) of up to `mixed_max_tokens` tokens
replay piecewise graphs (`PiecewiseGraphs`): the model's forward pass cut at every layer's
attention, one graph per piece, captured per bucket of token counts; attention runs eagerly
between the pieces, so its kernels see the step's own lengths, split decodes from prefills as in an
eager step, and nothing about attention has to fit a bucket. Eagerly such a step spends most of its
time launching kernels, the GPU idle between them; the pieces leave four kernels a layer to
launch.

Other steps (longer ones, whose GPU time hides their launches; prompt logprobs; batches beyond the
largest bucket) run eagerly. Under tensor parallelism every rank captures the same decode buckets,
the collectives inside, and the workers replay theirs when rank 0 does (engine/runner/tensor_parallel.py);
steps with prompt tokens run eagerly there, and speculative decoding does not run under tensor
parallelism, so no verify graph is captured there either.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import structlog
import torch

from pie.model.llama import LlamaForCausalLM

from ..scheduling.step import SchedulerOutput
from .attention import AttentionMetadata, PagedAttention
from .staging import StepStager
from .step_layout import Packed

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE  # graph_pool_handle()'s type (a runtime import is a cycle)

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
    offsets of its layout (engine/runner/step_layout.py), with the block tables' whole-width rows."""
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


def _timed_replays(graph: torch.cuda.CUDAGraph, n: int = 3) -> float:
    """The median of n replays of a captured graph on the inputs staged for it, seconds."""
    times = []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        graph.replay()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return sorted(times)[n // 2]


KV_TIMING_CONTEXT = 1024  # tokens of context per row when timing what context adds to a decode step


def _kv_token_seconds(graph: torch.cuda.CUDAGraph, stager: StepStager, rows: int, attention: PagedAttention,
                      max_model_len: int, base_s: float) -> float | None:
    """What one token of context adds to a decode step, seconds: the decode graph of `rows` rows,
    captured over one-token contexts (`base_s`), replayed with every row over KV_TIMING_CONTEXT
    tokens (or what the pool holds) in pages of its own, then restaged as captured. The pages are
    read, never written (the rows' slots stay -1), so what the pool holds does not matter. None
    when the pool has fewer than two pages a row."""
    cache, tables = attention.kv_cache, stager.dev_tables
    assert tables is not None, "graphs read the staging buffers' device copies"
    pages = min(KV_TIMING_CONTEXT, max_model_len) // cache.block_size
    pages = min(pages, cache.num_blocks // rows, tables.shape[1])
    if pages < 2:
        return None
    context = pages * cache.block_size
    layout = Packed(n_tok=rows, rows=rows)
    seq_lens = stager.dev_ints[layout.seq_lens]
    seq_lens.fill_(context)
    tables[:rows, :pages].copy_(torch.arange(rows * pages, dtype=tables.dtype, device=tables.device).view(rows, pages))
    try:
        long_s = _timed_replays(graph)
    finally:
        seq_lens.fill_(1)
        tables[:rows].zero_()
    return max(long_s - base_s, 0.0) / (rows * (context - 1))


class Graph:
    __slots__ = ("graph", "logits")

    def __init__(self, graph: torch.cuda.CUDAGraph, logits: torch.Tensor) -> None:
        self.graph = graph
        self.logits = logits  # (bucket tokens, vocab) fp32, rewritten by every replay


class CudaGraphs:
    """The captured graphs of one runner: decode graphs by bucket, verify graphs by bucket (rows);
    empty: every step runs eagerly."""

    def __init__(self, prompt_rows_decode: bool = True) -> None:
        self.graphs: dict[int, Graph] = {}  # decode steps, by rows
        self.verify: dict[int, Graph] = {}  # verify steps, by rows of verify_width tokens
        self.verify_width = 0  # tokens per verify row: 1 + K (0: no verify graphs)
        # A replay of each decode bucket, timed at capture (one-token contexts, dummy rows), seconds,
        # and what each token of context adds to it (the largest bucket replayed again over long
        # contexts): the scheduler's model of a decode step (StallBound.prior, .kv_token_s).
        self.replay_seconds: dict[int, float] = {}
        self.kv_token_seconds: float | None = None
        # A prompt's last token alone in its row may run in a decode graph (off in the
        # batch-invariant mode: StepStager.prompt_rows_decode).
        self.prompt_rows_decode = prompt_rows_decode

    def __bool__(self) -> bool:
        return bool(self.graphs)

    def bucket_for(self, out: SchedulerOutput) -> int | None:
        """The bucket whose graph runs this step: a pure decode with a bucket large enough."""
        if not self.graphs or any(s.num_new_tokens != 1 for s in out.scheduled):
            return None
        if not self.prompt_rows_decode and any(s.at_prompt for s in out.scheduled):
            return None
        b = len(out.scheduled)
        return next((g for g in self.graphs if g >= b), None)

    def verify_bucket_for(self, out: SchedulerOutput) -> int | None:
        """The verify bucket whose graph runs this step: a step with proposals in which every row
        is a decode (it samples, and runs its newest token and its k <= K proposals only), with a
        bucket large enough. A step with prompt chunks beside them runs from the piecewise graphs
        (`PiecewiseGraphs`) or eagerly."""
        if not self.verify or not out.num_spec_tokens:
            return None
        w = self.verify_width
        if any(not s.sample or s.num_new_tokens != 1 + s.num_spec or s.num_new_tokens > w for s in out.scheduled):
            return None
        b = len(out.scheduled)
        return next((g for g in self.verify if g >= b), None)

    @torch.inference_mode()
    def capture(self, forward: Forward, attention: PagedAttention, stager: StepStager, *, max_num_seqs: int,
                max_model_len: int, verify_rows: int = 0, verify_width: int = 0, time_replays: bool = True) -> None:
        """Captures `forward` (with the logits) for every decode bucket and, with `verify_rows`, every
        verify bucket of `verify_width` tokens per row, the most tokens first, into one memory pool.
        Each bucket first runs once eagerly, which also compiles its Triton kernels. `time_replays`:
        time each decode bucket's replay (`replay_seconds`); not under tensor parallelism, where a
        replay needs every rank."""
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
            if w == 1 and time_replays:
                self.replay_seconds[b] = _timed_replays(graph)
                if self.kv_token_seconds is None:  # the largest decode bucket comes first
                    self.kv_token_seconds = _kv_token_seconds(graph, stager, b, attention, max_model_len,
                                                              self.replay_seconds[b])
        torch.cuda.synchronize()
        self.graphs = dict(sorted(self.graphs.items()))
        self.replay_seconds = dict(sorted(self.replay_seconds.items()))
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
            self.replay_seconds = {}
            self.kv_token_seconds = None


def mixed_buckets(max_tokens: int) -> list[int]:
    """Token counts captured for steps with prompt tokens: multiples of 16 up to 128, of 32 up to
    512, of 64 up to 1024, then of 128, and max_tokens itself. A step pads by less than 16 tokens,
    a quarter of itself or, past 512 tokens, an eighth: its GPU time grows with the padding, where
    the launches it saves do not."""
    sizes = [n for n in range(16, max_tokens, 16) if n <= 128 or (n <= 512 and n % 32 == 0)
             or (n <= 1024 and n % 64 == 0) or n % 128 == 0]
    return sorted(set(sizes + [max_tokens])) if max_tokens >= 1 else []


class _Cut:
    """The attention backend the model sees while its pieces are captured (or warmed up): at each
    layer's attention it copies q, k and v into the static buffers the eager attention will read at
    replay, ends the piece (`cut`), and returns the static buffer that attention writes its output
    into, which the next piece reads."""

    def __init__(self, graphs: PiecewiseGraphs, num_tokens: int, cut: Callable[[], None]) -> None:
        self.g, self.n, self.cut = graphs, num_tokens, cut

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        g, n = self.g, self.n
        g.q[:n].copy_(q)
        g.k[:n].copy_(k)
        g.v[:n].copy_(v)
        self.cut()
        return g.o[:n]


class PiecewiseGraphs:
    """The forward pass of steps with prompt tokens, as CUDA graphs of the pieces between the
    layers' attention calls, by bucket of token counts (`mixed_buckets`).

    Static buffers shared by every bucket: the input ids and positions, each layer's q, k and v
    (copied there at the end of the piece that made them) and the attention output the next piece
    reads. A bucket of N tokens keeps its final hidden states (N, hidden); everything else its
    pieces allocate comes from one memory pool and is scratch between pieces. A step of T <= N
    tokens copies its ids and positions in, then replays piece 0, attends over the step's T tokens
    (the attention metadata as staged for an eager step), replays piece 1, and so on; the rows past
    T compute on the ids and positions earlier steps left (valid values, zero at first) and are
    never read."""

    def __init__(self) -> None:
        self.pieces: dict[int, list[torch.cuda.CUDAGraph]] = {}  # by bucket: num_layers + 1 graphs
        self.hidden: dict[int, torch.Tensor] = {}  # by bucket: (N, hidden), rewritten by every replay
        self.ids = self.positions = torch.empty(0)
        self.q = self.k = self.v = self.o = torch.empty(0)

    def __bool__(self) -> bool:
        return bool(self.pieces)

    def bucket_for(self, num_tokens: int) -> int | None:
        return next((n for n in self.pieces if n >= num_tokens), None)

    @torch.inference_mode()
    def capture(self, model: LlamaForCausalLM, ids_dtype: torch.dtype, max_tokens: int,
                device: torch.device) -> None:
        """Captures every bucket up to `max_tokens`, the largest first, into one memory pool; each
        bucket's pieces first run once unrecorded, which also compiles their kernels."""
        cfg = model.config
        hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        dtype = model.embed_tokens.weight.dtype
        self.ids = torch.zeros(max_tokens, dtype=ids_dtype, device=device)
        self.positions = torch.zeros(max_tokens, dtype=ids_dtype, device=device)
        self.q = torch.zeros(max_tokens, hq, d, dtype=dtype, device=device)
        self.k = torch.zeros(max_tokens, hkv, d, dtype=dtype, device=device)
        self.v = torch.zeros(max_tokens, hkv, d, dtype=dtype, device=device)
        self.o = torch.zeros(max_tokens, hq, d, dtype=dtype, device=device)
        before = torch.cuda.memory_allocated(device)
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(device)
        for n in sorted(mixed_buckets(max_tokens), reverse=True):
            self.pieces[n], self.hidden[n] = self._capture_bucket(model, n, pool, stream)
            assert len(self.pieces[n]) == cfg.num_hidden_layers + 1
        torch.cuda.synchronize(device)
        self.pieces = dict(sorted(self.pieces.items()))
        log.info("piecewise_graphs_captured", token_buckets=len(self.pieces), max_tokens=max_tokens,
                 pieces_per_bucket=cfg.num_hidden_layers + 1,
                 memory_mib=round((torch.cuda.memory_allocated(device) - before) / 2**20))

    def _capture_bucket(self, model: LlamaForCausalLM, n: int, pool: _POOL_HANDLE,
                        stream: torch.cuda.Stream) -> tuple[list[torch.cuda.CUDAGraph], torch.Tensor]:
        """The pieces of the forward pass over the first n static ids and positions, and its output."""
        ids, positions = self.ids[:n], self.positions[:n]
        model(ids, positions, _Cut(self, n, lambda: None))  # warm-up
        torch.cuda.synchronize(stream.device)
        pieces: list[torch.cuda.CUDAGraph] = []
        current = [torch.cuda.CUDAGraph()]

        def cut() -> None:  # the piece being captured ends at this attention call; the next begins
            current[0].capture_end()
            pieces.append(current[0])
            current[0] = torch.cuda.CUDAGraph()
            current[0].capture_begin(pool=pool)

        stream.wait_stream(torch.cuda.current_stream(stream.device))
        with torch.cuda.stream(stream):
            current[0].capture_begin(pool=pool)
            try:
                hidden = model(ids, positions, _Cut(self, n, cut))
            finally:
                current[0].capture_end()  # also when the forward raised: the stream leaves capture mode
            pieces.append(current[0])
        torch.cuda.current_stream(stream.device).wait_stream(stream)
        return pieces, hidden

    def replay(self, bucket: int, input_ids: torch.Tensor, positions: torch.Tensor,
               attention: PagedAttention) -> torch.Tensor:
        """The final hidden states (bucket, hidden) of the step whose T tokens are `input_ids` and
        `positions`, `attention.metadata` set for them; rows T.. are padding."""
        t = input_ids.shape[0]
        self.ids[:t].copy_(input_ids)
        self.positions[:t].copy_(positions)
        q, k, v, o = self.q[:t], self.k[:t], self.v[:t], self.o[:t]
        pieces = self.pieces[bucket]
        for layer, piece in enumerate(pieces[:-1]):
            piece.replay()
            attention(layer, q, k, v, out=o)
        pieces[-1].replay()
        return self.hidden[bucket]

    def drop(self) -> None:
        self.pieces, self.hidden = {}, {}
