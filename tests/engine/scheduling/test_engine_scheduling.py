"""Prefix caching, chunked prefill and n > 1 through EngineCore on a tiny model (CPU, fp32 cache)."""

from __future__ import annotations

import pytest

from pie.engine.config import EngineConfig
from pie.engine.core.engine_core import EngineCore
from pie.engine.sampling_params import SamplingParams
from tests.helpers import make_hf_model_dir

BS = 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_hf_model_dir(tmp_path_factory.mktemp("sched"), "llama", seed=3, weight_scale=4.0)


def make_engine(model_dir, **kw) -> EngineCore:
    cfg = dict(model=str(model_dir), device="cpu", kv_cache_dtype="fp32", block_size=BS,
               num_kv_blocks=64, max_num_seqs=8, max_num_batched_tokens=256)
    return EngineCore(EngineConfig(**{**cfg, **kw}))


def count_scheduled(engine: EngineCore) -> list:
    """Wraps schedule(); returns the list of SchedulerOutputs it will collect."""
    outs, schedule = [], engine.scheduler.schedule

    def wrapped():
        out = schedule()
        outs.append(out)
        return out

    engine.scheduler.schedule = wrapped
    return outs


def run(engine: EngineCore, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict:
    got: dict[tuple[str, int], list[int]] = {}
    for rid, (prompt, sp) in requests.items():
        engine.add_request(rid, prompt, sp)
    while engine.has_unfinished():
        for o in engine.step():
            got.setdefault((o.request_id, o.index), []).extend(o.new_token_ids)
    return got


def assert_pool_clean(engine: EngineCore) -> None:
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_total_blocks
    assert all(bm.ref_count(b) == 0 for b in range(bm.num_total_blocks))


PREFIX = [(7 * i + 3) % 500 + 5 for i in range(13)]
PROMPTS = {f"p{i}": PREFIX + [50 + i] * (i + 1) for i in range(4)}
PROMPTS["other"] = [(11 * i) % 400 + 20 for i in range(30)]


@pytest.mark.parametrize("caching,budget", [(False, 256), (True, 256), (True, 5), (False, 7)])
def test_greedy_outputs_identical_with_cache_and_chunking(model_dir, caching, budget) -> None:
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    reference = run(make_engine(model_dir), {k: (v, greedy) for k, v in PROMPTS.items()})
    engine = make_engine(model_dir, enable_prefix_caching=caching, max_num_batched_tokens=budget)
    # Staggered: p0 first, so the later ones can hit its cached prefix.
    got = run(engine, {"p0": (PROMPTS["p0"], greedy)})
    got.update(run(engine, {k: (v, greedy) for k, v in PROMPTS.items() if k != "p0"}))
    assert got == reference
    assert_pool_clean(engine)


def test_shared_prefix_computes_only_unshared_tokens(model_dir) -> None:
    engine = make_engine(model_dir)
    outs = count_scheduled(engine)
    greedy = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    run(engine, {"p0": (PROMPTS["p0"], greedy)})
    assert sum(o.num_batched_tokens for o in outs) == len(PROMPTS["p0"])
    outs.clear()
    # 13 shared tokens = 3 full blocks cached; each prompt computes its tokens past 12.
    run(engine, {k: (PROMPTS[k], greedy) for k in ("p1", "p2", "p3")})
    assert sum(o.num_batched_tokens for o in outs) == sum(len(PROMPTS[k]) - 12 for k in ("p1", "p2", "p3"))
    stats = engine.stats()
    assert stats.prefix_cache_hits == 3 * 12
    assert stats.prefix_cache_queries == sum(len(PROMPTS[k]) for k in ("p0", "p1", "p2", "p3"))
    assert stats.kv_blocks_cached > 0 and stats.kv_blocks_free == stats.kv_blocks_total


def test_long_prompt_mid_stream_keeps_decodes_advancing(model_dir) -> None:
    """The token budget alone (the stall bound off: its chunks follow step times) shares each step
    between the running decodes and a chunk of the long prompt."""
    budget = 8
    engine = make_engine(model_dir, max_num_batched_tokens=budget, decode_stall_factor=0)
    outs = count_scheduled(engine)
    sp = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    for i in range(3):
        engine.add_request(f"s{i}", [30 + i, 40 + i], sp)
    for _ in range(2):
        engine.step()  # all three are decoding now
    long = engine.add_request("long", [(5 * i) % 300 + 7 for i in range(40)], SamplingParams(max_tokens=2)).samples[0]
    outs.clear()
    chunks = 0
    while not long.finished and long.num_output_tokens == 0:
        engine.step()
        out = outs[-1]
        decodes = [s for s in out.scheduled if s.request.request_id != "long"]
        assert sorted(s.request.request_id for s in decodes) == ["s0", "s1", "s2"]
        assert all(s.num_new_tokens == 1 for s in decodes)
        assert out.scheduled[:3] == decodes  # decodes come first
        longs = [s for s in out.scheduled if s.request.request_id == "long"]
        assert len(longs) == 1 and longs[0].num_new_tokens <= budget - 3
        chunks += 1
    assert chunks == 8  # 40 tokens in chunks of 5
    engine.abort_all()
    assert_pool_clean(engine)


def test_n_samples_reproduce_and_prefill_the_prompt_once(model_dir) -> None:
    prompt = [(13 * i) % 450 + 9 for i in range(14)]  # 3 full blocks + 2 tokens
    sp = SamplingParams(max_tokens=6, temperature=1.0, seed=1234, n=4, ignore_eos=True)
    first, second = None, None
    for attempt in range(2):
        engine = make_engine(model_dir)
        outs = count_scheduled(engine)
        finals = []
        engine.add_request("req", prompt, sp)
        got: dict[int, list[int]] = {}
        while engine.has_unfinished():
            for o in engine.step():
                assert o.request_id == "req"
                got.setdefault(o.index, []).extend(o.new_token_ids)
                if o.finished:
                    finals.append(o.all_finished)
        assert sorted(got) == [0, 1, 2, 3]
        assert finals == [False, False, False, True]
        # The prompt once, then 2 tokens (past the 3 cached blocks) per sibling, then decodes.
        assert sum(o.num_batched_tokens for o in outs) == 14 + 3 * 2 + 4 * 5
        assert_pool_clean(engine)
        if attempt == 0:
            first = got
        else:
            second = got
    assert first == second
    assert len({tuple(v) for v in first.values()}) > 1  # samples differ
    # Sample i with seed + i is sample 0 of a request seeded seed + i.
    engine = make_engine(model_dir)
    solo = run(engine, {"x": (prompt, SamplingParams(max_tokens=6, temperature=1.0, seed=1236,
                                                      ignore_eos=True))})
    assert solo[("x", 0)] == first[2]


def test_n_samples_without_prefix_caching_and_abort(model_dir) -> None:
    engine = make_engine(model_dir, enable_prefix_caching=False)
    sp = SamplingParams(max_tokens=50, temperature=0.0, n=3, ignore_eos=True)
    engine.add_request("a", [5, 6, 7, 8, 9], sp)
    outs = engine.step()  # no holding back: all three prefill at once
    assert sorted(o.index for o in outs) == [0, 1, 2] and not any(o.finished for o in outs)
    assert outs[0].queue_time_s is not None and outs[0].queue_time_s >= 0
    assert engine.abort("a") and not engine.has_unfinished() and not engine.abort("a")
    assert_pool_clean(engine)
    with pytest.raises(ValueError):
        SamplingParams(n=17)


def test_the_engine_teaches_the_stall_bound_and_it_cuts_prompts(model_dir) -> None:
    """EngineCore reports every step's time to the scheduler's stall bound (decode-only steps and
    steps with prompt tokens); a long prompt arriving beside running decodes is then cut into
    chunks within the bound of each step, and gives the tokens an unbounded engine gives."""
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    engine = make_engine(model_dir, max_num_batched_tokens=256, decode_stall_factor=1.5, num_kv_blocks=160)
    stall = engine.scheduler.stall
    for i in range(3):
        engine.add_request(f"s{i}", [30 + i, 40 + i, 50 + i] * 6, greedy, streamed=True)  # 18-token prompts
    for _ in range(3):
        engine.step()
    engine.add_request("warm", [60, 61, 62] * 8, greedy)  # a prompt beside decodes: its cost is measured
    for _ in range(3):
        engine.step()
    assert stall.decode_s is not None and stall.per_prompt_token_s is not None, "no step times reached the bound"
    steps: list[tuple[int | None, list]] = []  # (the bound before the step, the step's rows)
    schedule = engine.scheduler.schedule

    def recording():
        bound = stall.prompt_tokens(sum(1 for r in engine.scheduler.running if r.num_remaining_tokens == 1))
        out = schedule()
        steps.append((bound, out.scheduled))
        return out

    engine.scheduler.schedule = recording
    long = [(7 * i) % 300 + 5 for i in range(120)]
    sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    engine.add_request("long", long, sp)
    got: list[int] = []
    while engine.has_unfinished():
        got += [t for o in engine.step() if o.request_id == "long" for t in o.new_token_ids]
    chunks = [(bound, s.num_new_tokens) for bound, rows in steps for s in rows
              if s.request.request_id == "long" and s.start < len(long)]
    assert engine.stats().num_preemptions == 0  # (a recompute would chunk the prompt again)
    assert sum(n for _, n in chunks) == len(long)
    assert all(bound is None or n <= max(bound, stall.min_tokens) for bound, n in chunks), chunks
    alone = make_engine(model_dir, max_num_batched_tokens=256, decode_stall_factor=0)
    assert got == alone.generate([long], sp)[0]
