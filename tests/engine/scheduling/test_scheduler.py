"""Scheduler on tiny pools, without a model: each step is opened by `schedule`, and closed by the
scheduler's own `step_launched` and `update_from_output` with TOKEN as every sampled token, as
the engine does. Asserts exact block ids, budgets, chunking, preemption order and that every
block comes back."""

from __future__ import annotations

import random

import pytest

from pie.engine.messages import RequestStatus, SampledToken
from pie.engine.sampling_params import SamplingParams
from pie.engine.scheduling.block_manager import BlockManager
from pie.engine.scheduling.request import Request
from pie.engine.scheduling.scheduler import Scheduler
from pie.engine.scheduling.step import SchedulerOutput, StepOutput

TOKEN = 7


class StepScheduler(Scheduler):
    """The scheduler, remembering the block table of each row of its latest output as the runner
    stages it: a copy taken right after `schedule`, before the step closes (and may free it)."""

    last: tuple[SchedulerOutput, list[list[int]]] | None = None

    def schedule(self) -> SchedulerOutput:
        out = super().schedule()
        self.last = (out, [list(s.request.block_ids) for s in out.scheduled])
        return out

    def tables(self, out: SchedulerOutput) -> list[list[int]]:
        """The tables of the rows of `out`, the latest output, as the runner saw them."""
        assert self.last is not None and self.last[0] is out
        return self.last[1]


def make(num_blocks: int, block_size: int, *, max_num_seqs: int = 8, budget: int = 64,
         max_model_len: int = 256, caching: bool = False) -> tuple[StepScheduler, BlockManager]:
    # Prompts from `req` all share a prefix; caching is off unless a test is about it.
    bm = BlockManager(num_blocks, block_size, enable_caching=caching)
    return StepScheduler(bm, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                         max_model_len=max_model_len), bm


def req(rid: str, num_prompt: int, max_tokens: int = 4, max_model_len: int = 256, streamed: bool = False) -> Request:
    return Request(rid, [100 + i for i in range(num_prompt)], SamplingParams(max_tokens=max_tokens),
                   max_model_len=max_model_len, streamed=streamed)


def add(sched: Scheduler, *requests: Request) -> None:
    for r in requests:
        sched.add_request(r.group)


def close(sched: Scheduler, out: SchedulerOutput) -> None:
    """The engine's end of a step: launched, then every sampling row read back as TOKEN."""
    sched.step_launched(out)
    rows = out.sampling_requests
    sched.update_from_output(StepOutput(rows, [[SampledToken(TOKEN, 0.0, [])] for _ in rows]))


def step(sched: Scheduler) -> SchedulerOutput:
    """One engine step without a model: every sampling request gets TOKEN."""
    out = sched.schedule()
    close(sched, out)
    return out


def summary(sched: StepScheduler, out: SchedulerOutput) -> list[tuple[str, int, int, list[int], bool]]:
    return [(s.request.request_id, s.start, s.num_new_tokens, table, s.sample)
            for s, table in zip(out.scheduled, sched.tables(out))]


def test_prefill_then_decode_exact_blocks() -> None:
    sched, bm = make(8, 4)
    a, b = req("a", 5), req("b", 6)
    add(sched, a)
    add(sched, b)
    out = step(sched)
    assert summary(sched, out) == [("a", 0, 5, [0, 1], True), ("b", 0, 6, [2, 3], True)]
    assert out.num_batched_tokens == 11 and out.preempted == []
    assert a.status == b.status == RequestStatus.RUNNING and a.first_scheduled_time is not None
    assert summary(sched, step(sched)) == [("a", 5, 1, [0, 1], True), ("b", 6, 1, [2, 3], True)]
    assert summary(sched, step(sched)) == [("a", 6, 1, [0, 1], True), ("b", 7, 1, [2, 3], True)]
    # b's 9th token (position 8) crosses into a new block, taken from the head of the free list.
    assert summary(sched, step(sched)) == [("a", 7, 1, [0, 1], True), ("b", 8, 1, [2, 3, 4], True)]
    assert a.status == b.status == RequestStatus.FINISHED_LENGTH
    assert a.output_token_ids == [TOKEN] * 4
    assert not sched.has_unfinished() and bm.num_free_blocks == 8


def test_chunked_prefill_respects_the_token_budget() -> None:
    sched, bm = make(16, 4, budget=8)
    a, b = req("a", 20, max_tokens=2), req("b", 6, max_tokens=2)
    add(sched, a)
    add(sched, b)
    assert summary(sched, step(sched)) == [("a", 0, 8, [0, 1], False)]
    assert b.status == RequestStatus.WAITING and sched.num_waiting == 1
    assert summary(sched, step(sched)) == [("a", 8, 8, [0, 1, 2, 3], False)]
    # a's last chunk leaves room for the first chunk of b's prompt in the same step.
    out = step(sched)
    assert summary(sched, out) == [("a", 16, 4, [0, 1, 2, 3, 4], True), ("b", 0, 4, [5], False)]
    assert out.num_batched_tokens == 8
    # A decode and the rest of b's prompt together.
    assert summary(sched, step(sched)) == [("a", 20, 1, [0, 1, 2, 3, 4, 6], True),
                                    ("b", 4, 2, [5, 7], True)]
    assert a.finished and a.num_output_tokens == 2
    assert summary(sched, step(sched)) == [("b", 6, 1, [5, 7], True)]
    assert not sched.has_unfinished() and bm.num_free_blocks == 16


def test_every_step_within_budget_and_seq_cap() -> None:
    sched, bm = make(64, 4, max_num_seqs=3, budget=10)
    reqs = [req(f"r{i}", 3 + i, max_tokens=3) for i in range(6)]
    for r in reqs:
        add(sched, r)
    steps = 0
    while sched.has_unfinished():
        out = step(sched)
        steps += 1
        assert 0 < out.num_batched_tokens <= 10
        assert out.num_batched_tokens == sum(s.num_new_tokens for s in out.scheduled)
        assert sched.num_running <= 3 and len(out.scheduled) <= 3
        assert steps < 100
    assert all(r.num_output_tokens == 3 and r.status == RequestStatus.FINISHED_LENGTH
               for r in reqs)
    assert bm.num_free_blocks == 64


def test_max_num_seqs_caps_admission() -> None:
    sched, _ = make(32, 4, max_num_seqs=2)
    a, b, c = req("a", 2, max_tokens=2), req("b", 2, max_tokens=3), req("c", 2)
    for r in (a, b, c):
        add(sched, r)
    out = step(sched)
    assert [s.request.request_id for s in out.scheduled] == ["a", "b"]
    assert c.status == RequestStatus.WAITING and sched.num_waiting == 1
    out = step(sched)  # a finishes at the end of this step
    assert [s.request.request_id for s in out.scheduled] == ["a", "b"] and a.finished
    out = step(sched)
    assert [s.request.request_id for s in out.scheduled] == ["b", "c"]


def test_preemption_takes_the_newest_and_recomputes_it() -> None:
    sched, bm = make(4, 2, max_model_len=8)
    a, b = req("a", 3, max_tokens=4), req("b", 3, max_tokens=4)
    add(sched, a)
    add(sched, b)
    assert summary(sched, step(sched)) == [("a", 0, 3, [0, 1], True), ("b", 0, 3, [2, 3], True)]
    assert summary(sched, step(sched)) == [("a", 3, 1, [0, 1], True), ("b", 3, 1, [2, 3], True)]
    # a's 5th token needs a third block; none is free, so b (newest) is preempted.
    out = step(sched)
    assert out.preempted == [b]
    assert summary(sched, out) == [("a", 4, 1, [0, 1, 3], True)]  # b's blocks came back tail first
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert b.num_preemptions == 1 and b.output_token_ids == [TOKEN, TOKEN]
    assert list(sched.waiting) == [b] and sched.running == [a]
    # b needs 3 blocks for its 5 tokens and only one is free: it waits until a finishes.
    assert summary(sched, step(sched)) == [("a", 5, 1, [0, 1, 3], True)]
    assert a.finished and bm.num_free_blocks == 4
    # Recompute prompt + outputs in one prefill, then sample b's third token.
    assert summary(sched, step(sched)) == [("b", 0, 5, [2, 3, 1], True)]
    assert b.status == RequestStatus.RUNNING and b.num_output_tokens == 3
    assert summary(sched, step(sched)) == [("b", 5, 1, [2, 3, 1], True)]
    assert b.finished and b.num_output_tokens == 4 and bm.num_free_blocks == 4


def test_preemption_skips_older_requests_and_goes_to_the_front() -> None:
    sched, bm = make(6, 2, max_model_len=12)
    a, b, c, d = req("a", 3), req("b", 4), req("c", 4), req("d", 2)
    for r in (a, b, c):
        add(sched, r)
    assert summary(sched, step(sched)) == [("a", 0, 3, [0, 1], True), ("b", 0, 4, [2, 3], True),
                                    ("c", 0, 4, [4, 5], True)]
    add(sched, d)
    # a fits; b's 5th token needs a block: c, the newest, goes, and ahead of d in the queue.
    out = step(sched)
    assert out.preempted == [c]
    assert summary(sched, out) == [("a", 3, 1, [0, 1], True), ("b", 4, 1, [2, 3, 5], True)]
    assert list(sched.waiting) == [c, d] and c.num_computed_tokens == 0
    assert c.output_token_ids == [TOKEN]


def test_a_request_can_preempt_itself() -> None:
    sched, _ = make(4, 2, max_model_len=8)
    a, b = req("a", 3), req("b", 4)
    add(sched, a)
    add(sched, b)
    step(sched)  # a: blocks 0, 1; b: blocks 2, 3
    out = step(sched)  # a still fits in 2 blocks; b needs a third and is the newest itself
    assert out.preempted == [b] and summary(sched, out) == [("a", 3, 1, [0, 1], True)]
    assert sched.running == [a] and list(sched.waiting) == [b]


def test_no_admission_in_a_step_that_preempted() -> None:
    sched, bm = make(3, 2, budget=3, max_model_len=6)
    a, b = req("a", 2, max_tokens=3), req("b", 2, max_tokens=3)
    add(sched, a)
    add(sched, b)
    assert summary(sched, step(sched)) == [("a", 0, 2, [0], True), ("b", 0, 1, [1], False)]
    assert summary(sched, step(sched)) == [("a", 2, 1, [0, 2], True), ("b", 1, 1, [1], True)]
    # b preempts itself; a 2-token chunk of it would fit in the freed block, but memory is short,
    # so nothing is admitted until the next step.
    out = step(sched)
    assert out.preempted == [b] and summary(sched, out) == [("a", 3, 1, [0, 2], True)]
    assert list(sched.waiting) == [b]
    while sched.has_unfinished():
        step(sched)
    assert b.num_output_tokens == 3 and bm.num_free_blocks == 3


class TwoProposals:
    """A speculator that proposes TOKEN twice for every decode (the Speculation protocol)."""

    def active(self, num_decodes: int) -> bool:
        return True

    def reserve(self, request: Request, budget: int) -> int:
        request.spec_token_ids = [TOKEN, TOKEN][:budget]
        return len(request.spec_token_ids)

    def record(self, k: int, accepted: int) -> None:
        pass


class RowScheduler(StepScheduler):
    """Remembers every row `schedule` gives in a step, kept or taken back before the step ends."""

    given: list[tuple[str, int]]

    def schedule(self) -> SchedulerOutput:
        self.given = []
        return super().schedule()

    def _schedule(self, out, request, num_new, num_spec=0):
        self.given.append((request.request_id, num_spec))
        return super()._schedule(out, request, num_new, num_spec)


def test_a_victim_given_a_row_earlier_in_the_step_gives_it_back_with_its_proposals() -> None:
    """A less urgent stream decodes while a more urgent prompt, chunked by the stall bound, fills
    the pool. When a chunk needs a block and none is free, the stream, already given a decode row
    with two proposals this step, is preempted: its row, tokens and proposals leave the step's
    counts, and both requests end with every block back."""
    sched = RowScheduler(BlockManager(8, 4), max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64,
                         stall_factor=2.0, speculator=TwoProposals())
    stream = Request("stream", [100, 101], SamplingParams(max_tokens=30), max_model_len=64, arrival_time=0.0,
                     priority=5, streamed=True)
    add(sched, stream)
    step(sched)
    for _ in range(10):  # decode steps 10 ms, a prompt token 1 ms on top: chunks of 10 tokens
        sched.stall.observe(1, 0, 0.010)
        sched.stall.observe(1, 16, 0.010 + 16e-3)
    urgent = preq("urgent", 0, 1.0, num_prompt=30, max_tokens=2)
    add(sched, urgent)
    taken_back = None
    for _ in range(10):
        out = sched.schedule()
        assert out.num_spec_tokens == sum(s.num_spec for s in out.scheduled)
        assert out.num_batched_tokens == sum(s.num_new_tokens for s in out.scheduled)
        if stream in out.preempted:
            taken_back = (out, sched.given)
        rows = out.sampling_requests
        sched.step_launched(out)
        sched.update_from_output(StepOutput(rows, [[SampledToken(TOKEN, 0.0, [])] for _ in rows],
                                            [s.num_spec for s in out.scheduled if s.sample]))
        if taken_back:
            break
    assert taken_back is not None, "the stream was never preempted"
    out, given = taken_back
    assert given[0] == ("stream", 2) and [s.request.request_id for s in out.scheduled] == ["urgent"]
    assert out.scheduled[0].start < 30 and out.num_spec_tokens == 0  # the chunk it made room for
    assert stream.status == RequestStatus.PREEMPTED and stream.spec_token_ids == [] and stream.num_computed_tokens == 0
    while sched.has_unfinished():
        step(sched)
    assert urgent.finished and stream.finished and sched.block_manager.num_free_blocks == 8


def test_abort_and_finish_give_every_block_back() -> None:
    sched, bm = make(8, 4, max_num_seqs=2)
    a, b, c = req("a", 5), req("b", 9), req("c", 3)
    for r in (a, b, c):
        add(sched, r)
    out = sched.schedule()
    assert bm.num_free_blocks == 3
    # Aborted while its step runs: blocks back at once, and the step's closing skips it.
    assert sched.abort("a") and a.status == RequestStatus.FINISHED_ABORTED and a.block_ids == []
    close(sched, out)
    assert a.num_computed_tokens == 0 and a.output_token_ids == [] and sched.running == [b]
    assert sched.abort("c") and c.finished and sched.num_waiting == 0  # from the waiting queue
    assert not sched.abort("c") and not sched.abort("nope")
    assert sched.finish(b, RequestStatus.FINISHED_STOPPED)  # b's group had one sample: it ended
    assert b.status == RequestStatus.FINISHED_STOPPED and "b" not in sched.groups
    assert not sched.finish(b, RequestStatus.FINISHED_ABORTED)  # a second finish changes nothing
    assert b.status == RequestStatus.FINISHED_STOPPED
    assert not sched.has_unfinished() and bm.num_free_blocks == 8
    assert sched.schedule().is_empty


def test_duplicate_ids_are_refused() -> None:
    sched, _ = make(4, 4, max_model_len=16)
    add(sched, req("a", 10, max_tokens=6))
    with pytest.raises(ValueError, match="already in use"):
        add(sched, req("a", 2))
    assert sched.num_waiting == 1


@pytest.mark.parametrize("caching", [False, True])
def test_random_workload_keeps_every_tokens_kv_in_place(caching: bool) -> None:
    """Fake KV cache: each scheduled token writes (request id, position, token id) at its slot;
    every sampling step reads back the whole sequence through its block table. Any block handed
    to two live requests, or a wrong table, shows up as a mismatch."""
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    block_size, num_blocks = rng.choice([(2, 12), (4, 8), (4, 20)])
    sched, bm = make(num_blocks, block_size, max_num_seqs=rng.randint(1, 5),
                     budget=rng.randint(3, 16), max_model_len=num_blocks * block_size,
                     caching=caching)
    cache: dict[int, tuple] = {}

    def key(r: Request, pos: int) -> tuple:  # with caching, a slot may be shared by equal prefixes
        return (pos, tuple(r.all_token_ids[:pos + 1])) if caching else (r.request_id, pos, r.all_token_ids[pos])

    pending = [req(f"r{i}", rng.randint(1, 12), max_tokens=rng.randint(1, 8)) for i in range(30)]
    live: list[Request] = []
    for _ in range(2000):
        if not pending and not sched.has_unfinished():
            break
        if pending and rng.random() < 0.5:
            r = pending.pop()
            add(sched, r)
            live.append(r)
        if live and rng.random() < 0.03:
            sched.abort(rng.choice(live).request_id)
        out = sched.schedule()
        assert out.num_batched_tokens <= sched.max_num_batched_tokens, seed
        assert sched.num_running <= sched.max_num_seqs, seed
        for s, table in zip(out.scheduled, sched.tables(out) if out.scheduled else []):
            r, end = s.request, s.start + s.num_new_tokens
            assert len(table) == bm.blocks_needed(end), seed
            for pos in range(s.start, end):
                slot = table[pos // block_size] * block_size + pos % block_size
                cache[slot] = key(r, pos)
            if s.sample:
                for pos in range(end):
                    slot = table[pos // block_size] * block_size + pos % block_size
                    assert cache[slot] == key(r, pos), seed
        close(sched, out)
    assert not sched.has_unfinished() and not sched.groups, seed
    assert bm.num_free_blocks == num_blocks, seed
    for r in live:
        assert r.finished, seed
        if r.status != RequestStatus.FINISHED_ABORTED:
            assert r.num_output_tokens == r.sampling.max_tokens, seed



# ---- priority ---------------------------------------------------------------------------------------
def preq(rid: str, priority: int, arrival: float, num_prompt: int = 2, max_tokens: int = 3) -> Request:
    return Request(rid, [100 + i for i in range(num_prompt)], SamplingParams(max_tokens=max_tokens),
                   max_model_len=256, arrival_time=arrival, priority=priority)


def test_admission_by_priority_then_arrival() -> None:
    sched, _ = make(64, 4, max_num_seqs=2)
    reqs = [preq(f"p{i}", 0, float(i)) for i in range(6)] + [preq("urgent", -1, 10.0), preq("late", 0, 11.0),
                                                               preq("low", 5, 0.5)]
    add(sched, *reqs)
    assert [r.request_id for r in sched.waiting] == ["urgent", "p0", "p1", "p2", "p3", "p4", "p5", "late", "low"]
    assert sched.num_waiting_by_priority() == {-1: 1, 0: 7, 5: 1}
    order = []
    while sched.has_unfinished():
        out = step(sched)
        order += [s.request.request_id for s in out.scheduled if s.start == 0]
    assert order == ["urgent", "p0", "p1", "p2", "p3", "p4", "p5", "late", "low"]


def test_the_least_urgent_is_preempted_first() -> None:
    """Blocks run short: the running request of the least urgent priority goes, even when it
    arrived first; within a priority the latest arrival goes."""
    sched, bm = make(4, 2, max_model_len=8)
    low, high = preq("low", 3, 0.0, num_prompt=3, max_tokens=4), preq("high", 0, 1.0, num_prompt=3, max_tokens=4)
    add(sched, low, high)
    step(sched)
    step(sched)
    # high was admitted first (blocks 0, 1), low after it (2, 3); high's 5th token needs a third
    # block and none is free: low, less urgent although it arrived first, goes
    out = step(sched)
    assert out.preempted == [low] and low.status == RequestStatus.PREEMPTED
    assert summary(sched, out) == [("high", 4, 1, [0, 1, 3], True)]
    while sched.has_unfinished():
        step(sched)
    assert low.num_output_tokens == high.num_output_tokens == 4 and bm.num_free_blocks == 4


# ---- bounded stalls ----------------------------------------------------------------------------------
def test_stall_bound_learns_from_step_times() -> None:
    from pie.engine.scheduling.stall import StallBound

    bound = StallBound(2.0, min_tokens=16)
    assert bound.prompt_tokens(8) is None  # nothing measured yet
    for _ in range(20):
        bound.observe(8, 0, 0.010)  # decode-only steps: 10 ms
    assert bound.prompt_tokens(8) is None  # the cost of a prompt token is not known yet
    assert bound.unbounded_steps == 2  # steps beside decodes that no bound limited (a metric)
    for _ in range(20):
        bound.observe(8, 1000, 0.010 + 1000 * 20e-6)  # 20 us per prompt token on top
    # (2 - 1) x 10 ms / 20 us = 500 tokens keep a step within twice a decode step
    assert bound.prompt_tokens(8) == pytest.approx(500, abs=2)
    assert bound.prompt_tokens(0) is None  # no decodes to stall: no bound
    bound.observe(8, 4, 5.0)  # too few prompt tokens to tell their cost: ignored
    assert bound.prompt_tokens(8) == pytest.approx(500, abs=2)
    for _ in range(50):
        bound.observe(8, 0, 0.0001)  # decodes grow fast: the bound falls, not below the floor
    assert bound.prompt_tokens(8) == 16
    assert StallBound(0.0, min_tokens=16).prompt_tokens(8) is None  # off
    with pytest.raises(ValueError):
        StallBound(1.0, min_tokens=16)


def test_stall_bound_shrugs_off_one_stalled_step() -> None:
    """One step stalled by something else (a kernel compiled on first use, the host) moves the
    bound by little; a lasting change of cost still comes through within a few steps."""
    from pie.engine.scheduling.stall import StallBound

    bound = StallBound(2.0, min_tokens=16)
    for _ in range(20):
        bound.observe(8, 0, 0.010)
    for n in (500, 1000, 2000) * 10:
        bound.observe(8, n, 0.010 + 0.002 + n * 20e-6)  # 2 ms fixed, 20 us a token
    before = bound.prompt_tokens(8)
    assert before == pytest.approx((0.010 - 0.002) / 20e-6, rel=0.05)
    bound.observe(8, 0, 1.0)  # a decode-only step stalled for a second
    assert bound.decode_s == pytest.approx(0.8 * 0.010 + 0.2 * 0.020)  # counted as twice the estimate
    bound.observe(8, 0, 0.010)
    bound.observe(8, 1000, 2.0)  # a prompt step stalled for two seconds
    after = bound.prompt_tokens(8)
    assert after is not None and after <= 1.6 * before  # unclipped: the floor t_fixed / c let 8k+ through
    for _ in range(40):
        bound.observe(8, 0, 0.010)
        bound.observe(8, 1000, 0.010 + 0.002 + 1000 * 20e-6)
    assert bound.prompt_tokens(8) == pytest.approx(before, rel=0.1)  # forgotten
    for _ in range(15):
        bound.observe(8, 0, 0.040)  # the decodes' cost quadruples for good: followed
    assert bound.decode_s == pytest.approx(0.040, rel=0.1)


def test_stall_bound_fits_a_fixed_cost_and_does_not_starve_prompts() -> None:
    """Steps that carry prompt tokens cost a fixed part (eager, not a graph) plus a part per token.
    The bound is fitted to both; fed back its own chunks, it settles where a step stays within the
    factor, and where the fixed part alone exceeds that, at t_fixed / c_prompt tokens, not at the
    floor (the per-token-only model collapsed there: prefill starved)."""
    import random

    from pie.engine.scheduling.stall import StallBound

    rng = random.Random(0)
    decode, fixed, per_token = 0.010, 0.003, 20e-6
    bound = StallBound(2.0, min_tokens=16)
    for _ in range(10):
        bound.observe(8, 0, decode)
    for n in [100, 1000, 300, 2000, 600, 150, 1200] * 4:
        bound.observe(8, n, decode + fixed + per_token * n * rng.uniform(0.97, 1.03))
    assert bound.fixed_s == pytest.approx(fixed, rel=0.1)
    assert bound.per_prompt_token_s == pytest.approx(per_token, rel=0.1)
    assert bound.prompt_tokens(8) == pytest.approx((decode - fixed) / per_token, rel=0.1)  # 350

    def settle(decode_s: float, start: StallBound) -> int:
        """Steps carry what the bound allows of a backlog (or a prompt's last piece): where it goes."""
        for _ in range(300):
            start.observe(8, 0, decode_s)
            n = min(start.prompt_tokens(8) or 8192, rng.choice([8192, 8192, 8192, rng.randrange(16, 400)]))
            start.observe(8, n, decode_s + fixed + per_token * n)
        return start.prompt_tokens(8) or 0

    assert settle(decode, bound) == pytest.approx(350, rel=0.15)
    # Few decodes: a decode step (2 ms) is cheaper than the fixed part alone (3 ms).
    starving = StallBound(2.0, min_tokens=16)
    assert settle(0.002, starving) == pytest.approx(fixed / per_token, rel=0.15)  # 150, not 16


def test_stall_bound_uses_its_prior_until_a_decode_step_is_measured() -> None:
    """A burst: every step carries prompt tokens until the queue is prefilled, so no decode-only
    step is ever timed. The decode graphs' timings (the prior, by bucket) stand in for t_decode, as
    the base prompt steps are measured over and in the bound, until a decode-only step is seen."""
    from pie.engine.scheduling.stall import StallBound

    bound = StallBound(2.0, min_tokens=16)
    bound.prior = {8: 0.004, 16: 0.005, 32: 0.006}
    bound.observe(0, 4000, 4000 * 20e-6)  # the first step: prompts only, 20 us a token
    assert bound.decode_s is None and bound.per_prompt_token_s == pytest.approx(20e-6)
    assert bound.prompt_tokens(0) is None  # nothing to stall
    assert bound.prompt_tokens(12) == pytest.approx(0.005 / 20e-6, abs=1)  # the 16-row bucket's 5 ms: 250
    assert bound.prompt_tokens(100) == pytest.approx(0.006 / 20e-6, abs=1)  # past the largest: its time
    for _ in range(20):  # prompt steps beside 12 decodes, measured over the prior's 5 ms
        bound.observe(12, 250, 0.005 + 250 * 20e-6)
    # the line through both sizes: 20 us a token and no fixed part (with 0 as the base, the decodes'
    # 5 ms would have read as a fixed cost of prompt steps)
    assert bound.per_prompt_token_s == pytest.approx(20e-6, rel=0.05)
    assert bound.fixed_s == pytest.approx(0.0, abs=2e-4)
    bound.observe(12, 0, 0.010)  # a decode-only step: measured beats the prior
    assert bound.prompt_tokens(12) == pytest.approx(0.010 / bound.per_prompt_token_s, abs=1)
    assert StallBound(2.0, min_tokens=16).prompt_tokens(12) is None  # no prior, nothing measured


def test_stall_bound_models_a_decode_step_by_its_context() -> None:
    """On CUDA a decode step is modelled as its bucket's graph over one-token contexts plus a cost
    per token of context, both timed at start: a full batch at long contexts is allowed the prompt
    tokens its real decode step covers, and measured decode-only steps correct the model by a
    ratio that carries over to other batch sizes and contexts."""
    from pie.engine.scheduling.stall import StallBound

    bound = StallBound(2.0, min_tokens=16)
    bound.prior = {16: 0.0047, 256: 0.0075}
    bound.kv_token_s = 21e-9  # 8B shape on the H200: ~21 ns a token of context (int8 pages)
    bound.observe(0, 8000, 8000 * 27e-6)  # a whole budget, prompts only: 27 us a token
    short, long = bound.prompt_tokens(256, 256), bound.prompt_tokens(256, 256 * 1500)
    assert short == pytest.approx(0.0075 / 27e-6, abs=2)  # 7.5 ms of decode: 277 tokens
    assert long == pytest.approx((0.0075 + 256 * 1500 * 21e-9) / 27e-6, abs=2)  # 15.6 ms: 576 tokens
    assert bound.decode_seconds(20, 20 * 1000) == pytest.approx(0.0075 + 20_000 * 21e-9)  # past 16: the 256 bucket
    bound.observe(256, 0, 1.5 * (0.0075 + 256 * 1000 * 21e-9), 256 * 1000)  # measured: 1.5x the model
    assert bound.decode_ratio == pytest.approx(1.5)
    assert bound.decode_seconds(16, 16 * 3000) == pytest.approx(1.5 * (0.0047 + 16 * 3000 * 21e-9))
    bound.observe(256, 0, 10.0, 256 * 1000)  # a stalled decode step counts as twice the estimate
    assert bound.decode_ratio == pytest.approx(0.8 * 1.5 + 0.2 * 3.0)


def test_stall_bound_holds_through_a_burst() -> None:
    """The steps of a cold burst on the H200 (8B shape, 2026-12-02): one whole budget, then ~150
    prompt tokens a step beside the decodes, some 10% slower or faster, and one stalled 78 ms. The
    slope is not read off the noise of steps of one size: the bound stays near where it was
    (fitted to exponentially weighted moments it let 2,800-token chunks through after the stall)."""
    import random

    from pie.engine.scheduling.stall import StallBound

    rng = random.Random(1)
    bound = StallBound(2.0, min_tokens=16)
    bound.prior = {16: 0.0047, 32: 0.0048}
    bound.kv_token_s = 21e-9
    bound.observe(3, 8189, 0.231, 7091)
    sizes = []
    for i in range(120):
        n = bound.prompt_tokens(20, 40_000)
        assert n is not None
        sizes.append(n)
        seconds = 0.0047 + 40_000 * 21e-9 + 0.003 + 27e-6 * n * rng.uniform(0.9, 1.1) + rng.uniform(0, 0.002)
        bound.observe(20, n, 0.078 if i == 60 else seconds, 40_000)
    assert bound.per_prompt_token_s == pytest.approx(27e-6, rel=0.25)
    assert max(sizes[10:]) < 400, sizes


def test_prompt_tokens_beside_decodes_follow_the_stall_bound() -> None:
    sched = StepScheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256,
                          stall_factor=2.0)
    a, b = req("a", 2, max_tokens=20, streamed=True), req("b", 2, max_tokens=20, streamed=True)
    add(sched, a, b)
    step(sched)
    for _ in range(10):  # teach it: decode steps 10 ms, a prompt token 1 ms on top
        sched.stall.observe(2, 0, 0.010)
        sched.stall.observe(2, 16, 0.010 + 16e-3)
    long = req("long", 40, max_tokens=2)
    add(sched, long)
    out = step(sched)  # (2 - 1) x 10 ms / 1 ms = 10 tokens, floored at the block size (4)
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 1), ("b", 1), ("long", 10)]
    out = step(sched)
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 1), ("b", 1), ("long", 10)]
    for r in (a, b):
        sched.abort(r.request_id)
    out = step(sched)  # no decode left to stall: the whole budget
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("long", 20)]


@pytest.mark.parametrize("streamed", [(False, False), (True, False), (False, True)])
def test_the_stall_bound_protects_streamed_decodes_only(streamed: tuple[bool, bool]) -> None:
    """Decodes read whole (unary calls, offline work) are stalled by nobody who watches: beside
    them a prompt takes the whole budget. One streamed decode in the step brings the bound back."""
    sched = StepScheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256,
                          stall_factor=2.0)
    add(sched, req("a", 2, max_tokens=20, streamed=streamed[0]), req("b", 2, max_tokens=20, streamed=streamed[1]))
    step(sched)
    for _ in range(10):  # taught as above: the bound would be 10 tokens
        sched.stall.observe(2, 0, 0.010)
        sched.stall.observe(2, 16, 0.010 + 16e-3)
    add(sched, req("long", 80, max_tokens=2))
    out = step(sched)
    chunk = {s.request.request_id: s.num_new_tokens for s in out.scheduled}
    assert chunk == {"a": 1, "b": 1, "long": 10 if any(streamed) else 62}
    assert sched.stall.prompt_tokens(2) == 10  # the bound is learnt either way, from every step


def test_stall_bound_measures_a_step_against_the_batch_it_heads_to() -> None:
    """The bound's decode step is that of the batch being built: the running decodes and prefills
    and the waiting requests that rows and free blocks admit next, not only the rows decoding now."""

    def taught(num_blocks: int, max_num_seqs: int = 8) -> tuple[StepScheduler, list[Request]]:
        sched = StepScheduler(BlockManager(num_blocks, 4), max_num_seqs=max_num_seqs, max_num_batched_tokens=64,
                              max_model_len=256, stall_factor=2.0)
        sched.stall.prior = {2: 0.010, 4: 0.020, 8: 0.040}  # decode steps by rows (kv_token_s 0)
        running = [req("a", 2, max_tokens=20, streamed=True), req("b", 2, max_tokens=20, streamed=True)]
        add(sched, *running)
        step(sched)
        for _ in range(10):  # measured decode steps as the prior says; a prompt token 1 ms
            sched.stall.observe(2, 0, 0.010)
            sched.stall.observe(2, 16, 0.010 + 16e-3)
        return sched, running

    def chunk(sched: StepScheduler) -> int:
        out = step(sched)
        return sum(s.num_new_tokens for s in out.scheduled if s.request.request_id == "long")

    # Two waiting requests fit: 4 rows heading, a 20 ms decode step, (2 - 1) x 20 ms / 1 ms = 20 tokens.
    sched, _ = taught(64)
    add(sched, req("long", 40, max_tokens=2), req("next", 8, max_tokens=2))
    assert chunk(sched) == 20
    assert chunk(sched) == 20  # long now a running prefill: still 4 rows heading

    # Free blocks admit neither (long needs 10 of 9): the 2 decoding rows, 10 ms, 10 tokens.
    sched, _ = taught(11)
    add(sched, req("long", 40, max_tokens=2), req("next", 8, max_tokens=2))
    assert chunk(sched) == 10

    # Rows admit one (max_num_seqs 3): 3 rows heading, the 4-row bucket, 20 tokens.
    sched, _ = taught(64, max_num_seqs=3)
    add(sched, req("long", 40, max_tokens=2), req("next", 8, max_tokens=2))
    assert chunk(sched) == 20


# ---- the stall budget --------------------------------------------------------------------------------
def budgeted(share: float) -> tuple[StepScheduler, list[Request]]:
    """Two streams decoding (20 tokens each at most) beside a stall bound taught to allow 10 prompt
    tokens a step, and a budget of 64 tokens a step."""
    sched = StepScheduler(BlockManager(128, 4), max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256,
                          stall_factor=2.0, stall_share=share)
    streams = [req("a", 2, max_tokens=20, streamed=True), req("b", 2, max_tokens=20, streamed=True)]
    add(sched, *streams)
    step(sched)
    for _ in range(10):  # decode steps 10 ms, a prompt token 1 ms on top: 10 tokens beside them
        sched.stall.observe(2, 0, 0.010)
        sched.stall.observe(2, 16, 0.010 + 16e-3)
    return sched, streams


def prompt_chunks(out: SchedulerOutput) -> dict[str, int]:
    return {s.request.request_id: s.num_new_tokens for s in out.scheduled if s.request.request_id not in ("a", "b", "u")}


def test_the_stall_budget_waits_for_a_finished_stream() -> None:
    """With no stream finished there is no estimate of the gaps to come, and so no stall."""
    sched, streams = budgeted(0.25)
    add(sched, req("long", 100, max_tokens=2))
    assert prompt_chunks(step(sched)) == {"long": 10}
    assert sched.stall_budget.stall_steps == 0 and [r.num_stalls for r in streams] == [0, 0]


def test_the_stall_budget_lets_a_backlog_through_within_its_share() -> None:
    """Once a stream has finished, a step with more prompt tokens waiting than a whole budget takes
    the whole budget, while the streams' stalls, this one's included, stay within the share of
    their gaps: made so far plus expected (each min(tokens left, the mean finished stream))."""
    sched, streams = budgeted(0.05)
    sched.stall_budget.finished(20)  # a stream that made 20 tokens: the mean
    # a and b: 1 token each so far, 19 left: 40 gaps; 0.05 x 40 = 2 stalled gaps, one step of two.
    add(sched, req("long", 100, max_tokens=2))
    assert prompt_chunks(step(sched)) == {"long": 62}  # the whole budget, beside the two decodes
    assert sched.stall_budget.stall_steps == 1 and [r.num_stalls for r in streams] == [1, 1]
    add(sched, req("more", 100, max_tokens=2))
    assert prompt_chunks(step(sched)) == {"long": 10}  # the budget is spent: the bound again
    assert [r.num_stalls for r in streams] == [1, 1]


def test_the_stall_budget_needs_a_backlog() -> None:
    """A prompt that fits a whole step is not a backlog: a bounded step or two work it off, and a
    stall would buy nothing but its own time to first token (Poisson arrivals)."""
    sched, streams = budgeted(0.25)
    sched.stall_budget.finished(20)
    add(sched, req("short", 60, max_tokens=2))
    assert prompt_chunks(step(sched)) == {"short": 10}
    assert sched.stall_budget.stall_steps == 0


def test_the_stall_budget_counts_only_streams() -> None:
    """Unary decodes neither bound a step nor count as gaps: with streams gone the budget has
    nothing to spend, and steps beside unary decodes take the whole budget without a stall."""
    sched, streams = budgeted(0.25)
    sched.stall_budget.finished(20)
    for r in streams:
        sched.abort(r.request_id)
    unary = req("u", 2, max_tokens=20)
    add(sched, unary)
    step(sched)
    add(sched, req("long", 100, max_tokens=2))
    assert prompt_chunks(step(sched)) == {"long": 63}
    assert sched.stall_budget.stall_steps == 0 and unary.num_stalls == 0


def test_the_stall_budget_fits_its_share_of_the_gaps() -> None:
    """The share of every stream's gaps, made and expected (tokens left, at most the mean of the
    last HISTORY finished streams), bounds the stalls, those made and this step's."""
    from pie.engine.scheduling.stall import StallBudget

    budget = StallBudget(0.005)
    streams = [req(f"s{i}", 8, max_tokens=500, streamed=True) for i in range(4)]
    backlog = [req("long", 100)]  # more than a whole step (64) waits
    assert budget.mean_output is None and not budget.lifts(1, [], streams, backlog, 64)  # nothing learnt yet
    for n in range(1, StallBudget.HISTORY + 101):
        budget.finished(n)
    assert budget.mean_output == 100 + (StallBudget.HISTORY + 1) / 2  # the last HISTORY: 101..356
    # 4 streams x 228.5 expected gaps = 914; 0.005 x 914 = 4.57 stalled gaps.
    assert budget.lifts(4, [], streams, backlog, 64) and not budget.lifts(5, [], streams, backlog, 64)
    streams[0].num_stalls = 3
    assert budget.lifts(1, [], streams, backlog, 64) and not budget.lifts(2, [], streams, backlog, 64)
    assert not budget.lifts(1, [], streams, [req("short", 60)], 64)  # a step's worth waiting: no backlog
    assert budget.lifts(1, [(backlog[0], 100)], streams, [], 64)  # a running prefill's tokens count too
    streams[1].sampling.max_tokens = 10  # 10 left, not the mean: 3 x 228.5 + 10 = 695.5, 3.48 stalled gaps
    assert not budget.lifts(1, [], streams, backlog, 64)
    assert not StallBudget(0.0).lifts(1, [], streams, backlog, 64)
    with pytest.raises(ValueError, match="stall share"):
        StallBudget(1.0)


def test_finished_streams_teach_the_stall_budget() -> None:
    sched, streams = budgeted(0.25)
    for _ in range(25):
        step(sched)
    assert all(r.finished for r in streams)
    assert sched.stall_budget.mean_output == 20
