"""Checks of the engine's bookkeeping invariants, run by tests after every step (EngineCore.step's
docstring states the async-scheduling ones)."""

from __future__ import annotations

from collections import Counter

from pie.engine.core.engine_core import EngineCore
from pie.engine.scheduling import block_manager


def assert_engine_invariants(engine: EngineCore) -> None:
    sched, bm = engine.scheduler, engine.block_manager
    pending = engine._pending
    pending_rows = {id(r) for r in pending.requests} if pending is not None else set()
    unfinished = [r for g in sched.groups.values() for r in g.samples if not r.finished]
    # Every engine request with an unfinished sample is in the table, and only those.
    assert all(any(not r.finished for r in g.samples) for g in sched.groups.values())
    assert all(g.num_unfinished == sum(not r.finished for r in g.samples) for g in sched.groups.values())
    # Placeholders: at most one, only in a row of the one pending step; host ids are all real.
    for req in unfinished:
        n = req.num_output_placeholders
        assert 0 <= n <= 1, f"{req} holds {n} placeholders"
        assert all(t >= 0 for t in req.output_token_ids), f"{req}: a negative id among its outputs"
        if n:
            assert id(req) in pending_rows, f"{req} holds a placeholder but is not in the pending step"
    # Every unfinished request is waiting or running, once; finished ones hold no blocks.
    running, waiting = list(sched.running), list(sched.waiting)
    assert len(set(map(id, running + waiting))) == len(running) + len(waiting) == len(unfinished)
    # Blocks: a block's reference count is the number of block tables holding it; the free queue
    # holds exactly the blocks nobody references; running requests' tables cover their K/V.
    held = Counter(b for req in unfinished for b in req.block_ids)
    if bm.lower is not None:  # blocks of read-backs in flight from the host or disk tier
        held.update(bm.lower.held_blocks())
    for block_id in range(bm.num_total_blocks):
        assert bm.ref_count(block_id) == held[block_id], f"block {block_id}: ref count {bm.ref_count(block_id)}, " \
                                                         f"held by {held[block_id]} tables"
        assert (block_id in bm._free) == (held[block_id] == 0), f"block {block_id} free-queue state is wrong"
    for req in running:
        assert len(req.block_ids) >= bm.blocks_needed(req.num_computed_tokens)
        # No block past what its tokens (and the proposals in flight) need: rejected speculative
        # proposals' blocks went back (engine/spec_decode/speculator.py).
        assert len(req.block_ids) <= bm.blocks_needed(req.num_tokens + len(req.spec_token_ids)), \
            f"{req} holds {len(req.block_ids)} blocks for {req.num_tokens} tokens"
        assert req.num_computed_tokens <= req.num_tokens, f"{req}: more K/V computed than tokens"
        # Prefix-cache hashes: only of full blocks of computed tokens, each chained over the ids the
        # request really has there (a rejected proposal's id would break the chain).
        assert len(req.block_hashes) <= req.num_computed_tokens // bm.block_size
        parent = None
        for i, h in enumerate(req.block_hashes):
            parent = block_manager.hash_block(parent, tuple(req.token_slice(i * bm.block_size,
                                                                            (i + 1) * bm.block_size)))
            assert h == parent, f"{req}: the hash of block {i} is not that of its tokens"
    for req in unfinished:  # proposals exist only for the step in flight
        assert not req.spec_token_ids or id(req) in pending_rows, f"{req} holds proposals outside a pending step"
    for req in waiting:  # preempted or never admitted: nothing held
        assert not req.block_ids and not req.block_hashes, f"{req} waits holding blocks"
