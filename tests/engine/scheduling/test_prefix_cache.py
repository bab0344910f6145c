"""Prefix caching in the block manager and scheduler: exact block ids, LRU eviction order, the
token-equality check, sharing, and preemption fairness (CPU, no model)."""

from __future__ import annotations

import pie.engine.scheduling.block_manager as block_manager_module
from pie.engine.messages import RequestStatus, SampledToken
from pie.engine.sampling_params import SamplingParams
from pie.engine.scheduling.block_manager import BlockManager
from pie.engine.scheduling.request import Request
from pie.engine.scheduling.scheduler import Scheduler
from pie.engine.scheduling.step import SchedulerOutput, StepOutput

TOKEN = 7


def req(rid: str, tokens: list[int], max_tokens: int = 4, arrival: float | None = None) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=max_tokens), max_model_len=256,
                   arrival_time=arrival)


def close(sched: Scheduler, out: SchedulerOutput) -> None:
    """The engine's end of a step: launched, then every sampling row read back as TOKEN."""
    sched.step_launched(out)
    rows = out.sampling_requests
    sched.update_from_output(StepOutput(rows, [[SampledToken(TOKEN, 0.0, [])] for _ in rows]))


def compute(bm: BlockManager, r: Request, num_tokens: int | None = None) -> None:
    """Admit r (taking its cached prefix) and mark its whole prompt as computed."""
    cached = bm.find_cached_prefix(r)
    num_cached = cached.num_blocks * bm.block_size
    assert bm.allocate_slots(r, r.num_tokens - num_cached, cached) == tuple(r.block_ids)
    r.num_computed_tokens = r.num_tokens if num_tokens is None else num_tokens
    bm.cache_full_blocks(r)


def test_hit_reuses_blocks_and_leaves_one_token_to_compute() -> None:
    bm = BlockManager(8, 4)
    a = req("a", list(range(10)))  # blocks 0, 1 full; block 2 partial
    compute(bm, a)
    assert a.block_ids == [0, 1, 2]
    assert bm.block_hash(0) is not None and bm.block_hash(1) is not None and bm.block_hash(2) is None
    b = req("b", list(range(9)))  # same first two blocks + one token
    hit = bm.find_cached_prefix(b)
    assert hit.block_ids == [0, 1]
    assert bm.allocate_slots(b, 1, hit) == (0, 1, 3)  # the cached blocks, then a new one
    assert b.block_ids == [0, 1, 3]
    assert bm.ref_count(0) == bm.ref_count(1) == 2 and bm.ref_count(3) == 1
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (10 + 9, 8)  # a's lookup missed
    # Exactly 8 tokens: at most (8 - 1) // 4 = 1 block is taken, so the last one is computed.
    assert bm.find_cached_prefix(req("c", list(range(8)))).block_ids == [0]
    # A different first block misses everything (the hash chains over the parent).
    assert bm.find_cached_prefix(req("d", [99] + list(range(1, 10)))).block_ids == []


def test_freed_cached_blocks_are_evicted_lru_deepest_first() -> None:
    bm = BlockManager(6, 2)
    a = req("a", [1, 2, 3, 4, 5])  # blocks 0, 1 (full), 2
    compute(bm, a)
    b = req("b", [6, 7, 8, 9, 10])  # blocks 3, 4 (full), 5
    compute(bm, b)
    bm.free(a)
    bm.free(b)
    # Tail of each table first, in order of release.
    assert bm.free_queue() == [2, 1, 0, 5, 4, 3]
    assert bm.num_free_blocks == 6 and bm.num_cached_free_blocks == 4
    # A hit on a's prefix takes blocks 0 and 1 out of the middle of the queue.
    c = req("c", [1, 2, 3, 4, 11])
    hit = bm.find_cached_prefix(c)
    assert hit.block_ids == [0, 1]
    assert bm.allocate_slots(c, 1, hit) == (0, 1, 2)
    assert c.block_ids == [0, 1, 2]  # block 2 (uncached) from the head
    assert bm.free_queue() == [5, 4, 3] and bm.num_cached_free_blocks == 2
    # Allocating 2 more evicts 5 (uncached) then 4 (b's deepest full block), keeping 3.
    d = req("d", [20, 21, 22, 23])
    assert bm.allocate_slots(d, 4) == (5, 4)
    assert d.block_ids == [5, 4]
    assert bm.block_hash(4) is None and bm.num_cached_free_blocks == 1
    assert bm.find_cached_prefix(req("e", [6, 7, 8, 9, 10])).block_ids == [3]  # b's block 1 is gone
    for r in (c, d):
        bm.free(r)
    assert bm.num_free_blocks == 6 and all(bm.ref_count(i) == 0 for i in range(6))


def test_hash_collision_is_rejected_by_the_token_check(monkeypatch) -> None:
    monkeypatch.setattr(block_manager_module, "hash_block", lambda parent, tokens: 42)
    bm = BlockManager(4, 2)
    a = req("a", [1, 2, 3])
    compute(bm, a)
    assert bm.block_hash(0) == 42
    # Same hash, different tokens: a miss.
    assert bm.find_cached_prefix(req("b", [8, 9, 3])).block_ids == []
    assert bm.find_cached_prefix(req("c", [1, 2, 5])).block_ids == [0]


def test_disabled_cache_never_hits() -> None:
    bm = BlockManager(4, 2, enable_caching=False)
    compute(bm, req("a", [1, 2, 3]))
    assert bm.block_hash(0) is None
    assert bm.find_cached_prefix(req("b", [1, 2, 3])).block_ids == []


def test_decode_blocks_get_hashed_when_full() -> None:
    bm = BlockManager(4, 2)
    a = req("a", [1, 2, 3])
    compute(bm, a)
    assert bm.block_hash(1) is None
    a.output_token_ids.append(4)
    assert bm.allocate_slots(a, 1) == ()  # 4 tokens still fit in 2 blocks
    a.num_computed_tokens = 4
    bm.cache_full_blocks(a)
    assert bm.block_hash(1) is not None
    assert bm.find_cached_prefix(req("b", [1, 2, 3, 4, 5])).block_ids == [0, 1]


def test_scheduler_skips_the_cached_prefix() -> None:
    bm = BlockManager(16, 4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64)
    prefix = list(range(100, 112))  # 3 full blocks
    a = req("a", prefix + [1, 2])
    sched.add_request(a.group)
    out = sched.schedule()
    assert [(s.start, s.num_new_tokens) for s in out.scheduled] == [(0, 14)]
    close(sched, out)
    b = req("b", prefix + [3])
    sched.add_request(b.group)
    out = sched.schedule()
    # a decodes first; b's first 12 tokens come from the cache.
    assert [(s.request.request_id, s.start, s.num_new_tokens) for s in out.scheduled] == [
        ("a", 14, 1), ("b", 12, 1)]
    assert b.block_ids[:3] == a.block_ids[:3] and b.block_ids[3] not in a.block_ids
    assert b.num_cached_tokens == 12
    for r in (a, b):
        sched.finish(r, RequestStatus.FINISHED_ABORTED)
    assert bm.num_free_blocks == 16 and all(bm.ref_count(i) == 0 for i in range(16))


def test_preemption_takes_the_latest_arrival_and_nothing_starves() -> None:
    """A tight pool forces repeated preemptions; every request finishes, and once the oldest
    request is running again it is never the victim."""
    bm = BlockManager(6, 2)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=16, max_model_len=12)
    reqs = [req(f"r{i}", [10 * i + j for j in range(3)], max_tokens=6, arrival=float(i))
            for i in range(4)]
    for r in reqs:
        sched.add_request(r.group)
    oldest = reqs[0]
    victims: list[str] = []
    for _ in range(200):
        if not sched.has_unfinished():
            break
        out = sched.schedule()
        victims += [v.request_id for v in out.preempted]
        running = [r for r in sched.running]
        for v in out.preempted:  # the victim arrived after every request still running
            assert all(v.arrival_time >= r.arrival_time for r in running)
        close(sched, out)
    assert not sched.has_unfinished()
    assert all(r.status == RequestStatus.FINISHED_LENGTH and r.num_output_tokens == 6 for r in reqs)
    assert len(victims) >= 2 and sched.num_preemptions == len(victims)
    assert oldest.request_id not in victims
    assert bm.num_free_blocks == 6 and all(bm.ref_count(i) == 0 for i in range(6))


def test_preempted_request_recomputes_from_its_cached_blocks() -> None:
    bm = BlockManager(4, 2)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=16, max_model_len=8)
    a, b = req("a", [1, 2, 3], arrival=0.0), req("b", [5, 6, 7], arrival=1.0)
    sched.add_request(a.group)
    sched.add_request(b.group)
    for _ in range(2):
        close(sched, sched.schedule())
    out = sched.schedule()  # a needs a third block: b (later arrival) goes
    assert out.preempted == [b]
    close(sched, out)
    sched.finish(a, RequestStatus.FINISHED_LENGTH)
    out = sched.schedule()
    # b's blocks [5, 6] and [7, TOKEN] were cached when it was preempted; a's third block evicted
    # the deepest one (freed first), so b recomputes from position 2.
    assert [(s.request.request_id, s.start, s.num_new_tokens) for s in out.scheduled] == [("b", 2, 3)]
    assert bm.prefix_cache_hits == 2


def test_reset_prefix_cache_drops_free_blocks_only() -> None:
    bm = BlockManager(8, 4)
    a, b = req("a", list(range(10))), req("b", [50 + i for i in range(9)])
    compute(bm, a)
    compute(bm, b)
    bm.free(a)  # a's two full blocks stay cached while free; b still holds its blocks
    assert bm.num_cached_free_blocks == 2
    assert bm.reset_prefix_cache() == 2
    assert bm.num_cached_free_blocks == 0 and bm.num_free_blocks == 8 - 3
    assert bm.find_cached_prefix(req("a2", list(range(10)))).block_ids == []
    # b's blocks are in use: their content stays findable.
    assert len(bm.find_cached_prefix(req("b2", [50 + i for i in range(9)])).block_ids) == 2
