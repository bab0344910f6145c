"""Physical KV cache blocks: who holds which, which are free, and which hold a cached prefix.

A request's block table maps its logical block i (tokens i*block_size .. (i+1)*block_size - 1) to a
physical block id; the slot of token p is table[p // block_size] * block_size + p % block_size.

Prefix caching: a full block is named by a hash chained over its tokens and its parent's hash, so
one hash names the whole prefix up to the block's end:

    block 0: h0 = hash_block(None, tokens[0:bs])
    block 1: h1 = hash_block(h0,   tokens[bs:2bs])   ...

A block gets its hash once its K/V are all computed (`cache_full_blocks`, after each step). When a
request lets go of it, it stays in the free queue with its contents (evictable): a new request whose
prefix chain matches takes it back out of the middle of the queue, and only when allocation reaches
it at the head is its hash dropped (LRU eviction). Hits compare the stored (parent hash, tokens) too,
so a hash collision is a miss, not a wrong answer. Blocks with ref_count > 1 are shared.

Below the pool (engine/offload/, when host or disk tiers are attached: `attach`): each hashed
block also gets a digest, chained the same way but stable across processes (`block_digest`), which
names it in the lower tiers. A hashed block that goes back to the free queue is reported to them
(`LowerTiers.freed`: they copy it down while it waits there), and so is one about to lose its
content to a new owner (`LowerTiers.evicting`: a copy still in flight must land first). Blocks read
back from below are taken without a request (`take_blocks`) and published as cached free blocks
once their K/V have landed (`publish`).
"""

from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass, field
from typing import Protocol

from .free_queue import FreeBlockQueue
from .request import Request

__all__ = ["BlockManager", "CachedPrefix", "FreeBlockQueue", "LowerTiers", "block_digest", "hash_block",
           "root_digest"]


def hash_block(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    """The chained hash of a full block (Python's hash: salted per process, fine in-process).
    Looked up through the module at each call, so tests can monkeypatch it to force collisions."""
    return hash((parent_hash, token_ids))


def root_digest(salt: int | None) -> bytes:
    """The parent digest of a request's first block: fixed for the base model (so a restarted
    server finds its disk tier again); a LoRA adapter's salt is drawn per process and load, so its
    blocks never outlive the adapter they were computed with."""
    return hashlib.blake2b(b"pie-kv" if salt is None else salt.to_bytes(8, "little", signed=True),
                           digest_size=16).digest()


def block_digest(parent: bytes, token_ids: tuple[int, ...]) -> bytes:
    """The stable chained name of a full block in the lower tiers: 128 bits of BLAKE2b over the
    parent's digest and the block's token ids."""
    return hashlib.blake2b(parent + array("q", token_ids).tobytes(), digest_size=16).digest()


class LowerTiers(Protocol):
    """What the block manager and the scheduler ask of the tiers below the pool
    (engine.offload.tiers.KVTiers, which imports this module: hence a protocol here)."""

    def freed(self, block_id: int) -> None: ...  # a hashed block went back to the free queue, content intact

    def evicting(self, block_id: int) -> None: ...  # a hashed block is about to be handed out (content lost)

    def poll(self) -> None: ...  # start of a step's schedule: finished read-backs become cached blocks

    def fetch(self, request: Request, cached: CachedPrefix) -> bool: ...  # True: it waits for a read-back

    def flush(self) -> None: ...  # end of a step's schedule: copies of freed blocks go down

    def reset(self) -> None: ...  # forget every block held below

    def held_blocks(self) -> list[int]: ...  # pool blocks that read-backs in flight hold


@dataclass(slots=True)
class CachedPrefix:
    """A request's longest cached prefix: blocks to reuse and the chain hashes of its full blocks."""

    block_ids: list[int] = field(default_factory=list)  # physical ids of the hit blocks, in order
    block_hashes: list[int] = field(default_factory=list)  # chain hash of each hit block
    num_queried_tokens: int = 0  # tokens looked up (the request's num_tokens), for the hit rate

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)


class BlockManager:
    """Owns the free queue, per-block reference counts and the prefix cache (hash -> block id, plus
    each cached block's key for the equality check). A request's block table and its blocks' chain
    hashes live on the request (`Request.block_ids`, `Request.block_hashes`); this class is the one
    that changes them."""

    def __init__(self, num_blocks: int, block_size: int, *, enable_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks, block_size >= 1, got {num_blocks}, {block_size}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self._num_blocks = num_blocks
        self._free = FreeBlockQueue(num_blocks)
        self._ref_counts = [0] * num_blocks
        # Prefix cache. _keys[b] is (parent hash, tokens) of a hashed block b, else None.
        self._cached: dict[int, int] = {}  # chain hash -> block id
        self._hashes: list[int | None] = [None] * num_blocks
        self._keys: list[tuple[int | None, tuple[int, ...]] | None] = [None] * num_blocks
        self.prefix_cache_queries = 0  # tokens looked up in the cache on admission (cumulative)
        self.prefix_cache_hits = 0  # of those, tokens found cached (cumulative)
        self.num_cached_free_blocks = 0  # free blocks still holding reusable cached content
        # Host and disk tiers below the pool (`attach`); each hashed block's stable digest for them.
        self.lower: LowerTiers | None = None
        self._digests: list[bytes | None] = [None] * num_blocks

    def attach(self, lower: LowerTiers) -> None:
        """Puts tiers below the pool: from now on hashed blocks get digests and are reported."""
        assert self.enable_caching, "lower tiers extend the prefix cache"
        self.lower = lower

    @property
    def num_free_blocks(self) -> int:
        """Free blocks, counting evictable cached ones (they can be handed out at once)."""
        return len(self._free)

    @property
    def num_total_blocks(self) -> int:
        return self._num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def block_hash(self, block_id: int) -> int | None:
        return self._hashes[block_id]

    def block_digest(self, block_id: int) -> bytes | None:
        """The stable digest of a hashed block (None: unhashed, or no tiers attached)."""
        return self._digests[block_id]

    def block_key(self, block_id: int) -> tuple[int | None, tuple[int, ...]] | None:
        """(parent hash, token ids) of a hashed block, else None."""
        return self._keys[block_id]

    def free_queue(self) -> list[int]:
        """Free block ids in eviction order (head first); for tests and debugging."""
        return list(self._free)

    # ---- prefix cache ------------------------------------------------------------------------
    def find_cached_prefix(self, request: Request) -> CachedPrefix:
        """The longest run of the request's leading full blocks that is cached, read-only.

        At most (num_tokens - 1) // block_size blocks: at least one token is left to compute, so
        the step that runs it produces the logits of the next token.
        """
        result = CachedPrefix(num_queried_tokens=request.num_tokens)
        if not self.enable_caching:
            return result
        bs = self.block_size
        parent = request.cache_salt
        for i in range((request.num_tokens - 1) // bs):
            tokens = tuple(request.token_slice(i * bs, (i + 1) * bs))
            h = hash_block(parent, tokens)
            block_id = self._cached.get(h)
            if block_id is None or self._keys[block_id] != (parent, tokens):
                break  # a miss, or a hash collision caught by the equality check
            result.block_ids.append(block_id)
            result.block_hashes.append(h)
            parent = h
        return result

    def reset_prefix_cache(self, lower_tiers: bool = True) -> int:
        """Forgets the cached content of every free block (blocks held by requests keep theirs)
        and, unless `lower_tiers` is False, every block of the host and disk tiers, e.g. so that a
        benchmark's repeat computes its prompts again. Returns the pool's blocks dropped."""
        if self.lower is not None:
            self.lower.flush()  # blocks freed since the last step go down first (or are dropped next)
        dropped = sum(self._forget_content(block_id) for block_id in self._free)
        self.num_cached_free_blocks -= dropped
        if lower_tiers and self.lower is not None:
            self.lower.reset()
        return dropped

    def _forget_content(self, block_id: int) -> bool:
        """Unhashes a block (its content is no longer findable); True if it had a hash."""
        h = self._hashes[block_id]
        if h is None:
            return False
        if self._cached.get(h) == block_id:
            del self._cached[h]
        self._hashes[block_id] = None
        self._keys[block_id] = None
        self._digests[block_id] = None
        return True

    def cache_full_blocks(self, request: Request) -> None:
        """Hash the request's blocks that became full of computed tokens since the last call.

        A block whose hash is already cached under another id (the same prefix computed twice,
        e.g. two equal prompts admitted in one step) stays unhashed: it is freed as plain memory.
        """
        if not self.enable_caching:
            return
        table, hashes = request.block_ids, request.block_hashes
        bs = self.block_size
        num_full = request.num_computed_tokens // bs
        if num_full == len(hashes):
            return  # no block filled up since the last call (most steps)
        for i in range(len(hashes), num_full):
            parent = hashes[-1] if hashes else request.cache_salt
            tokens = tuple(request.token_slice(i * bs, (i + 1) * bs))
            h = hash_block(parent, tokens)
            hashes.append(h)
            block_id = table[i]
            if self._hashes[block_id] is None and h not in self._cached:
                self._cached[h] = block_id
                self._hashes[block_id] = h
                self._keys[block_id] = (parent, tokens)
                if self.lower is not None:
                    self._digests[block_id] = self._child_digest(parent if i else None, request.cache_salt, tokens)

    def _child_digest(self, parent_hash: int | None, salt: int | None, tokens: tuple[int, ...]) -> bytes | None:
        """The digest of a block under the block cached as `parent_hash` (None: the first block,
        under `salt`'s root); None when the parent's digest is unknown (it left the pool)."""
        if parent_hash is None:
            return block_digest(root_digest(salt), tokens)
        parent_id = self._cached.get(parent_hash)
        parent = None if parent_id is None else self._digests[parent_id]
        return None if parent is None else block_digest(parent, tokens)

    def _take_free(self) -> int:
        """Pop the head of the free queue (the least recently freed), evicting its cached content."""
        block_id = self._free.popleft()
        if self.lower is not None and self._hashes[block_id] is not None:
            self.lower.evicting(block_id)
        if self._forget_content(block_id):
            self.num_cached_free_blocks -= 1
        return block_id

    # ---- read-backs from the lower tiers -------------------------------------------------------
    def take_blocks(self, n: int) -> list[int]:
        """Up to n blocks off the free queue for a read-back, held (ref 1) by no request."""
        taken = []
        for _ in range(min(n, len(self._free))):
            block_id = self._take_free()
            self._ref_counts[block_id] = 1
            taken.append(block_id)
        return taken

    def publish(self, block_ids: list[int], keys: list[tuple[int, int | None, tuple[int, ...], bytes]]) -> None:
        """Blocks of a read-back, their K/V landed: each (hash, parent hash, tokens, digest) of
        `keys` names the block at the same place (a shorter `keys` leaves the rest unnamed); all
        go back to the free queue, the named ones as cached blocks (the first ones last, so they
        are evicted last). A hash cached meanwhile under another block stays with that one."""
        for i in reversed(range(len(block_ids))):
            block_id = block_ids[i]
            self._ref_counts[block_id] -= 1
            assert self._ref_counts[block_id] == 0, f"block {block_id} of a read-back is shared"
            self._free.append(block_id)
            if i < len(keys) and keys[i][0] not in self._cached:
                h, parent, tokens, digest = keys[i]
                self._cached[h] = block_id
                self._hashes[block_id], self._keys[block_id], self._digests[block_id] = h, (parent, tokens), digest
                self.num_cached_free_blocks += 1

    # ---- allocation ----------------------------------------------------------------------------
    def allocate_slots(self, request: Request, num_new_tokens: int,
                       cached: CachedPrefix | None = None) -> tuple[int, ...] | None:
        """Grow the request's table to cover `num_computed_tokens + num_new_tokens` tokens, after
        the `cached` prefix blocks when given (only for a request without a table; the caller then
        sets num_computed_tokens to the prefix length).

        Allocates only the missing blocks and returns the ids appended to the table (the cached
        ones first; empty when the last block still has room), or None, changing nothing, when too
        few blocks are free.
        """
        table = request.block_ids
        have = len(table)
        if cached is None and request.num_computed_tokens + num_new_tokens <= have * self.block_size:
            return ()  # the common decode step: the last block still has room
        num_hit = 0 if cached is None else cached.num_blocks
        assert num_hit == 0 or not have, "a cached prefix is only taken on admission"
        total = request.num_computed_tokens + num_hit * self.block_size + num_new_tokens
        missing = self.blocks_needed(total) - have - num_hit
        hit_free = 0 if cached is None else sum(1 for b in cached.block_ids if self._ref_counts[b] == 0)
        if missing + hit_free > len(self._free):
            return None
        if cached is not None:
            for block_id in cached.block_ids:  # touch: take it off the free queue or share it
                if self._ref_counts[block_id] == 0:
                    self._free.remove(block_id)
                    self.num_cached_free_blocks -= 1
                self._ref_counts[block_id] += 1
                table.append(block_id)
            request.block_hashes[:] = cached.block_hashes
            self.prefix_cache_queries += cached.num_queried_tokens
            self.prefix_cache_hits += num_hit * self.block_size
        for _ in range(missing):
            block_id = self._take_free()
            self._ref_counts[block_id] = 1
            table.append(block_id)
        return tuple(table[have:])

    def free(self, request: Request) -> None:
        """Release the request's blocks; idempotent (a request without a table is a no-op).

        Blocks whose count drops to 0 go back tail first, so the last blocks of a sequence (the
        least likely to be shared as a prefix) are evicted first; hashed ones keep their content.
        """
        table = request.block_ids
        request.block_hashes.clear()
        for block_id in reversed(table):
            self._ref_counts[block_id] -= 1
            assert self._ref_counts[block_id] >= 0, f"block {block_id} freed twice"
            if self._ref_counts[block_id] == 0:
                self._free.append(block_id)
                if self._hashes[block_id] is not None:
                    self.num_cached_free_blocks += 1
                    if self.lower is not None:
                        self.lower.freed(block_id)
        table.clear()

    def trim(self, request: Request) -> int:
        """Gives back the request's blocks past those its tokens need (`num_tokens`): after a
        verify step, the tail that only rejected proposals filled (engine/spec_decode/speculator.py). Such
        blocks never held a hashed (fully computed) prefix. Returns how many went back."""
        table = request.block_ids
        keep = self.blocks_needed(request.num_tokens)
        if len(table) <= keep:
            return 0
        for block_id in reversed(table[keep:]):
            assert self._hashes[block_id] is None, f"block {block_id} past the request's tokens is hashed"
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                self._free.append(block_id)
        dropped = len(table) - keep
        del table[keep:]
        return dropped

    def slot_mapping(self, request: Request, start: int, end: int) -> list[int]:
        """Slots of the request's tokens at positions start .. end-1 (they must be allocated).

        For tests and debugging; the runner computes a whole step's slots at once
        (engine/runner/staging.py).
        """
        table = request.block_ids
        bs = self.block_size
        assert 0 <= start <= end <= len(table) * bs, f"positions {start}..{end} not allocated"
        slots: list[int] = []
        for i in range(start // bs, -(-end // bs)):  # one range per block touched
            base = table[i] * bs
            slots.extend(range(base + max(start - i * bs, 0), base + min(end - i * bs, bs)))
        return slots
