"""KVTiers: the host and disk tiers below the pool, one prefix cache with it (DESIGN.md "Below
the GPU pool"). The block manager and the scheduler drive it through `LowerTiers`
(engine/scheduling/block_manager.py):

    freed(b)       a hashed block went back to the free queue, its K/V intact
    evicting(b)    ... and is now handed out: its copy down, if still in flight, lands first (before
                   the next step, or, for a read-back's block, before that read-back writes it)
    poll()         start of schedule(): read-backs that landed become cached free blocks (on CUDA
                   also those issued at an earlier schedule: the step's work waits for the copy)
    fetch(r, hit)  admission: the chain goes on below the pool's hit -> take fresh blocks, start the
                   read-back, r waits (True); it is admitted once they landed, as a pool hit
    flush()        end of schedule(): blocks freed since are copied down (write on free: long
                   before the LRU reaches them, so the step that reuses one rarely waits)

Write down: every hashed block freed goes to the host tier (if not there yet) and from there, on
the disk worker, to the disk tier (write-through), so a restart finds everything the host held.
Read back: host rows are copied into fresh pool blocks on the side stream (the CPU: a worker);
blocks on disk are first read into host rows on the disk worker. On CUDA a read-back's blocks are
published at the schedule after the one that issued it, landed or not, and that step's device work
waits for the copy's event: the copy, ordered after the step running when it was issued, has the
whole next step to land in, so its request is admitted a step sooner (a step's time off its TTFT)
and the step waits only for a copy longer than a step. The bytes move as stored, so a
read-back gives the bits a pool hit would. A read that fails (a corrupt file) ends the chain there:
the request computes the rest.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import structlog
import torch

from ..errors import StartupError
from ..runner.kv_cache import KVCache
from ..scheduling import block_manager as bm_module
from ..scheduling.block_manager import BlockManager, CachedPrefix, block_digest, root_digest
from ..scheduling.request import Request
from .copier import BlockLayout, Transfer, make_copier
from .disk import DiskIdentity, DiskTier
from .host import HostEntry, HostTier

log = structlog.get_logger(__name__)

TIERS = ("host", "disk")


@dataclass(slots=True)
class TierCounts:
    """Cumulative, per tier (TIERS): tokens read back into the pool, bytes read and written, errors."""

    hit_tokens: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    read_bytes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    write_bytes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    errors: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    readbacks: int = 0  # read-backs that landed
    readback_s: float = 0.0  # their time from start to joining the pool (on CUDA: published), summed
    reuse_waits: int = 0  # pool blocks handed out while their copy down was in flight (the step waits for it)


@dataclass(slots=True)
class _Load:
    """A read-back in flight for `request`: pool blocks `block_ids` get the chain's next blocks."""

    request: Request
    block_ids: list[int]
    keys: list[tuple[int, int | None, tuple[int, ...], bytes]]  # (hash, parent hash, tokens, digest) per block
    entries: list[HostEntry]  # the host rows read from (pinned), per block
    from_disk: list[bool]  # per block: read from disk into its host row first
    reads: list[Future[bool]]  # those disk reads, in block order
    started: float
    overwrites: list[Transfer]  # copies down still reading `block_ids` (evicted for it): the copy waits
    transfer: Transfer | None = None  # host rows -> pool blocks, once the reads are in


class KVTiers:
    def __init__(self, block_manager: BlockManager, kv_cache: KVCache, device: torch.device, *, host_bytes: int,
                 disk_dir: str | None = None, disk_bytes: int = 0, identity: DiskIdentity | None = None) -> None:
        self.bm = block_manager
        self.block_size = block_manager.block_size
        layout = BlockLayout(kv_cache)
        self.block_bytes = layout.block_bytes
        slots = host_bytes // layout.block_bytes
        if slots < 1:
            raise StartupError(f"--kv-host-gib {host_bytes / 2**30:.3g} holds no block of {layout.block_bytes} bytes: "
                               "raise it")
        self.host = HostTier(slots, layout.block_bytes, pin_memory=device.type == "cuda")
        self.copier = make_copier(layout, self.host.rows, device)
        self.disk: DiskTier | None = None
        if disk_dir is not None:
            assert identity is not None
            self.disk = DiskTier(disk_dir, disk_bytes, identity, self.host.rows)
        self.counts = TierCounts()
        self._freed: list[int] = []  # hashed blocks freed since the last flush
        self._saving: dict[int, Transfer] = {}  # pool block -> its copy down in flight
        self._wait_before_step: list[Transfer] = []  # copies of blocks this step reuses
        self._taking: list[Transfer] | None = None  # while a read-back takes its blocks: their copies down
        self._loads: list[_Load] = []
        # read-backs published while their copy was still in flight (CUDA): the host rows they read
        # stay pinned until it has landed (a disk read into a reused row would not wait for it)
        self._publishing: list[tuple[Transfer, list[HostEntry]]] = []
        self._writes: list[tuple[bytes, HostEntry, Future[int]]] = []  # disk writes in flight
        self._writing: set[bytes] = set()
        block_manager.attach(self)
        log.info("kv_tiers_ready", host_blocks=slots, host_gib=round(slots * self.block_bytes / 2**30, 3),
                 block_bytes=self.block_bytes, disk_dir=disk_dir,
                 disk_gib=round(disk_bytes / 2**30, 3) if disk_dir else None,
                 disk_blocks=self.disk.num_blocks if self.disk else None)

    # ---- LowerTiers: writing down ----------------------------------------------------------------
    def freed(self, block_id: int) -> None:
        self._freed.append(block_id)

    def evicting(self, block_id: int) -> None:
        if self._freed:
            self._save_freed()  # this step writes it: its copy is issued now, ahead of the step
        transfer = self._saving.pop(block_id, None)
        if transfer is not None and not transfer.done():
            # a read-back's block: its copy waits for this one, the steps meanwhile need not
            (self._wait_before_step if self._taking is None else self._taking).append(transfer)
            self.counts.reuse_waits += 1

    def flush(self) -> None:
        self._save_freed()
        for transfer in self._wait_before_step:
            transfer.before_next_step()
        self._wait_before_step.clear()

    def _save_freed(self) -> None:
        """Copies the freed blocks the host does not hold yet down in one batch, and queues each
        for the disk."""
        blocks, slots, new = [], [], []
        for block_id in dict.fromkeys(self._freed):
            digest, key = self.bm.block_digest(block_id), self.bm.block_key(block_id)
            if digest is None or key is None or self.bm.ref_count(block_id):
                continue  # no digest (its parent left the pool first), or taken back by a hit meanwhile
            if digest in self.host:
                self.host.touch(digest)
                continue
            entry = self.host.put(digest, key[1])
            if entry is None:
                break  # every host row is in use
            blocks.append(block_id)
            slots.append(entry.slot)
            new.append((digest, entry))
        self._freed.clear()
        if not blocks:
            return
        # the new rows in ascending slot order along the blocks (a chain's blocks come in order):
        # consecutive slots move in one copy, now and when the chain is read back
        slots.sort()
        for (_, entry), slot in zip(new, slots):
            entry.slot = slot
        transfer = self.copier.save(blocks, slots)
        self.counts.write_bytes["host"] += len(blocks) * self.block_bytes
        for block_id in blocks:
            self._saving[block_id] = transfer
        for digest, entry in new:
            entry.filling = transfer
            if self.disk is not None and digest not in self.disk and digest not in self._writing:
                entry.pins += 1
                self._writing.add(digest)
                self._writes.append((digest, entry, self.disk.write(digest, entry.tokens, entry.slot, transfer)))

    # ---- LowerTiers: reading back ----------------------------------------------------------------
    def fetch(self, request: Request, cached: CachedPrefix) -> bool:
        if request.kv_load is not None:
            return True  # its read-back is in flight
        bs = self.block_size
        first, limit = cached.num_blocks, (request.num_tokens - 1) // bs
        if first >= limit:
            return False
        salt = request.cache_salt
        parent_hash = cached.block_hashes[-1] if first else salt
        parent = self.bm.block_digest(cached.block_ids[-1]) if first else root_digest(salt)
        if parent is None:
            return False
        keys: list[tuple[int, int | None, tuple[int, ...], bytes]] = []
        entries: list[HostEntry | None] = []
        from_disk: list[bool] = []
        for i in range(first, limit):
            tokens = tuple(request.token_slice(i * bs, (i + 1) * bs))
            digest = block_digest(parent, tokens)
            entry = self.host.get(digest, tokens)
            if entry is not None and entry.reading is not None:
                if not keys:
                    return True  # on its way up from disk for another request: wait for that one
                break
            if entry is None and (self.disk is None or digest not in self.disk):
                break
            h = bm_module.hash_block(parent_hash, tokens)
            keys.append((h, parent_hash, tokens, digest))
            entries.append(entry)
            from_disk.append(entry is None)
            if entry is not None:
                entry.pins += 1  # kept while the pool makes room (which may copy blocks down)
            parent_hash, parent = h, digest
        if not keys:
            return False
        self._taking = []
        try:
            blocks = self.bm.take_blocks(len(keys))
        finally:
            overwrites, self._taking = list({id(t): t for t in self._taking}.values()), None
        reads: list[Future[bool]] = []
        for i, key in enumerate(keys):
            if i < len(blocks) and from_disk[i]:
                assert self.disk is not None
                entry = self.host.get(key[3], key[2])  # copied down meanwhile (making room above)
                from_disk[i] = entry is None
                if entry is None and (entry := self.host.put(key[3], key[2])) is not None:
                    entry.reading = self.disk.read(key[3], key[2], entry.slot)
                    self.disk.touch(key[3])
                    reads.append(entry.reading)
                if entry is not None:
                    entry.pins += 1
                    entries[i] = entry
                    continue
            if i >= len(blocks) or entries[i] is None:  # no pool block, or no host row, from here on
                for e in entries[i:]:
                    if e is not None:
                        e.pins -= 1
                self.bm.publish(blocks[i:], [])
                del keys[i:], entries[i:], from_disk[i:], blocks[i:]
                break
        if not keys:
            return False
        load = _Load(request, blocks, keys, entries, from_disk, reads, time.monotonic(),  # type: ignore[arg-type]
                     overwrites)
        if not reads:
            load.transfer = self._copy_up(load)
        request.kv_load = load
        self._loads.append(load)
        return True

    def poll(self) -> None:
        for block_id in [b for b, t in self._saving.items() if t.done()]:
            del self._saving[block_id]
        if self._publishing:
            self._publishing = [(t, entries) for t, entries in self._publishing if not self._unpin_when_done(t, entries)]
        self._poll_writes()
        if self._loads:
            self._loads = [load for load in self._loads if not self._advance(load)]

    def _advance(self, load: _Load) -> bool:
        """Moves a read-back on; True once it has landed (or failed) and is published."""
        if load.transfer is None:
            if not all(f.done() for f in load.reads):
                return False
            self._reads_in(load)
            if not load.keys:
                load.request.kv_load = None
                return True
            load.transfer = self._copy_up(load)
            return False
        landed = load.transfer.done()
        if not landed and not self.copier.device_waits:
            return False
        # (issued at an earlier schedule; on CUDA it may still be in flight: the step's device work waits)
        load.transfer.before_next_step()
        self._land(load, unpin=landed)
        if not landed:
            self._publishing.append((load.transfer, load.entries))
        return True

    def _copy_up(self, load: _Load) -> Transfer:
        """Issues the copy of a read-back's host rows into its pool blocks."""
        fills = {id(e.filling): e.filling for e in load.entries if e.filling is not None and not e.filling.done()}
        return self.copier.load([e.slot for e in load.entries], load.block_ids, fills=list(fills.values()),
                                overwrites=[t for t in load.overwrites if not t.done()])

    @staticmethod
    def _unpin_when_done(transfer: Transfer, entries: list[HostEntry]) -> bool:
        if not transfer.done():
            return False
        for entry in entries:
            entry.pins -= 1
        return True

    def _reads_in(self, load: _Load) -> None:
        """The disk reads of a read-back are in: a failed one (warned of on the worker) loses its
        host row and file, and the read-back ends before it (its pool blocks and the host rows
        after it are let go)."""
        ok, failed = len(load.keys), set()
        for i, (entry, disk) in enumerate(zip(load.entries, load.from_disk)):
            if not disk or entry.reading is None:
                continue
            good = entry.reading.result()
            entry.reading = None
            if not good:
                digest = load.keys[i][3]
                entry.pins -= 1
                self.host.remove(digest)
                assert self.disk is not None
                self.disk.discard(digest)
                self.counts.errors["disk"] += 1
                failed.add(i)
                ok = min(ok, i)
        for i in range(ok, len(load.keys)):
            if i not in failed:
                load.entries[i].pins -= 1
        self.bm.publish(load.block_ids[ok:], [])
        del load.keys[ok:], load.entries[ok:], load.from_disk[ok:], load.block_ids[ok:]

    def _land(self, load: _Load, unpin: bool = True) -> None:
        self.bm.publish(load.block_ids, load.keys)
        if unpin:
            for entry in load.entries:
                entry.pins -= 1
        n_disk = sum(load.from_disk)
        tokens = self.block_size
        self.counts.hit_tokens["host"] += (len(load.keys) - n_disk) * tokens
        self.counts.hit_tokens["disk"] += n_disk * tokens
        self.counts.read_bytes["host"] += len(load.keys) * self.block_bytes
        self.counts.read_bytes["disk"] += n_disk * self.block_bytes
        self.counts.readbacks += 1
        self.counts.readback_s += time.monotonic() - load.started
        load.request.kv_load = None

    def _poll_writes(self) -> None:
        if not self._writes:
            return
        pending = []
        for digest, entry, future in self._writes:
            if not future.done():
                pending.append((digest, entry, future))
                continue
            entry.pins -= 1
            self._writing.discard(digest)
            assert self.disk is not None
            try:
                size = future.result()
            except OSError as e:
                self.counts.errors["disk"] += 1
                if self.counts.errors["disk"] & (self.counts.errors["disk"] - 1) == 0:  # 1st, 2nd, 4th, ... failure
                    log.warning("kv_disk_write_failed", dir=str(self.disk.dir), error=str(e),
                                failures=self.counts.errors["disk"], action="the block stays in host memory only")
                continue
            self.disk.added(digest, size)
            self.counts.write_bytes["disk"] += self.block_bytes
        self._writes = pending

    # ---- the rest of LowerTiers, and the engine's -------------------------------------------------
    def reset(self) -> None:
        """Forgets every block below the pool (rows that a read-back or disk write still reads go
        once it is done with them); disk writes in flight land first, then their files go too."""
        self._freed.clear()
        for _, _, future in self._writes:
            try:
                future.result()
            except OSError:
                pass
        self._poll_writes()
        self.host.clear()
        if self.disk is not None:
            self.disk.clear()

    @property
    def loading(self) -> bool:
        """A read-back is in flight (its request waits; the steps meanwhile run without it)."""
        return bool(self._loads)

    def held_blocks(self) -> list[int]:
        return [b for load in self._loads for b in load.block_ids]

    def close(self) -> None:
        """Copies down what was freed, lets every copy and disk write land, and stops the workers
        (a restarted server finds on disk everything the host tier held)."""
        self._save_freed()
        for transfer in self._saving.values():
            transfer.wait()
        self._saving.clear()
        for load in self._loads:
            for read in load.reads:
                read.exception()
            if load.transfer is not None:
                load.transfer.wait()
        for transfer, _ in self._publishing:
            transfer.wait()
        for _, _, write in self._writes:
            write.exception()
        self._poll_writes()
        self.copier.close()
        if self.disk is not None:
            self.disk.close()

    def stats(self) -> dict[str, Any]:
        """EngineStats' kv_* fields of the tiers."""
        c = self.counts
        return dict(kv_host_blocks_total=self.host.num_slots, kv_host_blocks_used=len(self.host),
                    kv_disk_blocks_used=self.disk.num_blocks if self.disk else 0,
                    kv_disk_bytes_total=self.disk.capacity_bytes if self.disk else 0,
                    kv_disk_bytes_used=self.disk.used_bytes if self.disk else 0,
                    kv_tier_hit_tokens=dict(c.hit_tokens), kv_tier_read_bytes=dict(c.read_bytes),
                    kv_tier_write_bytes=dict(c.write_bytes), kv_tier_errors=dict(c.errors),
                    kv_readbacks=c.readbacks, kv_readback_seconds=c.readback_s)
