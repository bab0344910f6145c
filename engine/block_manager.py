"""Physical KV cache blocks: who holds which, and which are free.

A request's block table maps its logical block i (tokens i*block_size .. (i+1)*block_size - 1) to a
physical block id; the slot of token p is table[p // block_size] * block_size + p % block_size.
"""

from __future__ import annotations

from collections.abc import Iterator

from engine.request import Request


class FreeBlockQueue:
    """The free block ids, in eviction order: allocation pops the head, freeing appends at the tail.

    Why a doubly linked list over block ids and not a deque: with prefix caching, a freed block
    keeps its cached contents until it is reused, and a later request that hits that cache takes
    the block back out of the *middle* of the free list. Linked through two int arrays indexed by
    block id, that removal is O(1) (a deque would be O(n)), and nothing is allocated per operation.
    Freeing at the tail and allocating at the head makes the queue an LRU: the blocks freed longest
    ago are reused first.
    """

    def __init__(self, num_blocks: int) -> None:
        # Ids 0..num_blocks-1 are blocks; `num_blocks` is the sentinel that closes the ring.
        self._sentinel = num_blocks
        self._next = list(range(1, num_blocks + 1)) + [0]
        self._prev = [num_blocks] + list(range(num_blocks))
        self._in_queue = [True] * num_blocks
        self._len = num_blocks

    def __len__(self) -> int:
        return self._len

    def __contains__(self, block_id: int) -> bool:
        return self._in_queue[block_id]

    def __iter__(self) -> Iterator[int]:
        node = self._next[self._sentinel]
        while node != self._sentinel:
            yield node
            node = self._next[node]

    def popleft(self) -> int:
        if self._len == 0:
            raise IndexError("no free blocks")
        block_id = self._next[self._sentinel]
        self.remove(block_id)
        return block_id

    def remove(self, block_id: int) -> None:
        assert self._in_queue[block_id], f"block {block_id} is not free"
        prev, nxt = self._prev[block_id], self._next[block_id]
        self._next[prev] = nxt
        self._prev[nxt] = prev
        self._in_queue[block_id] = False
        self._len -= 1

    def append(self, block_id: int) -> None:
        assert not self._in_queue[block_id], f"block {block_id} is already free"
        last = self._prev[self._sentinel]
        self._next[last] = block_id
        self._prev[block_id] = last
        self._next[block_id] = self._sentinel
        self._prev[self._sentinel] = block_id
        self._in_queue[block_id] = True
        self._len += 1


class BlockManager:
    """Owns the free list, per-block reference counts and each request's block table.

    Reference counts are 1 for every held block today; they are here so that prefix caching can
    later share full blocks between requests without changing `free`.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks, block_size >= 1, got {num_blocks}, {block_size}")
        self.block_size = block_size
        self._num_blocks = num_blocks
        self._free = FreeBlockQueue(num_blocks)
        self._ref_counts = [0] * num_blocks
        self._tables: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_total_blocks(self) -> int:
        return self._num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Grow the request's table to cover `num_computed_tokens + num_new_tokens` tokens.

        Allocates only the missing blocks; returns False, allocating nothing, when too few are free.
        """
        table = self._tables.get(request.request_id)
        have = 0 if table is None else len(table)
        missing = self.blocks_needed(request.num_computed_tokens + num_new_tokens) - have
        if missing > len(self._free):
            return False
        if table is None:
            table = self._tables[request.request_id] = []
        for _ in range(missing):
            block_id = self._free.popleft()
            self._ref_counts[block_id] = 1
            table.append(block_id)
        return True

    def free(self, request: Request) -> None:
        """Release the request's blocks; idempotent (a request without a table is a no-op).

        Blocks whose count drops to 0 go back tail first, so the last blocks of a sequence (the
        least likely to be shared as a prefix) are the first to be reused.
        """
        table = self._tables.pop(request.request_id, None)
        if table is None:
            return
        for block_id in reversed(table):
            self._ref_counts[block_id] -= 1
            assert self._ref_counts[block_id] >= 0, f"block {block_id} freed twice"
            if self._ref_counts[block_id] == 0:
                self._free.append(block_id)

    def get_block_table(self, request_id: str) -> list[int]:
        """The request's physical block ids in logical order (the live list: copy it to keep it)."""
        return self._tables.get(request_id, [])

    def slot_mapping(self, request_id: str, start: int, end: int) -> list[int]:
        """Slots of the request's tokens at positions start .. end-1 (they must be allocated).

        For tests and debugging; the runner builds slots for a whole batch with
        `kernels.compute_slot_mapping`.
        """
        table = self._tables[request_id]
        bs = self.block_size
        assert 0 <= start <= end <= len(table) * bs, f"positions {start}..{end} not allocated"
        slots: list[int] = []
        for i in range(start // bs, -(-end // bs)):  # one range per block touched
            base = table[i] * bs
            slots.extend(range(base + max(start - i * bs, 0), base + min(end - i * bs, bs)))
        return slots
