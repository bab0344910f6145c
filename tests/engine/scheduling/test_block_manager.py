"""BlockManager on tiny pools: exact block ids, growth, free order, refcounts, failed allocation."""

from __future__ import annotations

import pytest

from pie.engine.sampling_params import SamplingParams
from pie.engine.scheduling.block_manager import BlockManager, FreeBlockQueue
from pie.engine.scheduling.request import Request


def req(rid: str, num_prompt: int = 1) -> Request:
    return Request(rid, list(range(num_prompt)), SamplingParams(max_tokens=4), max_model_len=1024)


def test_blocks_needed_is_ceil() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    assert [bm.blocks_needed(n) for n in (0, 1, 3, 4, 5, 8, 9)] == [0, 1, 1, 1, 2, 2, 3]
    assert bm.num_total_blocks == 8 and bm.num_free_blocks == 8


def test_allocate_takes_ids_from_the_head_in_order() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    a, b = req("a"), req("b")
    assert bm.allocate_slots(a, 6) == (0, 1)  # the ids it appended
    assert bm.allocate_slots(b, 9) == (2, 3, 4)
    assert a.block_ids == [0, 1]
    assert b.block_ids == [2, 3, 4]
    assert bm.num_free_blocks == 3
    assert [bm.ref_count(i) for i in range(8)] == [1, 1, 1, 1, 1, 0, 0, 0]


def test_growth_by_one_block_at_the_boundary() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    a, other = req("a"), req("other")
    assert bm.allocate_slots(a, 4) == (0,)
    assert bm.allocate_slots(other, 1) == (1,)  # takes block 1, so a's next block is not adjacent
    a.num_computed_tokens = 4
    assert a.block_ids == [0]
    # Covering 4 + 0 tokens needs nothing new; the 5th token needs exactly one more block.
    assert bm.allocate_slots(a, 0) == () and a.block_ids == [0]
    assert bm.allocate_slots(a, 1) == (2,) and a.block_ids == [0, 2]
    a.num_computed_tokens = 5
    assert bm.allocate_slots(a, 3) == () and a.block_ids == [0, 2]  # 8 tokens: 2 blocks
    assert bm.num_free_blocks == 5
    assert bm.slot_mapping(a, 2, 7) == [2, 3, 8, 9, 10]


def test_free_returns_blocks_tail_first() -> None:
    bm = BlockManager(num_blocks=6, block_size=2)
    a, b = req("a"), req("b")
    assert bm.allocate_slots(a, 6) == (0, 1, 2)
    assert bm.allocate_slots(b, 6) == (3, 4, 5)
    assert bm.num_free_blocks == 0
    bm.free(a)
    assert bm.num_free_blocks == 3 and a.block_ids == []
    assert [bm.ref_count(i) for i in range(6)] == [0, 0, 0, 1, 1, 1]
    bm.free(b)
    # Free list is now a's blocks reversed, then b's blocks reversed.
    c = req("c")
    assert bm.allocate_slots(c, 8) == (2, 1, 0, 5)
    assert c.block_ids == [2, 1, 0, 5]
    d = req("d")
    assert bm.allocate_slots(d, 4) == (4, 3) and d.block_ids == [4, 3]


def test_free_is_idempotent_and_ignores_unknown_ids() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    a = req("a")
    assert bm.allocate_slots(a, 5) == (0, 1)
    bm.free(a)
    bm.free(a)
    bm.free(req("never-allocated"))
    assert bm.num_free_blocks == 4
    assert all(bm.ref_count(i) == 0 for i in range(4))


def test_failed_allocation_allocates_nothing() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    a, b = req("a"), req("b")
    assert bm.allocate_slots(a, 8) == (0, 1)
    assert bm.allocate_slots(b, 9) is None  # needs 3, 2 free
    assert bm.num_free_blocks == 2 and b.block_ids == []
    a.num_computed_tokens = 8
    assert bm.allocate_slots(a, 9) is None  # 17 tokens: needs 3 more, 2 free
    assert a.block_ids == [0, 1] and bm.num_free_blocks == 2
    assert bm.allocate_slots(b, 8) == (2, 3) and b.block_ids == [2, 3]
    assert bm.num_free_blocks == 0


def test_free_queue_removes_from_the_middle() -> None:
    q = FreeBlockQueue(5)
    assert list(q) == [0, 1, 2, 3, 4] and len(q) == 5
    q.remove(2)
    q.remove(0)
    assert list(q) == [1, 3, 4] and 2 not in q and 3 in q
    q.append(2)
    q.append(0)
    assert [q.popleft() for _ in range(5)] == [1, 3, 4, 2, 0]
    with pytest.raises(IndexError):
        q.popleft()
    q.append(4)
    assert list(q) == [4]
