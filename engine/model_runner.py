"""Turns a SchedulerOutput into one forward pass and one batched sample.

Step inputs are built on the host with numpy (a loop over requests, never over tokens) straight
into one pinned staging buffer, then go to the device in two asynchronous copies (the int32 scalars
packed end to end, and the block tables). The only device->host synchronization of a step is
reading the sampled ids back.

Packed int32 layout, for T tokens and B sequences (decode: T = B):

    | input ids (T) | positions (T) | slots (T) | seq lens (B) | query start loc (B + 1) |
    | query start loc of a mixed step's prefill part (B - nd + 1, rebased to 0; mixed steps only) |

A mixed step's first nd sequences are running decodes (the scheduler orders them first): they
attend through the decode kernel, the rest through the extend kernel.

Pure decode steps (one new token per sequence) replay a CUDA graph when the device is CUDA: graphs
are captured at start for bucketed batch sizes (1, 2, 4, 8, then multiples of 16 up to
max_num_seqs) into one memory pool, each reading its inputs from the same device buffers at the
offsets of its bucket size. A batch of B rows runs the smallest bucket >= B; padding rows have
slot -1 (the cache write skips them) and length 0 (attention reads nothing). Other steps (prefill
chunks, mixed batches, batches beyond the largest bucket) run eagerly.
Under tensor parallelism every rank captures the same buckets, the collectives inside, and the
workers replay theirs when rank 0 does (engine/tensor_parallel.py).

Steady decode (the same requests as the last step, each one token further) costs the host little:
the staging buffers still hold the last step's inputs, so only positions, slots, lengths and the
tables that grew a block are rewritten; the input ids come from the last sample on the device in
one copy; and the sampling tensors of the last step are reused with their step counters advanced.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from typing import TYPE_CHECKING

import numpy as np
import structlog
import torch

from engine.config import EngineConfig
from engine.kv_cache import AttentionMetadata, KVCache, PagedAttention
from engine.messages import SampledToken
from engine.request import Request
from engine.sampler import SamplingTensors, sample
from engine.sampling_params import MAX_LOGPROBS, SamplingParams
from engine.scheduler import BlockTables, ScheduledRequest, SchedulerOutput
from model import LlamaForCausalLM

if TYPE_CHECKING:
    from engine.tensor_parallel import Leader, _Link

log = structlog.get_logger(__name__)




class PendingSample:
    """What one launched step sampled, on its way to the host."""

    def __init__(self, requests: list[Request], host: torch.Tensor, n_top: int,
                 done: torch.cuda.Event | None) -> None:
        self.requests = requests  # the rows' requests, in row order
        self._host = host  # (R, 2 + 2 * n_top) float64, pinned on CUDA
        self._n_top = n_top
        self._done = done  # recorded after the device->host copy; None on the CPU

    def result(self) -> list[SampledToken]:
        """Waits for the copy (the step's one host synchronization); the token of each row."""
        if self._done is not None:
            self._done.synchronize()
        n_top = self._n_top
        rows = self._host.tolist()
        if not n_top:
            return [SampledToken(int(row[0]), row[1], []) for row in rows]
        sampled = []
        for r, row in zip(self.requests, rows):
            n = min(r.sampling.logprobs, n_top)
            top = [(int(t), lp) for t, lp in zip(row[2:2 + n], row[2 + n_top:2 + n_top + n])]
            sampled.append(SampledToken(int(row[0]), row[1], top))
        return sampled


def graph_buckets(max_batch: int) -> list[int]:
    """Captured decode batch sizes: 1, 2, 4, 8, then every multiple of 16 up to max_batch (which
    is always included), so a batch pads by at most 15 rows."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 16)) + [max_batch]
    return sorted(set(sizes))


@dataclass(slots=True, frozen=True)
class _Packed:
    """Offsets of the packed int32 sections (module docstring) for n_tok tokens and rows sequences;
    the one place that layout is written down, for `_stage` and `capture_cuda_graphs`."""

    n_tok: int
    rows: int

    @property
    def ids(self) -> slice:
        return slice(0, self.n_tok)

    @property
    def positions(self) -> slice:
        return slice(self.n_tok, 2 * self.n_tok)

    @property
    def slots(self) -> slice:
        return slice(2 * self.n_tok, 3 * self.n_tok)

    @property
    def seq_lens(self) -> slice:
        return slice(3 * self.n_tok, 3 * self.n_tok + self.rows)

    @property
    def query_start_loc(self) -> slice:
        return slice(3 * self.n_tok + self.rows, self.end)

    @property
    def end(self) -> int:
        """Where the optional sections (a mixed step's prefill query starts, pending ids) begin."""
        return 3 * self.n_tok + 2 * self.rows + 1

    def metadata(self, dev: torch.Tensor, block_tables: torch.Tensor, **facts) -> AttentionMetadata:
        """AttentionMetadata viewing `dev` (the packed ints on the device) in this layout."""
        return AttentionMetadata(slot_mapping=dev[self.slots], block_tables=block_tables,
                                 seq_lens=dev[self.seq_lens], query_start_loc=dev[self.query_start_loc], **facts)


def _last_tokens(hidden: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
    """Each sequence's last token's row of `hidden` (T, hidden) -> (B, hidden)."""
    if metadata.max_query_len == 1:
        return hidden  # pure decode: every token is its sequence's last
    return hidden[metadata.query_start_loc[1:].to(torch.int64) - 1]


@dataclass(slots=True)
class _DecodeStaging:
    """What the last pure decode step left in the staging buffers: the next one over the same
    requests, each one token further, rewrites only what moved."""

    layout: _Packed
    table_width: int  # columns of the staged block tables
    requests: list[Request]  # its rows, in order
    starts: np.ndarray  # (B,) position of each row's token
    widths: np.ndarray  # (B,) blocks in each row's table


@dataclass(slots=True)
class StepFacts:
    """The numbers that, with the packed ints and the block tables, make a step's inputs: what
    tensor-parallel workers receive to run the same forward pass (engine/tensor_parallel.py)."""

    n_tok: int  # the layout's token count (T, or the graph bucket)
    rows: int  # the layout's sequence rows
    n_ints: int  # packed ints in use: the layout's sections plus a mixed step's prefill query starts
    n_prefill_ints: int
    max_query_len: int
    max_seq_len: int
    num_decodes: int
    decode_max_seq_len: int

    def numbers(self) -> tuple[int, ...]:
        return (self.n_tok, self.rows, self.n_ints, self.n_prefill_ints, self.max_query_len, self.max_seq_len,
                self.num_decodes, self.decode_max_seq_len)

    def metadata(self, ints: torch.Tensor, block_tables: torch.Tensor) -> AttentionMetadata:
        layout = _Packed(n_tok=self.n_tok, rows=self.rows)
        return layout.metadata(ints, block_tables, max_query_len=self.max_query_len, max_seq_len=self.max_seq_len,
                               num_decodes=self.num_decodes, decode_max_seq_len=self.decode_max_seq_len,
                               prefill_query_start_loc=ints[layout.end:self.n_ints] if self.n_prefill_ints else None)


@dataclass(slots=True)
class _Step:
    """One step's inputs on the device (views of the runner's buffers) and its host facts."""

    input_ids: torch.Tensor  # (T,) int32
    positions: torch.Tensor  # (T,) int32
    metadata: AttentionMetadata
    num_seqs: int
    graph_batch: int | None  # bucket whose graph runs this step; None = eager
    facts: StepFacts
    ints: torch.Tensor  # the packed ints on the device (n_ints)


class _Graph:
    __slots__ = ("graph", "logits")

    def __init__(self, graph: torch.cuda.CUDAGraph, logits: torch.Tensor) -> None:
        self.graph = graph
        self.logits = logits  # (bucket, vocab) fp32, rewritten by every replay


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv_cache: KVCache, *, vocab_size: int, softmax_scale: float,
                 device: torch.device, attention_backend: str = "auto", max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 2048, max_model_len: int = 2048,
                 windows: list[int | None] | None = None, tp_leader: Leader | None = None) -> None:
        self.model = model
        self._tp = tp_leader  # rank 0 of a tensor-parallel group: each step goes to the workers first
        self.kv_cache = kv_cache
        self.block_size = kv_cache.block_size
        self.vocab_size = vocab_size
        self.device = device
        self.max_model_len = max_model_len
        self.attention = PagedAttention(kv_cache, softmax_scale, attention_backend, windows)
        self.max_num_seqs = max_num_seqs
        self.max_tokens = max(max_num_batched_tokens, max_num_seqs)
        self.max_blocks = -(-max_model_len // self.block_size)
        # + the query starts of a mixed step's prefill part (B + 1) + (dst, src) of up to B placeholder ids
        ints = 3 * self.max_tokens + 5 * max_num_seqs + 2
        on_cuda = device.type == "cuda"
        # Host staging (pinned on CUDA, so the copies are asynchronous) and the device buffers the
        # kernels and the captured graphs read. On the CPU the staging buffers are used directly.
        self._host_ints = torch.empty(ints, dtype=torch.int32, pin_memory=on_cuda)
        self._host_tables = torch.empty(max_num_seqs * self.max_blocks, dtype=torch.int32, pin_memory=on_cuda)
        self._dev_tables: torch.Tensor | None = None  # CUDA only, as the two below
        self._copied: torch.cuda.Event | None = None
        if on_cuda:
            self._dev_ints = torch.zeros(ints, dtype=torch.int32, device=device)
            self._dev_tables = torch.zeros(max_num_seqs, self.max_blocks, dtype=torch.int32, device=device)
            self._copied = torch.cuda.Event()  # staging may be rewritten once the last copy is done
            # Sampled ids, logprobs and top logprobs of a step, on their way to the host (launch()).
            sample_cols = 2 + 2 * MAX_LOGPROBS
            self._host_samples = [torch.empty(max_num_seqs * sample_cols, dtype=torch.float64, pin_memory=True)
                                  for _ in range(2)]
            self._sample_events = [torch.cuda.Event(), torch.cuda.Event()]
            self._parity = 0
        else:
            self._dev_ints = self._host_ints
        self._graphs: dict[int, _Graph] = {}
        # Every step runs on this stream: async scheduling frees and reuses blocks that a queued
        # step may still write, which is safe only in stream order (see EngineCore.step).
        self._stream = torch.cuda.current_stream(device) if on_cuda else None
        # Async scheduling: the last step's sampled ids stay on the device; a request whose newest
        # token is a placeholder (sampled, not yet read back) takes its input id from there.
        self._last_ids: torch.Tensor | None = None  # (R,) int64 on the device
        self._last_reqs: list[Request] = []  # the requests of its rows, in row order
        self._last_rows: dict[str, int] = {}  # request id -> row of _last_ids
        self._last_tensors: SamplingTensors | None = None  # the sampling inputs of those rows
        self._prev_stage: _DecodeStaging | None = None
        self._block_tables = BlockTables()  # every running request's table, from the scheduler's changes

    @classmethod
    def for_model(cls, model: LlamaForCausalLM, kv_cache: KVCache, config: EngineConfig, device: torch.device,
                  max_model_len: int, tp_leader: Leader | None = None) -> ModelRunner:
        """The runner an engine of `config` uses over `model` (one rank's share of it under tensor
        parallelism) and `kv_cache`: the engine and its tensor-parallel workers build theirs alike."""
        mc = model.config
        return cls(model, kv_cache, vocab_size=mc.vocab_size, softmax_scale=mc.attn_scale, device=device,
                   attention_backend=config.attention_backend, max_num_seqs=config.max_num_seqs,
                   max_num_batched_tokens=config.max_num_batched_tokens, max_model_len=max_model_len,
                   windows=[mc.layer_window(i) for i in range(mc.num_hidden_layers)], tp_leader=tp_leader)

    @torch.inference_mode()
    def follow(self, numbers: list[int], link: _Link) -> None:
        """A tensor-parallel worker's step: receives the inputs rank 0 broadcast (Leader.forward)
        and runs its share of the forward pass and of the LM head (the logits are rank 0's). A step
        rank 0 replays from a graph replays this rank's graph of the same bucket, its inputs
        received into the device buffers that graph reads."""
        facts = StepFacts(*numbers[:8])
        b, w, graph_batch = numbers[8:11]
        if graph_batch:
            assert self._dev_tables is not None and w == self._dev_tables.shape[1], "graph tables are whole-width"
            link.recv_into(self._dev_ints[:facts.n_ints])
            link.recv_into(self._dev_tables[:b])
            self._graphs[graph_batch].graph.replay()
            return
        ints = link.recv(facts.n_ints, torch.int32)
        tables = link.recv(b * w, torch.int32).view(b, w)
        layout = _Packed(n_tok=facts.n_tok, rows=facts.rows)
        metadata = facts.metadata(ints, tables)
        self.attention.metadata = metadata
        try:
            hidden = self.model(ints[layout.ids], ints[layout.positions], self.attention)
        finally:
            self.attention.metadata = None
        self.model.compute_logits(_last_tokens(hidden, metadata))

    # ---- inputs ---------------------------------------------------------------------------------
    def _stage(self, out: SchedulerOutput, block_tables: list[list[int]], graph_batch: int | None) -> _Step:
        """Writes the step's inputs into the staging buffers and starts their copy to the device.
        `block_tables` are the tables of `out.scheduled`'s rows (BlockTables.apply).

        With `graph_batch` (a pure decode of B <= graph_batch rows) the sections are laid out for
        T = B = graph_batch and rows B.. are padding."""
        scheduled = out.scheduled
        b = len(scheduled)
        reqs = [s.request for s in scheduled]
        q_lens = np.fromiter((s.num_new_tokens for s in scheduled), dtype=np.int64, count=b)
        starts = np.fromiter((s.start for s in scheduled), dtype=np.int64, count=b)
        widths = np.fromiter(map(len, block_tables), dtype=np.int64, count=b)
        t = int(q_lens.sum())
        w = int(widths.max())
        rows = graph_batch or b
        layout = _Packed(n_tok=graph_batch or t, rows=rows)
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copy has left the staging buffers
        ints = self._host_ints.numpy()
        ids, pos, slots = ints[layout.ids], ints[layout.positions], ints[layout.slots]
        lens, qsl = ints[layout.seq_lens], ints[layout.query_start_loc]
        tables = self._host_tables.numpy()[:b * w].reshape(b, w)

        # Async scheduling's steady state: every row's input is the id the last step sampled for
        # the same row (still on the device; see `pending` below for the general case).
        same_rows = (self._last_ids is not None and t == b and reqs == self._last_reqs
                     and all(r.num_output_placeholders for r in reqs))
        prev = self._prev_stage
        if (prev is not None and t == b and prev.layout == layout and prev.table_width == w
                and reqs == prev.requests and np.array_equal(starts, prev.starts + 1)):
            # The same decode rows as the last step, each one token further, in the same staging
            # layout: the buffers still hold that step's inputs, so only what moved is rewritten
            # (positions, lengths, slots, and the last entry of tables that grew a block).
            grew = np.flatnonzero(widths != prev.widths)
            for i in grew.tolist():
                tables[i, widths[i] - 1] = block_tables[i][-1]
        else:
            tables[:] = 0
            tables[np.arange(w) < widths[:, None]] = np.fromiter(  # row-major: each table in turn
                chain.from_iterable(block_tables), dtype=np.int32, count=int(widths.sum()))
            qsl[0] = 0
            np.cumsum(q_lens, out=qsl[1:b + 1])
            if rows > b:  # graph padding: no token written, nothing attended
                ids[t:], pos[t:], slots[t:], lens[b:] = 0, 0, -1, 0
                qsl[b + 1:] = np.arange(t + 1, t + 1 + rows - b)
        self._prev_stage = _DecodeStaging(layout, w, reqs, starts, widths) if t == b else None
        if not same_rows:
            ids[:t] = np.fromiter(chain.from_iterable(s.request.token_slice(s.start, s.start + s.num_new_tokens)
                                                      for s in scheduled), dtype=np.int32, count=t)
        if t == b:  # one token per sequence, at its start
            p = starts
            pos[:b] = p
            slots[:b] = tables[np.arange(b), p // self.block_size] * self.block_size + p % self.block_size
        else:
            seq_idx = np.repeat(np.arange(b), q_lens)  # (T,) sequence of each token
            p = starts[seq_idx] + (np.arange(t) - qsl[:b][seq_idx])  # (T,) position of each token
            pos[:t] = p
            slots[:t] = tables[seq_idx, p // self.block_size] * self.block_size + p % self.block_size
        lens[:b] = starts + q_lens
        max_query_len = int(q_lens.max())
        max_seq_len = int(lens[:b].max())
        n_ints = layout.end
        # A mixed step's running decodes (the scheduler puts them first) attend through the decode
        # kernel; the rest, from `nd` on, through the extend kernel with its own query starts.
        nd = b if max_query_len == 1 else int(np.argmax(q_lens != 1))
        if 0 < nd < b:
            ints[n_ints:n_ints + b - nd + 1] = qsl[nd:b + 1] - qsl[nd]
            n_prefill_ints = b - nd + 1
        else:
            n_prefill_ints = 0
        decode_max_seq_len = int(lens[:nd].max()) if nd else 0
        n_ints += n_prefill_ints
        # Newest tokens not read back yet (async scheduling): the input id of such a token is in
        # the last step's sampled ids on the device. Unless all rows take theirs in one copy
        # (same_rows), (token index in this step, row of the last step's ids) pairs go along.
        pending = []
        if self._last_ids is not None and not same_rows:
            pending = [(int(qsl[i + 1]) - 1, self._last_rows[s.request.request_id])
                       for i, s in enumerate(scheduled)
                       if s.request.num_output_placeholders and s.start + s.num_new_tokens == s.request.num_tokens]
        n_pend = len(pending)
        if n_pend:
            ints[n_ints:n_ints + 2 * n_pend] = np.asarray(pending, dtype=np.int32).T.reshape(-1)
        n_copy = n_ints + 2 * n_pend
        if self._dev_tables is not None and self._copied is not None:
            dev = self._dev_ints[:n_ints]
            self._dev_ints[:n_copy].copy_(self._host_ints[:n_copy], non_blocking=True)
            dev_tables = self._dev_tables[:rows] if graph_batch else self._dev_tables[:b, :w]
            self._dev_tables[:b, :w].copy_(self._host_tables[:b * w].view(b, w), non_blocking=True)
            self._copied.record()
        else:
            dev = self._host_ints[:n_ints]
            dev_tables = self._host_tables[:b * w].view(b, w)
        facts = StepFacts(layout.n_tok, layout.rows, n_ints, n_prefill_ints, max_query_len, max_seq_len, nd,
                          decode_max_seq_len)
        md = facts.metadata(dev, dev_tables)
        last_ids = self._last_ids
        if same_rows and last_ids is not None:
            dev[:b].copy_(last_ids[:b])
        elif n_pend and last_ids is not None:
            idx = self._dev_ints[n_ints:n_copy].to(torch.int64)
            dev[layout.ids].index_copy_(0, idx[:n_pend], last_ids[idx[n_pend:]].to(torch.int32))
        return _Step(dev[layout.ids], dev[layout.positions], md, b, graph_batch, facts, dev)

    def _graph_batch(self, out: SchedulerOutput) -> int | None:
        if not self._graphs or any(s.num_new_tokens != 1 for s in out.scheduled):
            return None
        b = len(out.scheduled)
        return next((g for g in self._graphs if g >= b), None)

    # ---- forward --------------------------------------------------------------------------------
    def forward_logits(self, out: SchedulerOutput, *, eager: bool = False) -> tuple[list[int], torch.Tensor | None]:
        """Runs the step's tokens; returns the scheduled rows that sample and their logits (R, V)
        fp32 (None when no row samples). `eager` skips the CUDA graphs (tests compare the two)."""
        step = self._stage(out, self._block_tables.apply(out), None if eager else self._graph_batch(out))
        if self._tp is not None:
            self._tp.forward(step.facts, step.ints, step.metadata.block_tables, step.graph_batch)
        rows = [i for i, s in enumerate(out.scheduled) if s.sample]
        if step.graph_batch is not None:
            g = self._graphs[step.graph_batch]
            g.graph.replay()
            return rows, (g.logits[rows] if len(rows) < step.num_seqs else g.logits[:step.num_seqs])
        self.attention.metadata = step.metadata
        try:
            hidden = self.model(step.input_ids, step.positions, self.attention)  # (T, hidden)
        finally:
            self.attention.metadata = None
        if self._tp is not None:  # the LM head is split by vocabulary: all ranks, every sequence
            logits = self.model.compute_logits(_last_tokens(hidden, step.metadata))
            return rows, (logits[rows] if len(rows) < step.num_seqs else logits) if rows else None
        if not rows:
            return rows, None
        qsl = step.metadata.query_start_loc
        if step.metadata.max_query_len == 1 and len(rows) == step.num_seqs:
            last = hidden  # pure decode: every token is its sequence's last
        else:
            last = hidden[(qsl[1:].to(torch.int64) - 1)[torch.tensor(rows, device=self.device)]]
        return rows, self.model.compute_logits(last)

    @torch.inference_mode()
    def launch(self, out: SchedulerOutput, seeds: dict[str, int]) -> PendingSample | None:
        """Queues the step's forward pass and sampling on the device and the copy of what is
        sampled back to the host; returns without waiting (None when no row samples). The sampled
        ids also stay on the device, as the next step's input ids of requests whose newest token is
        a placeholder."""
        assert self._stream is None or torch.cuda.current_stream(self.device) == self._stream, \
            "every step must run on the runner's CUDA stream (async scheduling relies on stream order)"
        rows, logits = self.forward_logits(out)
        if logits is None:
            return None
        reqs = [out.scheduled[i].request for i in rows]
        last = self._last_tensors
        if last is not None and not last.any_penalties and reqs == self._last_reqs:
            # The same rows as the last step's sample, each one token further: only the step
            # counters (the random stream's position) change. The steady decode state.
            tensors = last.next_step()
        else:
            # Penalties count output ids: a newest id not read back yet is read from the device,
            # and only for rows that use a penalty (the sampler selects them).
            pend = [(i, self._last_rows[r.request_id]) for i, r in enumerate(reqs)
                    if r.num_output_placeholders]
            pending_ids = None
            if pend:
                assert self._last_ids is not None, "a pending id without a last step"
                pending_ids = ([p[0] for p in pend], [p[1] for p in pend], self._last_ids)
            tensors = SamplingTensors.build(
                params=[r.sampling for r in reqs],
                seeds=[seeds[r.request_id] for r in reqs],
                steps=[r.num_output_tokens for r in reqs],
                prompt_ids=[r.prompt_token_ids for r in reqs],
                output_ids=[r.output_token_ids for r in reqs],
                vocab_size=logits.shape[-1],
                device=logits.device,
                pending_ids=pending_ids,
            )
            self._last_rows = {r.request_id: i for i, r in enumerate(reqs)}
        result = sample(logits, tensors)
        self._last_ids = result.token_ids
        self._last_reqs = reqs
        self._last_tensors = tensors
        # Everything sampled comes back in one transfer, packed as float64 columns (token ids are
        # exact in float64): id, logprob, then n top ids, n top logprobs.
        cols = [result.token_ids.double()[:, None], result.logprobs.double()[:, None]]
        n_top = 0
        if result.top_ids is not None and result.top_logprobs is not None:
            n_top = result.top_ids.shape[1]
            cols += [result.top_ids.double(), result.top_logprobs.double()]
        packed = torch.cat(cols, dim=1)
        if packed.is_cuda:
            # Two pinned buffers, taken in turn: at most one step is pending, and its buffer is read
            # before the step after next writes into it. (A fresh pinned tensor per step cost a
            # cudaHostAlloc whenever the caching host allocator had no block of that size yet:
            # every new batch size in an engine's first minutes.)
            self._parity ^= 1
            host = self._host_samples[self._parity][:packed.numel()].view(packed.shape)
            host.copy_(packed, non_blocking=True)
            done = self._sample_events[self._parity]
            done.record()
            return PendingSample(reqs, host, n_top, done)
        return PendingSample(reqs, packed, n_top, None)

    def execute(self, out: SchedulerOutput, seeds: dict[str, int]) -> dict[str, SampledToken]:
        """Runs the scheduled tokens and waits for the sample: the sampled token of every request
        that reached the end of its known tokens this step (prefill chunks in the middle of a
        prompt sample nothing), by request id."""
        pending = self.launch(out, seeds)
        if pending is None:
            return {}
        return {r.request_id: tok for r, tok in zip(pending.requests, pending.result())}

    def profile(self, prompt_lens: list[int]) -> None:
        """One prefill step of sequences with these prompt lengths, sampled with every sampler
        feature on (penalties, top-k/top-p/min-p, logprobs): what sizing the KV pool measures.
        Needs sum(prompt_lens) / block_size blocks in this runner's cache; writes block 0 onward."""
        sampling = SamplingParams(max_tokens=1, temperature=1.0, top_p=0.9, min_p=0.05,
                                  repetition_penalty=1.1, frequency_penalty=0.1, presence_penalty=0.1,
                                  logprobs=min(20, self.vocab_size))
        scheduled, next_block = [], 0
        for i, n in enumerate(prompt_lens):
            blocks = -(-n // self.block_size)
            req = Request(f"profile-{i}", [1] * n, sampling, max_model_len=self.max_model_len)
            scheduled.append(ScheduledRequest(req, n, 0, True, tuple(range(next_block, next_block + blocks)), True))
            next_block += blocks
        self.execute(SchedulerOutput(scheduled=scheduled, num_batched_tokens=sum(prompt_lens)),
                     {f"profile-{i}": i for i in range(len(prompt_lens))})
        self._block_tables.apply(SchedulerOutput(finished_ids=[s.request.request_id for s in scheduled]))

    def warm_up(self) -> None:
        """Prefills of 2, 3, 5, 9, ... tokens, one per tile variant of the extend kernel (its
        BLOCK_M follows the longest query of a step in powers of two), so that Triton compiles them
        at start and not under load. Writes the cache's first blocks; nothing refers to them yet."""
        n = 2
        while n < self.max_model_len and n <= self.max_tokens and -(-n // self.block_size) <= self.kv_cache.num_blocks:
            self.profile([n])
            n = 2 * n - 1
        log.info("warmed_up", longest_prefill=(n + 1) // 2)

    # ---- CUDA graphs ----------------------------------------------------------------------------
    @torch.inference_mode()
    def capture_cuda_graphs(self) -> None:
        """Captures the decode forward (and the logits) for every bucket, largest first, into one
        memory pool. Each bucket first runs once eagerly, which also compiles its Triton kernels."""
        if self._dev_tables is None:
            raise RuntimeError("CUDA graphs need a CUDA device")
        pool = torch.cuda.graph_pool_handle()
        buckets = graph_buckets(self.max_num_seqs)
        for b in reversed(buckets):
            layout = _Packed(n_tok=b, rows=b)
            dev = self._dev_ints[:layout.end]
            host = self._host_ints[:layout.end].numpy()
            # Dummy decode of b rows: one cached token each, in block 0 (never written: slot -1).
            host[layout.ids], host[layout.positions], host[layout.slots], host[layout.seq_lens] = 0, 0, -1, 1
            host[layout.query_start_loc] = np.arange(b + 1)
            dev.copy_(self._host_ints[:layout.end])
            self._dev_tables[:b].zero_()
            # The split count must serve any context length.
            self.attention.metadata = layout.metadata(dev, self._dev_tables[:b], max_query_len=1,
                                                      max_seq_len=self.max_model_len, num_decodes=b)
            ids, positions = dev[layout.ids], dev[layout.positions]
            try:
                self.model.compute_logits(self.model(ids, positions, self.attention))  # warm-up
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    logits = self.model.compute_logits(self.model(ids, positions, self.attention))
            finally:
                self.attention.metadata = None
            self._graphs[b] = _Graph(graph, logits)
        torch.cuda.synchronize()
        self._graphs = dict(sorted(self._graphs.items()))
        log.info("cuda_graphs_captured", batch_sizes=list(self._graphs))

    def drop_cuda_graphs(self) -> None:
        """Releases the captured graphs (decode steps run eagerly after this)."""
        if self._graphs:
            torch.cuda.synchronize(self.device)
            self._graphs = {}
