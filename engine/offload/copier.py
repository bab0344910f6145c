"""Copies of whole KV blocks between the pool and the host tier's rows, off the step's path.

A block's record is its bytes in every tensor of the pool, as stored, one tensor after the other
(K, V, and for int8 pages their scales): never re-quantized, so a block read back holds the bits it
was written with.

    pool tensor t: (num_layers, num_blocks, *rest)   ->   record part: t[:, b] as bytes
    record:        k | v | k_scale | v_scale          (block_bytes in all; one row of the host pool)

On CUDA the copies run on two side streams, one each way, and report through an event the engine
polls: steps keep running meanwhile. A copy down is ordered after the main stream's work so far
(the K/V of the blocks it saves). A step that reuses a block whose copy down is still in flight
makes the main stream wait for that event (a device-side wait). A read-back has two halves: its
rows cross the link into a staging buffer at once, waiting only for the copies down still filling
those rows (`fills`), so the copy overlaps the step running meanwhile; then a device-side scatter
puts them into the pool blocks, after the main stream's work so far (the blocks were free, but a
step in flight may still read them) and after the copies down still reading those blocks
(`overwrites`: the blocks were evicted to make room). Neither half waits for unrelated copies
down, however many are queued (the link carries both directions at once). Rows of consecutive host
slots move in one copy. On the CPU a worker thread does the same copies in issue order (torch
releases the GIL), which keeps every such order by itself, and a reused block's copy is waited for
on the host.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

import torch

from ..device import to_device
from ..runner.kv_cache import KVCache


class BlockLayout:
    """Where a block's bytes are in the pool, and the gather/scatter of n blocks as (n, block_bytes)."""

    def __init__(self, kv_cache: KVCache) -> None:
        self.tensors = [t for t in (kv_cache.k, kv_cache.v, kv_cache.k_scale, kv_cache.v_scale) if t is not None]
        self.sizes = [t[:, 0].numel() * t.element_size() for t in self.tensors]
        self.block_bytes = sum(self.sizes)

    def gather(self, ids: torch.Tensor) -> torch.Tensor:
        """The records of blocks `ids` (n,) int64: (n, block_bytes) uint8 on the pool's device."""
        n = ids.numel()
        return torch.cat([t.index_select(1, ids).transpose(0, 1).reshape(n, -1).view(torch.uint8)
                          for t in self.tensors], dim=1)

    def scatter(self, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """Writes records `rows` (n, block_bytes) uint8 into blocks `ids` (n,) of the pool."""
        n, at = ids.numel(), 0
        for t, size in zip(self.tensors, self.sizes):
            part = rows[:, at:at + size].contiguous().view(t.dtype).view(n, t.shape[0], *t.shape[2:])
            t.index_copy_(1, ids, part.transpose(0, 1))
            at += size


def slot_runs(slots: list[int]) -> list[tuple[int, int, int]]:
    """`slots` cut into runs of consecutive host slots: (position in `slots`, first slot, length)."""
    runs: list[tuple[int, int, int]] = []
    for i, slot in enumerate(slots):
        if runs and slot == runs[-1][1] + runs[-1][2]:
            at, first, n = runs[-1]
            runs[-1] = (at, first, n + 1)
        else:
            runs.append((i, slot, 1))
    return runs


class Transfer(Protocol):
    """A copy in flight."""

    def done(self) -> bool: ...  # landed (never blocks)

    def wait(self) -> None: ...  # blocks the calling thread until it landed

    def before_next_step(self) -> None: ...  # the next step's device work waits for it

    def order_on(self, stream) -> None: ...  # work queued on `stream` from now on waits for it (CUDA)


class Copier(Protocol):
    # whether the next step's device work can wait for a copy in flight (a CUDA event) rather than
    # the host waiting for it
    device_waits: bool

    def save(self, block_ids: list[int], slots: list[int]) -> Transfer: ...  # pool blocks -> host rows

    # host rows -> pool blocks, after the copies down still filling those rows or reading those blocks
    def load(self, slots: list[int], block_ids: list[int], *, fills: Sequence[Transfer] = (),
             overwrites: Sequence[Transfer] = ()) -> Transfer: ...

    def close(self) -> None: ...


class _ThreadTransfer:
    __slots__ = ("future",)

    def __init__(self, future: Future) -> None:
        self.future = future

    def done(self) -> bool:
        return self.future.done()

    def wait(self) -> None:
        self.future.result()

    def before_next_step(self) -> None:
        self.future.result()  # the CPU's steps run on this host: wait here

    def order_on(self, stream) -> None:
        pass  # one worker copies in issue order


class CpuCopier:
    """The CPU's copies, on one worker thread (in submission order, as a stream's)."""

    device_waits = False

    def __init__(self, layout: BlockLayout, host_rows: torch.Tensor) -> None:
        self.layout = layout
        self.host_rows = host_rows  # (capacity, block_bytes) uint8
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="kv-copy")

    def save(self, block_ids: list[int], slots: list[int]) -> Transfer:
        ids, dst = torch.tensor(block_ids, dtype=torch.int64), torch.tensor(slots, dtype=torch.int64)
        return _ThreadTransfer(self._worker.submit(lambda: self.host_rows.index_copy_(0, dst, self.layout.gather(ids))))

    def load(self, slots: list[int], block_ids: list[int], *, fills: Sequence[Transfer] = (),
             overwrites: Sequence[Transfer] = ()) -> Transfer:
        del fills, overwrites  # issued before this copy, on the same worker: done first
        src, ids = torch.tensor(slots, dtype=torch.int64), torch.tensor(block_ids, dtype=torch.int64)
        return _ThreadTransfer(self._worker.submit(lambda: self.layout.scatter(ids, self.host_rows.index_select(0, src))))

    def close(self) -> None:
        self._worker.shutdown(wait=True)


class _CudaTransfer:
    __slots__ = ("event", "keep")

    def __init__(self, event: torch.cuda.Event, keep: tuple[torch.Tensor, ...]) -> None:
        self.event = event
        self.keep: tuple[torch.Tensor, ...] | None = keep  # the copy's device buffers, alive until it lands

    def done(self) -> bool:
        if self.keep is not None and self.event.query():
            self.keep = None
        return self.keep is None

    def wait(self) -> None:
        self.event.synchronize()
        self.keep = None

    def before_next_step(self) -> None:
        torch.cuda.current_stream().wait_event(self.event)

    def order_on(self, stream) -> None:
        stream.wait_event(self.event)


class CudaCopier:
    """CUDA's copies: a stream each way, pinned host rows, events (module docstring)."""

    device_waits = True

    def __init__(self, layout: BlockLayout, host_rows: torch.Tensor, device: torch.device) -> None:
        assert host_rows.is_pinned(), "device <-> host copies overlap compute only from pinned memory"
        self.layout = layout
        self.host_rows = host_rows
        self.device = device
        self.down = torch.cuda.Stream(device)  # pool -> host
        self.up = torch.cuda.Stream(device)  # host -> pool

    def _ordered(self) -> torch.cuda.Event:
        """An event after the main stream's work so far (what a side stream waits for)."""
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def save(self, block_ids: list[int], slots: list[int]) -> Transfer:
        after = self._ordered()
        with torch.cuda.stream(self.down):
            self.down.wait_event(after)
            ids = to_device(torch.tensor(block_ids, dtype=torch.int64), self.device)
            rows = self.layout.gather(ids)
            for at, first, n in slot_runs(slots):
                self.host_rows[first:first + n].copy_(rows[at:at + n], non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.down)
        return _CudaTransfer(done, (ids, rows))

    def load(self, slots: list[int], block_ids: list[int], *, fills: Sequence[Transfer] = (),
             overwrites: Sequence[Transfer] = ()) -> Transfer:
        after = self._ordered()  # the main stream's work so far (a step in flight may read the blocks)
        with torch.cuda.stream(self.up):
            for transfer in fills:  # copies down still writing the rows it reads
                transfer.order_on(self.up)
            rows = torch.empty((len(slots), self.layout.block_bytes), dtype=torch.uint8, device=self.device)
            for at, first, n in slot_runs(slots):
                rows[at:at + n].copy_(self.host_rows[first:first + n], non_blocking=True)
            ids = to_device(torch.tensor(block_ids, dtype=torch.int64), self.device)
            self.up.wait_event(after)
            for transfer in overwrites:  # copies down still reading the blocks it overwrites
                transfer.order_on(self.up)
            self.layout.scatter(ids, rows)
            done = torch.cuda.Event()
            done.record(self.up)
        return _CudaTransfer(done, (ids, rows))

    def close(self) -> None:
        self.down.synchronize()
        self.up.synchronize()


def make_copier(layout: BlockLayout, host_rows: torch.Tensor, device: torch.device) -> Copier:
    return CudaCopier(layout, host_rows, device) if device.type == "cuda" else CpuCopier(layout, host_rows)
