"""A step's model inputs, staged: from a SchedulerOutput to the packed device buffers the forward
pass, the attention kernels and the captured CUDA graphs read.

Inputs are built on the host with numpy (a loop over requests, never over tokens) straight into one
pinned staging buffer, then go to the device in two asynchronous copies (the int32 scalars packed
end to end, and the block tables).

The layouts they are written in: engine/runner/step_layout.py.

Steady decode (the same requests as the last step, each one token further) costs the host little:
the staging buffers still hold the last step's inputs, so only positions, slots, lengths and the
tables that grew a block are rewritten, and the input ids come from the last sample on the device
in one copy; the device views and metadata of a step shaped as the last one are that step's, with
its numbers replaced (at one row, slicing the buffers anew cost a fifth of the staging).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from itertools import chain

import numpy as np
import torch

from ..scheduling.request import Request
from ..scheduling.step import SchedulerOutput
from .attention import AttentionMetadata
from .step_layout import LastSample, Packed, StepFacts, StepInputs


@dataclass(slots=True)
class DecodeStaging:
    """What the last pure decode step left in the staging buffers: the next one over the same
    requests, each one token further, rewrites only what moved."""

    layout: Packed
    table_width: int  # columns of the staged block tables
    requests: list[Request]  # its rows, in order
    starts: np.ndarray  # (B,) position of each row's token
    widths: np.ndarray  # (B,) blocks in each row's table


@dataclass(slots=True)
class _Views:
    """The device-side views of the last step's inputs (`StepStager.stage`): a step of the same
    shape (a steady decode's, step after step) takes them again instead of slicing the buffers
    anew, and only its metadata's numbers change. Tied to the buffers they view (tests swap them)."""

    key: tuple[int | bool, ...]  # the numbers that place every section and table
    buffers: tuple[torch.Tensor, torch.Tensor]  # (dev_ints, dev_tables, or the host's on the CPU) viewed
    ints: torch.Tensor  # the packed ints on the device (n_ints)
    host_ints: torch.Tensor  # what is copied into them
    host_tables: torch.Tensor  # (B, w) the staged tables on the host
    tables_written: torch.Tensor | None  # (B, w) where they are copied on the device (None on the CPU)
    metadata: AttentionMetadata  # carries the numbers of the latest step that took these views
    input_ids: torch.Tensor
    positions: torch.Tensor


class StepStager:
    """The staging buffers (host, pinned on CUDA; and their device copies, which the kernels and the
    captured graphs read) and the step that fills them. On the CPU the host buffers serve directly."""

    def __init__(self, *, block_size: int, max_num_seqs: int, max_tokens: int, max_blocks: int,
                 device: torch.device, verify_tokens: int = 0, prompt_rows_decode: bool = True) -> None:
        self.block_size = block_size
        # A one-token row at a prompt position attends as a decode (engine/runner/step_layout.py).
        self.prompt_rows_decode = prompt_rows_decode
        # + the query and key starts of a step's prefill part (2 (B + 1)) + (dst, src) of up to B
        # placeholder ids
        ints = 3 * max_tokens + 6 * max_num_seqs + 3
        # A verify graph's strided layout of up to `verify_tokens` tokens (engine/runner/cuda_graphs.py):
        # its sections and the logits rows it keeps (at most one per token).
        ints = max(ints, 4 * verify_tokens + 2 * max_num_seqs + 1)
        on_cuda = device.type == "cuda"
        self.host_ints = torch.empty(ints, dtype=torch.int32, pin_memory=on_cuda)
        self.host_tables = torch.empty(max_num_seqs * max_blocks, dtype=torch.int32, pin_memory=on_cuda)
        self.dev_tables: torch.Tensor | None = None  # CUDA only, as the event below
        self._copied: torch.cuda.Event | None = None
        if on_cuda:
            self.dev_ints = torch.zeros(ints, dtype=torch.int32, device=device)
            self.dev_tables = torch.zeros(max_num_seqs, max_blocks, dtype=torch.int32, device=device)
            self._copied = torch.cuda.Event()  # staging may be rewritten once the last copy is done
        else:
            self.dev_ints = self.host_ints
        self.prev: DecodeStaging | None = None  # what the last pure decode step left in the buffers
        self._views: _Views | None = None  # the last step's device views, for a step of its shape
        # numpy views of the host buffers, made once (`Tensor.numpy()` costs microseconds a call)
        self._host_ints_np = self.host_ints.numpy()
        self._host_tables_np = self.host_tables.numpy()

    def stage(self, out: SchedulerOutput, block_tables: list[list[int]], graph_batch: int | None,
              last: LastSample | None, proposals: bool = False) -> StepInputs:
        """Writes the step's inputs into the staging buffers and starts their copy to the device.
        `block_tables` are the tables of `out.scheduled`'s rows (their requests' `block_ids`).

        With `graph_batch` (a pure decode of B <= graph_batch rows) the sections are laid out for
        T = B = graph_batch and rows B.. are padding. `last`: the previous step's sample, whose ids
        on the device are the inputs of tokens sampled but not read back yet (async scheduling).
        `proposals`: rows may run past their known tokens into their speculative proposals
        (Request.input_slice; engine/spec_decode/speculator.py)."""
        scheduled = out.scheduled
        b = len(scheduled)
        reqs = [s.request for s in scheduled]
        q_lens = np.fromiter((s.num_new_tokens for s in scheduled), dtype=np.int64, count=b)
        starts = np.fromiter((s.start for s in scheduled), dtype=np.int64, count=b)
        widths = np.fromiter(map(len, block_tables), dtype=np.int64, count=b)
        t = int(q_lens.sum())
        w = int(widths.max())
        rows = graph_batch or b
        layout = Packed(n_tok=graph_batch or t, rows=rows)
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copy has left the staging buffers
        ints = self._host_ints_np
        ids, pos, slots = ints[layout.ids], ints[layout.positions], ints[layout.slots]
        lens, qsl = ints[layout.seq_lens], ints[layout.query_start_loc]
        tables = self._host_tables_np[:b * w].reshape(b, w)

        # Async scheduling's steady state: every row's input is the id the last step sampled for
        # the same row (still on the device; see `pending` below for the general case).
        same_rows = (last is not None and t == b and reqs == last.requests
                     and all(r.num_output_placeholders for r in reqs))
        prev = self.prev
        if (prev is not None and t == b and prev.layout == layout and prev.table_width == w
                and reqs == prev.requests and not (starts - prev.starts - 1).any()):
            # The same decode rows as the last step, each one token further, in the same staging
            # layout: the buffers still hold that step's inputs, so only what moved is rewritten
            # (positions, lengths, slots, and the last entry of tables that grew a block).
            grew = widths != prev.widths
            if grew.any():
                for i in np.flatnonzero(grew).tolist():
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
        self.prev = DecodeStaging(layout, w, reqs, starts, widths) if t == b else None
        if not same_rows:
            take = Request.input_slice if proposals else Request.token_slice
            ids[:t] = np.fromiter(chain.from_iterable(take(s.request, s.start, s.start + s.num_new_tokens)
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
        if self.prompt_rows_decode:
            nd = b if max_query_len == 1 else int(np.argmax(q_lens != 1))
        else:
            decodes = [s.num_new_tokens == 1 and not s.at_prompt for s in scheduled]
            nd = decodes.index(False) if False in decodes else b
        if 0 < nd < b:
            ints[n_ints:n_ints + b - nd + 1] = qsl[nd:b + 1] - qsl[nd]
            n_prefill_ints = b - nd + 1
        else:
            n_prefill_ints = 0
        decode_max_seq_len = int(lens[:nd].max()) if nd else 0
        n_ints += n_prefill_ints
        n_key_ints = b - nd + 1 if nd < b else 0
        if n_key_ints:
            keys = ints[n_ints:n_ints + n_key_ints]
            keys[0] = 0
            np.cumsum(lens[nd:b], out=keys[1:])
            n_ints += n_key_ints
        # Newest tokens not read back yet (async scheduling): the input id of such a token is in
        # the last step's sampled ids on the device. Unless all rows take theirs in one copy
        # (same_rows), (token index in this step, row of the last step's ids) pairs go along.
        pending = []
        if last is not None and not same_rows:
            pending = [(int(qsl[i + 1]) - 1, last.rows[s.request.request_id])
                       for i, s in enumerate(scheduled)
                       if s.request.num_output_placeholders and s.start + s.num_new_tokens == s.request.num_tokens]
        n_pend = len(pending)
        if n_pend:
            ints[n_ints:n_ints + 2 * n_pend] = np.asarray(pending, dtype=np.int32).T.reshape(-1)
        n_copy = n_ints + 2 * n_pend
        prefill_kv_tokens = int(ints[n_ints - 1]) if n_key_ints else 0
        facts = StepFacts(layout.n_tok, layout.rows, n_ints, n_prefill_ints, n_key_ints, max_query_len, max_seq_len,
                          nd, decode_max_seq_len, prefill_kv_tokens)
        views = self._device_views(facts, b, w, graph_batch is not None)
        dev, md = views.ints, views.metadata
        if self.dev_tables is not None and self._copied is not None:
            if n_pend:
                self.dev_ints[:n_copy].copy_(self.host_ints[:n_copy], non_blocking=True)
            else:  # (the views' own host half, sliced once: the steady decode's copy)
                dev.copy_(views.host_ints, non_blocking=True)
            assert views.tables_written is not None
            views.tables_written.copy_(views.host_tables, non_blocking=True)
            self._copied.record()
        last_ids = last.ids if last is not None else None
        if same_rows and last_ids is not None:
            dev[:b].copy_(last_ids[:b])
        elif n_pend and last_ids is not None:
            idx = self.dev_ints[n_ints:n_copy].to(torch.int64)
            views.input_ids.index_copy_(0, idx[:n_pend], last_ids[idx[n_pend:]].to(torch.int32))
        return StepInputs(views.input_ids, views.positions, md, b, graph_batch, facts, dev)

    def _device_views(self, facts: StepFacts, b: int, w: int, graph: bool) -> _Views:
        """The device views of a step laid out as `facts` says (b rows, tables w wide, for a graph
        or not), with its metadata: the last step's views when it had the same shape (a steady
        decode's, step after step: slicing the buffers again costs more than the rest of the
        step's staging at one row), else new ones."""
        key = (facts.n_tok, facts.rows, facts.n_ints, facts.n_prefill_ints, facts.n_key_ints, facts.num_decodes,
               b, w, graph)
        tables_buffer = self.host_tables if self.dev_tables is None else self.dev_tables
        v = self._views
        if v is not None and v.key == key and v.buffers[0] is self.dev_ints and v.buffers[1] is tables_buffer:
            v.metadata = replace(v.metadata, max_query_len=facts.max_query_len, max_seq_len=facts.max_seq_len,
                                 decode_max_seq_len=facts.decode_max_seq_len,
                                 prefill_kv_tokens=facts.prefill_kv_tokens)
            return v
        host_tables = self.host_tables[:b * w].view(b, w)
        if self.dev_tables is None:  # the CPU: the kernels read the host buffers
            ints, written, tables = self.host_ints[:facts.n_ints], None, host_tables
        else:  # a graph reads its bucket's whole-width rows
            ints, written = self.dev_ints[:facts.n_ints], self.dev_tables[:b, :w]
            tables = self.dev_tables[:facts.rows] if graph else written
        layout = Packed(n_tok=facts.n_tok, rows=facts.rows)
        self._views = v = _Views(key, (self.dev_ints, tables_buffer), ints, self.host_ints[:facts.n_ints], host_tables,
                                 written, facts.metadata(ints, tables), ints[layout.ids], ints[layout.positions])
        return v

    def stage_verify(self, out: SchedulerOutput, block_tables: list[list[int]], bucket: int,
                     width: int) -> StepInputs:
        """Writes a verify step's inputs in the strided layout of its CUDA graph (engine/runner/step_layout.py):
        `bucket` rows of `width` (= 1 + K) tokens, row i's newest token and its k_i proposals at
        [i width, i width + 1 + k_i), the rest padding; starts their copy to the device. Every
        row must be a decode (it samples; 1 + num_spec tokens, at most `width`) whose newest id is
        on the host: a verify step is read back before the next one is scheduled
        (engine/spec_decode/speculator.py), so no row takes its input from the last step's ids. Returns the
        inputs with `logits_index`, the rows of the graph's logits that the eager step's logits
        would be, in its order."""
        scheduled = out.scheduled
        b = len(scheduled)
        assert 0 < b <= bucket, f"{b} rows for a verify bucket of {bucket}"
        bs = self.block_size
        for s in scheduled:
            assert s.sample and s.num_new_tokens == 1 + s.num_spec <= width, \
                f"{s.request}: not a decode of at most {width - 1} proposals ({s.num_new_tokens} tokens, {s.num_spec})"
            assert not s.request.num_output_placeholders, f"{s.request}: a verify step's row with an id not read back"
        q_lens = np.fromiter((s.num_new_tokens for s in scheduled), dtype=np.int64, count=b)
        starts = np.fromiter((s.start for s in scheduled), dtype=np.int64, count=b)
        widths = np.fromiter(map(len, block_tables), dtype=np.int64, count=b)
        n_tok = bucket * width
        layout = Packed(n_tok=n_tok, rows=bucket)
        # Columns for every key the extend kernel may read: positions below start + width (a
        # padding row: below width), past each row's blocks filled with block 0.
        w = max(int(widths.max()), -(-(int(starts.max()) + width) // bs))
        assert bucket * w <= self.host_tables.numel(), f"verify tables of {w} columns do not fit the staging buffer"
        if self.dev_tables is not None:
            assert w <= self.dev_tables.shape[1], f"verify tables of {w} columns, {self.dev_tables.shape[1]} staged"
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copy has left the staging buffers
        self.prev = None  # the buffers no longer hold a decode step's inputs
        ints = self.host_ints.numpy()
        ids = ints[layout.ids].reshape(bucket, width)
        pos = ints[layout.positions].reshape(bucket, width)
        slots = ints[layout.slots].reshape(bucket, width)
        tables = self.host_tables.numpy()[:bucket * w].reshape(bucket, w)
        tables[:] = 0
        tables[:b][np.arange(w) < widths[:, None]] = np.fromiter(  # row-major: each table in turn
            chain.from_iterable(block_tables), dtype=np.int32, count=int(widths.sum()))
        real = np.arange(width) < q_lens[:, None]  # (b, width): token j of row i is real
        p = (starts[:, None] + np.arange(width))[real]  # positions of the real tokens, row by row
        row = np.repeat(np.arange(b), q_lens)  # (sum q_lens,) the row of each real token
        ids[:], pos[:], slots[:] = 0, 0, -1
        ids[:b][real] = np.fromiter(chain.from_iterable(s.request.input_slice(s.start, s.start + s.num_new_tokens)
                                                        for s in scheduled), dtype=np.int32, count=int(q_lens.sum()))
        pos[:b][real] = p
        assert (p // bs < widths[row]).all(), "a verify row's tokens need their blocks"
        slots[:b][real] = tables[row, p // bs] * bs + p % bs
        lens = ints[layout.seq_lens]
        lens[:b] = starts + width
        lens[b:] = width
        ints[layout.query_start_loc] = np.arange(bucket + 1) * width
        # The logits rows kept: every real token's, row by row (the eager step's order).
        n_index = int(q_lens.sum())
        n_ints = layout.end + n_index
        ints[layout.end:n_ints] = np.flatnonzero(real)  # i * width + j over `real`, row-major
        if self.dev_tables is not None and self._copied is not None:
            self.dev_ints[:n_ints].copy_(self.host_ints[:n_ints], non_blocking=True)
            self.dev_tables[:bucket, :w].copy_(self.host_tables[:bucket * w].view(bucket, w), non_blocking=True)
            self._copied.record()
            dev, dev_tables = self.dev_ints[:n_ints], self.dev_tables[:bucket]  # the graph's whole-width rows
        else:
            dev, dev_tables = self.host_ints[:n_ints], self.host_tables[:bucket * w].view(bucket, w)
        facts = StepFacts(n_tok, bucket, layout.end, 0, 0, width, int(lens[:bucket].max()), 0, 0, 0)
        sections = dev[:layout.end]
        return StepInputs(sections[layout.ids], sections[layout.positions], facts.metadata(sections, dev_tables), b,
                          bucket, facts, sections, dev[layout.end:])


def adapter_slots(out: SchedulerOutput, capacity: int) -> np.ndarray:
    """Each token row's LoRA slot (model/lora.py LoraStep.buffer) in the staged order (out.scheduled,
    num_new_tokens each), -1 for the base model and for every row past the step's: a graph
    replayed over a bucket of rows reads its padding as base rows. (capacity,) int32."""
    scheduled = out.scheduled
    slots = np.fromiter((s.request.adapter.slot if s.request.holds_adapter and s.request.adapter else -1
                         for s in scheduled), dtype=np.int32, count=len(scheduled))
    counts = np.fromiter((s.num_new_tokens for s in scheduled), dtype=np.int64, count=len(scheduled))
    per_token = np.repeat(slots, counts)
    rows = np.full(capacity, -1, dtype=np.int32)
    rows[:per_token.shape[0]] = per_token
    return rows
