"""The host tier: a fixed pool of block records in host memory (pinned on CUDA), LRU.

Each entry is one full block, named by its stable digest (engine/scheduling/block_manager.py
`block_digest`, 128 bits chained over the whole prefix), with its token ids, which a hit checks too.
An entry's row may still be filling: a copy from the pool (`filling`; copies are issued in order, so
a read-back issued after the save of a row reads what the save wrote), or a read from disk
(`reading`: a read-back of it waits for that first). Entries that a read-back or a disk write still
reads are pinned (`pins`) and never evicted; eviction takes the least recently used of the others.
"""

from __future__ import annotations

from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from ..errors import StartupError
from .copier import Transfer


@dataclass(slots=True)
class HostEntry:
    slot: int  # its row of the pool
    tokens: tuple[int, ...]  # the block's token ids
    filling: Transfer | None = None  # the copy from the pool that fills the row (None: none in flight)
    reading: Future[bool] | None = None  # the read from disk that fills it (None: none in flight)
    pins: int = 0  # read-backs and disk writes reading the row


def available_host_bytes() -> int | None:
    """MemAvailable of /proc/meminfo (None where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def check_host_memory(need: int) -> None:
    """StartupError when `need` bytes are more than the host has available."""
    avail = available_host_bytes()
    if avail is not None and need > avail:
        raise StartupError(f"--kv-host-gib {need / 2**30:.3g} asks for more host memory than is available "
                           f"({avail / 2**30:.3g} GiB): lower --kv-host-gib")


class HostTier:
    def __init__(self, num_slots: int, block_bytes: int, *, pin_memory: bool) -> None:
        need = num_slots * block_bytes
        check_host_memory(need)
        try:
            self.rows = torch.empty((num_slots, block_bytes), dtype=torch.uint8, pin_memory=pin_memory)
        except RuntimeError as e:  # pinning can fail below MemAvailable (ulimit -l, containers)
            raise StartupError(f"--kv-host-gib {need / 2**30:.3g}: cannot allocate {'pinned ' if pin_memory else ''}"
                               f"host memory ({e}); lower --kv-host-gib") from e
        self.num_slots = num_slots
        self.block_bytes = block_bytes
        self._entries: OrderedDict[bytes, HostEntry] = OrderedDict()  # least recently used first
        self._free_slots = list(range(num_slots - 1, -1, -1))

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, digest: bytes) -> bool:
        return digest in self._entries

    def get(self, digest: bytes, tokens: tuple[int, ...]) -> HostEntry | None:
        """The entry of `digest` if it holds that block (its tokens equal), made the most
        recently used; else None."""
        entry = self._entries.get(digest)
        if entry is None or entry.tokens != tokens:
            return None
        self._entries.move_to_end(digest)
        return entry

    def touch(self, digest: bytes) -> None:
        if digest in self._entries:
            self._entries.move_to_end(digest)

    def put(self, digest: bytes, tokens: tuple[int, ...]) -> HostEntry | None:
        """A new entry (the most recently used) with a row to fill, evicting the least recently
        used unpinned entry when the pool is full; None when every row is pinned."""
        assert digest not in self._entries
        if not self._free_slots and not self._evict_one():
            return None
        entry = HostEntry(self._free_slots.pop(), tokens)
        self._entries[digest] = entry
        return entry

    def _evict_one(self) -> bool:
        for digest, entry in self._entries.items():
            if not entry.pins:
                self.remove(digest)
                return True
        return False

    def remove(self, digest: bytes) -> None:
        entry = self._entries.pop(digest)
        assert not entry.pins, "a pinned host row is in use"
        self._free_slots.append(entry.slot)

    def clear(self) -> int:
        """Drops every unpinned entry (pinned ones are in use, and go when unpinned and evicted);
        returns how many went."""
        drop = [d for d, e in self._entries.items() if not e.pins]
        for digest in drop:
            self.remove(digest)
        return len(drop)
