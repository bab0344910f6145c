"""The free KV blocks of the pool, in eviction order (engine/scheduling/block_manager.py owns it)."""

from __future__ import annotations

from collections.abc import Iterator


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
