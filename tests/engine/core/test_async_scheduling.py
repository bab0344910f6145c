"""Async scheduling (step N queued before step N-1's ids are read back) against the synchronous
engine: the same tokens, texts and finish reasons in every case where they must agree, and every
KV block back at the end. On the CPU both run the same code; only the order of host work differs."""

from __future__ import annotations

import random

import pytest

from pie.engine.config import EngineConfig
from pie.engine.core.engine_core import EngineCore
from pie.engine.messages import RequestStatus
from pie.engine.sampling_params import SamplingParams
from tests.engine.invariants import assert_engine_invariants
from tests.helpers import make_hf_model_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_hf_model_dir(tmp_path_factory.mktemp("async"), "llama", weight_scale=4.0)


def _engine(model_dir, async_scheduling: bool, **kw) -> EngineCore:
    cfg = dict(model=str(model_dir), device="cpu", kv_cache_dtype="fp32", num_kv_blocks=64, max_num_seqs=8,
               max_num_batched_tokens=64, async_scheduling=async_scheduling)
    return EngineCore(EngineConfig(**{**cfg, **kw}))


def _run(engine: EngineCore, requests: list[tuple[str, list[int], SamplingParams]],
         abort_after: dict[str, int] | None = None) -> dict[tuple[str, int], dict]:
    """Runs to completion; per (request id, sample index): token ids, text, status, stop reason."""
    for rid, prompt, sp in requests:
        engine.add_request(rid, prompt, sp)
    res: dict[tuple[str, int], dict] = {}
    steps = 0
    pending_seen = False
    while engine.has_unfinished():
        for o in engine.step():
            r = res.setdefault((o.request_id, o.index), dict(ids=[], text="", status=None, reason=None))
            r["ids"] += o.new_token_ids
            r["text"] += o.new_text
            if o.finished:
                r["status"], r["reason"] = o.status, o.stop_reason
            assert all(t >= 0 for t in o.new_token_ids)
        steps += 1
        assert_engine_invariants(engine)
        pending_seen = pending_seen or engine._pending is not None
        for rid, at in (abort_after or {}).items():
            if steps == at:
                engine.abort(rid)
                assert_engine_invariants(engine)
        assert steps < 10_000
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_total_blocks, "KV blocks leaked"
    assert engine._pending is None
    assert pending_seen == engine._async  # async mode really ran ahead of the read-back
    return res


def _prompts(n: int, rng: random.Random) -> list[list[int]]:
    return [[rng.randrange(3, 500) for _ in range(rng.randint(3, 40))] for _ in range(n)]


def _same(model_dir, requests, **kw):
    sync = _run(_engine(model_dir, False, **kw), requests)
    asyn = _run(_engine(model_dir, True, **kw), requests)
    assert asyn == sync
    return sync


def test_greedy_lengths_and_stop_tokens_agree(rng, model_dir):
    prompts = _prompts(6, rng)
    # A first run finds tokens the model does generate; they become stop tokens / EOS-like stops.
    first = _run(_engine(model_dir, False), [(f"p{i}", p, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
                                             for i, p in enumerate(prompts)])
    reqs = []
    for i, p in enumerate(prompts):
        ids = first[(f"p{i}", 0)]["ids"]
        stop = [ids[rng.randrange(len(ids))]] if i % 2 else []
        reqs.append((f"r{i}", p, SamplingParams(max_tokens=rng.randint(1, 20), temperature=0, ignore_eos=True,
                                                stop_token_ids=stop)))
    res = _same(model_dir, reqs)
    assert {r["status"] for r in res.values()} <= {RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_STOPPED}


def test_stop_strings_and_context_limit_agree(rng, model_dir):
    prompts = _prompts(4, rng)
    reqs = [(f"s{i}", p, SamplingParams(max_tokens=min(30, 64 - len(p)), temperature=0, ignore_eos=True, stop=["e", " t"]))
            for i, p in enumerate(prompts)]
    # max_model_len reached exactly by prompt + max_tokens
    reqs.append(("edge", prompts[0][:10], SamplingParams(max_tokens=54, temperature=0, ignore_eos=True)))
    _same(model_dir, reqs, max_model_len=64)


def test_seeded_sampling_with_penalties_and_logprobs_agree(rng, model_dir):
    sp = [SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, seed=rng.randrange(2**31), logprobs=3),
          SamplingParams(max_tokens=16, temperature=1.1, repetition_penalty=1.3, frequency_penalty=0.5,
                         seed=rng.randrange(2**31)),
          SamplingParams(max_tokens=12, temperature=0.7, top_k=20, n=3, seed=rng.randrange(2**31))]
    _same(model_dir, [(f"x{i}", p, s) for i, (p, s) in enumerate(zip(_prompts(3, rng), sp))])


def test_preemption_agrees(rng, model_dir):
    """A pool too small for everyone: requests are preempted and recomputed, in both modes alike."""
    reqs = [(f"q{i}", p, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
            for i, p in enumerate(_prompts(8, rng))]
    sync_engine = _engine(model_dir, False, num_kv_blocks=24, block_size=4)
    sync = _run(sync_engine, reqs)
    assert sync_engine.stats().num_preemptions > 0
    async_engine = _engine(model_dir, True, num_kv_blocks=24, block_size=4)
    assert _run(async_engine, reqs) == sync
    assert async_engine.stats().num_preemptions > 0


def test_abort_while_a_step_is_pending(rng, model_dir):
    """An abort between launch and read-back: nothing more comes for it, its blocks come back,
    and the others are untouched."""
    prompts = _prompts(4, rng)
    reqs = [(f"a{i}", p, SamplingParams(max_tokens=25, temperature=0, ignore_eos=True)) for i, p in enumerate(prompts)]
    sync = _run(_engine(model_dir, False), reqs)
    engine = _engine(model_dir, True)
    res = _run(engine, reqs, abort_after={"a1": 6})
    assert res.get(("a1", 0), {}).get("status") is None  # no finish output after an abort
    assert len(res.get(("a1", 0), {"ids": []})["ids"]) < 25
    for k in (("a0", 0), ("a2", 0), ("a3", 0)):
        assert res[k] == sync[k]


@pytest.mark.parametrize("where", ["launch", "read_back"])
def test_a_fault_fails_its_step_and_leaks_nothing(rng, model_dir, where):
    """An exception when queuing a step, or when reading its ids back (where CUDA reports
    asynchronous errors), fails that step's requests; a request added afterwards still runs."""
    engine = _engine(model_dir, True)
    for i, p in enumerate(_prompts(3, rng)):
        engine.add_request(f"f{i}", p, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    for _ in range(4):
        engine.step()
    sample = engine.runner.sample  # the step's last launch call (EngineCore._launch)

    def faulty(*args):
        engine.runner.sample = sample  # once
        if where == "launch":
            raise RuntimeError("injected launch fault")
        pending = sample(*args)

        def broken():
            raise RuntimeError("injected read-back fault")
        pending.result = broken
        return pending

    engine.runner.sample = faulty
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    errors = [o for o in outs if o.status == RequestStatus.FINISHED_ERROR]
    assert sorted(o.request_id for o in errors) == ["f0", "f1", "f2"]
    assert all("injected" in o.error for o in errors)
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_total_blocks
    after = _run(engine, [("later", [5, 6, 7], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))])
    assert len(after[("later", 0)]["ids"]) == 5


def test_a_stop_next_to_a_penalty_row_agrees(rng, model_dir):
    """Penalties count the newest ids from the device (no read-back before the step); a request
    that stops on a token runs one step too many next to them, whose token is dropped."""
    prompts = _prompts(2, rng)
    first = _run(_engine(model_dir, False), [("b", prompts[1], SamplingParams(max_tokens=12, temperature=0,
                                                                             ignore_eos=True))])
    stop = first[("b", 0)]["ids"][5]
    reqs = [("a", prompts[0], SamplingParams(max_tokens=20, temperature=0, repetition_penalty=1.2, ignore_eos=True)),
            ("b", prompts[1], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop_token_ids=[stop]))]
    res = _same(model_dir, reqs)
    assert res[("b", 0)]["status"] == RequestStatus.FINISHED_STOPPED


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_incremental_staging_equals_a_full_rebuild(rng, model_dir, async_scheduling):
    """Steady decode steps rewrite only what moved in the staging buffers; after every step they
    must hold exactly what building the step from scratch writes (positions, slots, lengths,
    query starts, block tables), through admissions, finishes, block growth and preemption."""
    engine = _engine(model_dir, async_scheduling, num_kv_blocks=40, block_size=4)
    stager = engine.runner.stager
    stage = stager.stage
    incremental = reused = 0
    previous: list = []  # the last step's input ids (a view)

    def checked(out, tables, graph_batch, last, **kw):
        nonlocal incremental, reused
        incremental += stager.prev is not None
        step = stage(out, tables, graph_batch, last, **kw)
        got_ints, got_tables = stager.host_ints.numpy().copy(), stager.host_tables.numpy().copy()
        stager.prev = stager._views = None  # the full path, into the same buffers, with views made anew
        full = stage(out, tables, graph_batch, last, **kw)
        b, w = step.metadata.block_tables.shape
        n = int(step.metadata.query_start_loc[-1]) * 3 + 2 * b + 1
        assert (got_ints[:n] == stager.host_ints.numpy()[:n]).all()
        assert (got_tables[:b * w] == stager.host_tables.numpy()[:b * w]).all()
        # the step's inputs: the same numbers, and views of the same places of the buffers (the
        # views of a step shaped as the last one are that step's, taken again)
        assert step.facts == full.facts
        for name in ("max_query_len", "max_seq_len", "num_decodes", "decode_max_seq_len", "prefill_kv_tokens"):
            assert getattr(step.metadata, name) == getattr(full.metadata, name), name
        pairs = [(step.input_ids, full.input_ids), (step.positions, full.positions), (step.ints, full.ints)]
        for name in ("slot_mapping", "block_tables", "seq_lens", "query_start_loc", "prefill_query_start_loc",
                     "prefill_key_start_loc"):
            pairs.append((getattr(step.metadata, name), getattr(full.metadata, name)))
        for a, f in pairs:
            assert (a is None) == (f is None)
            if a is not None:
                assert (a.data_ptr(), a.shape, a.stride()) == (f.data_ptr(), f.shape, f.stride())
        reused += step.input_ids is previous[0] if previous else 0
        previous[:] = [full.input_ids]
        return full

    stager.stage = checked
    reqs = [(f"g{i}", p, SamplingParams(max_tokens=rng.randint(5, 30), temperature=0, ignore_eos=True))
            for i, p in enumerate(_prompts(10, rng))]
    _run(engine, reqs)
    assert incremental > 10 and reused > 10  # the fast paths really ran


def test_staged_key_starts_sum_the_prompt_rows_lengths(rng, model_dir):
    """The key starts staged for a step's prompt rows (where their keys begin once gathered from the
    pages, kernels/flash_prefill.py) are the running sums of those rows' lengths from 0, and the
    keys counted for the gather are their total, in mixed, pure prefill and decode steps alike."""
    engine = _engine(model_dir, True, max_num_batched_tokens=24)
    stage = engine.runner.stager.stage
    seen = {"mixed": 0, "prefill": 0, "decode": 0}

    def checked(out, tables, graph_batch, last, **kw):
        step = stage(out, tables, graph_batch, last, **kw)
        md = step.metadata
        nd, lens = md.num_decodes, md.seq_lens.tolist()
        if md.max_query_len == 1:
            seen["decode"] += 1
            assert md.prefill_key_start_loc is None and md.prefill_kv_tokens == 0
            return step
        seen["mixed" if nd else "prefill"] += 1
        sums = [0]
        for n in lens[nd:]:
            sums.append(sums[-1] + n)
        assert md.prefill_key_start_loc.tolist() == sums
        assert md.prefill_kv_tokens == sums[-1]
        assert (md.prefill_query_start_loc is None) == (nd == 0)
        return step

    engine.runner.stager.stage = checked
    reqs = [(f"k{i}", p, SamplingParams(max_tokens=rng.randint(3, 12), temperature=0, ignore_eos=True))
            for i, p in enumerate(_prompts(8, rng))]
    _run(engine, reqs)
    assert all(seen.values()), seen
