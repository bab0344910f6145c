"""Speculative decoding end to end on the CPU engine (engine/spec_decode/speculator.py), against plain
decoding of the same engine: the same tokens, texts, logprobs and finish reasons with every
feature a request can ask for, every KV block back at the end, and the engine's bookkeeping
(tests/engine/invariants.py: no block past a request's tokens, hashes of its real ids only)
after every step.

Where the KV cache rounds (int8, bf16 pages), a verify step's K/V (computed for 1 + k tokens in
one matrix product) can round to the other side of a storage boundary than a decode step's, so
the two runs are compared as test_seed_consistency compares runs: the same logits within its
tolerances, and where the tokens part, a near-tie at that step in the plain run. Elsewhere (fp32
pages) the outputs must be equal outright.

Prompts repeat a random phrase, so prompt lookup finds something to propose; the random models
(weights x 3) fall into loops of their own, which it then proposes too.
"""

from __future__ import annotations

import random
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from pie.engine.config import EngineConfig
from pie.engine.core.engine_core import EngineCore
from pie.engine.messages import RequestStatus
from pie.engine.sampling_params import SamplingParams, StructuredOutputParams
from tests.engine.invariants import assert_engine_invariants
from tests.engine.sample.test_seed_consistency import Run, assert_same
from tests.helpers import ARCHS, make_hf_model_dir

VOCAB = 512


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """One tiny random model per family, made when first asked for."""
    made: dict[str, object] = {}

    def get(arch: str):
        if arch not in made:
            made[arch] = make_hf_model_dir(tmp_path_factory.mktemp(arch), arch, weight_scale=3.0)
        return made[arch]

    return get


def _engine(model_dir, spec: str | None = "ngram", **kw) -> EngineCore:
    cfg = dict(model=str(model_dir), device="cpu", dtype="fp32", kv_cache_dtype="fp32", block_size=4,
               num_kv_blocks=160, max_num_seqs=8, max_num_batched_tokens=128, async_scheduling=False,
               speculative=spec, num_speculative_tokens=4)
    return EngineCore(EngineConfig(**{**cfg, **kw}))


def _prompts(rng: random.Random, n: int) -> list[list[int]]:
    """A random phrase said two or three times, with a random start and end."""
    out = []
    for _ in range(n):
        phrase = [rng.randrange(3, VOCAB) for _ in range(rng.randint(4, 9))]
        out.append([rng.randrange(3, VOCAB) for _ in range(rng.randint(0, 4))] + phrase * rng.randint(2, 3)
                   + [rng.randrange(3, VOCAB) for _ in range(rng.randint(0, 3))])
    return out


def _run(engine: EngineCore, requests: list[tuple[str, list[int], SamplingParams]],
         abort_after: dict[str, int] | None = None, seen: dict[str, dict] | None = None
         ) -> dict[tuple[str, int], dict]:
    """Runs to completion, checking the invariants after every step; per (request id, index):
    ids, text, logprobs, status, stop reason. abort_after: request id -> abort it once it has
    output that many tokens. seen: filled with request id -> its proposals accepted (as of its
    last step in the running set) and prompt tokens read from the prefix cache."""
    for rid, prompt, sp in requests:
        engine.add_request(rid, prompt, sp)
    res: dict[tuple[str, int], dict] = {}
    pending = dict(abort_after or {})
    steps = 0
    while engine.has_unfinished():
        for o in engine.step():
            r = res.setdefault((o.request_id, o.index), dict(ids=[], text="", logprobs=[], status=None, reason=None))
            r["ids"] += o.new_token_ids
            r["text"] += o.new_text
            r["logprobs"] += [(t.token_id, t.logprob, list(t.top)) for t in o.new_logprobs]
            if o.finished:
                r["status"], r["reason"] = o.status, o.stop_reason
            if seen is not None:
                seen.setdefault(o.request_id, {"accepted": 0})["cached"] = o.num_cached_tokens
        steps += 1
        assert_engine_invariants(engine)
        if seen is not None:
            for req in engine.scheduler.running:
                seen.setdefault(req.request_id, {"accepted": 0})["accepted"] = req.num_accepted_tokens
        for rid, n in list(pending.items()):
            if len(res.get((rid, 0), {}).get("ids", [])) >= n:
                engine.abort(rid)
                del pending[rid]
                assert_engine_invariants(engine)
        assert steps < 5_000
    assert not pending, f"finished before their abort: {pending}"
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_total_blocks, "KV blocks leaked"
    return res


def _assert_equal_runs(got: dict, want: dict, tol: float = 1e-4) -> None:
    """The same ids, texts, statuses and reasons; logprobs (and top-n) within `tol` (a verify
    step's logits come from a matrix product of another shape: the last bits differ)."""
    assert got.keys() == want.keys()
    for key, w in want.items():
        g = got[key]
        assert {k: v for k, v in g.items() if k != "logprobs"} == {k: v for k, v in w.items() if k != "logprobs"}, key
        assert len(g["logprobs"]) == len(w["logprobs"]), key
        for (gid, glp, gtop), (wid, wlp, wtop) in zip(g["logprobs"], w["logprobs"]):
            assert gid == wid and abs(glp - wlp) < tol, (key, gid, glp, wlp)
            assert len(gtop) == len(wtop) and all(abs(a - b) < tol for (_, a), (_, b) in zip(gtop, wtop)), (key, gtop, wtop)


def _accepted(engine: EngineCore) -> int:
    return engine.stats().spec_num_accepted_tokens


COPY_TOKEN = 7
PULL = 8.0  # a bias that wins over a random model's logits, until penalties outweigh it


def _copying(sp: SamplingParams) -> SamplingParams:
    """sp for a row that says one token over and over (a bias of 100 on it): the n-gram lookup
    proposes it from the row's own output, and the model, held to it, accepts. A random model
    copies the other rows' phrases only now and then, so without such a row a test that must see a
    proposal accepted fails on some seeds (it did in CI)."""
    return replace(sp, logit_bias={**sp.logit_bias, COPY_TOKEN: 100.0})


def _same_as_plain(model_dir, requests, *, min_accepted: int = 1, accepting: tuple[str, ...] = (), **kw) -> dict:
    """Plain decoding's outputs, after checking speculation's are the same; `accepting`: requests
    that must each have had a proposal accepted (so what they test met a verify step)."""
    plain = _run(_engine(model_dir, None, **kw), requests)
    spec_engine = _engine(model_dir, **kw)
    seen: dict[str, dict] = {}
    spec = _run(spec_engine, requests, seen=seen)
    _assert_equal_runs(spec, plain)
    assert _accepted(spec_engine) >= min_accepted, "no proposal was ever accepted: nothing was tested"
    assert all(seen[rid]["accepted"] > 0 for rid in accepting), {rid: seen[rid] for rid in accepting}
    return plain


def _compare_with_tolerance(model_dir, kv: str, prompts: list[list[int]], sp: SamplingParams, **kw) -> EngineCore:
    requests = {f"p{i}": (p, sp) for i, p in enumerate(prompts)} | {"copy": (prompts[0], _copying(sp))}
    plain = Run(_engine(model_dir, None, kv_cache_dtype=kv, **kw), requests)
    spec_engine = _engine(model_dir, kv_cache_dtype=kv, **kw)
    spec = Run(spec_engine, requests)
    for rid in requests:
        assert_same(plain, rid, spec, rid, sp, kv, f"{kv} speculative")
    return spec_engine


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_is_plain_decoding_in_every_family(models, arch, rng):
    """int8 pages, the default: the same greedy tokens (up to near-ties, module docstring)."""
    sp = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    engine = _compare_with_tolerance(models(arch), "int8", _prompts(rng, 4), sp)
    assert _accepted(engine) > 0


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("kv", ["int8", "bf16", "fp32"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_greedy_is_plain_decoding_for_each_kv_dtype(models, arch, kv, async_scheduling, rng):
    sp = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    engine = _compare_with_tolerance(models(arch), kv, _prompts(rng, 4), sp, async_scheduling=async_scheduling)
    assert _accepted(engine) > 0


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_seeded_sampling_draws_what_plain_decoding_draws(models, async_scheduling, rng):
    """At temperature > 0 an n-gram proposal is judged by the sampler's own race at (seed, output
    index): each seed decodes the same tokens with or without speculation, n > 1 included."""
    # Random models rarely copy at temperature > 0: low temperatures (and top_k 1, a sampled row
    # that the filters make certain) give the accepted path something to do.
    reqs = [(f"s{i}", p, SamplingParams(max_tokens=32, temperature=t, top_k=k, seed=rng.randrange(2**40),
                                        ignore_eos=True, n=rng.choice([1, 3])))
            for i, (p, (t, k)) in enumerate(zip(_prompts(rng, 6), [(0.1, 0), (0.2, 40), (1.0, 1)] * 2))]
    _same_as_plain(models("llama"), reqs, async_scheduling=async_scheduling)


def test_stops_and_lengths_are_plain_decoding(models, rng):
    """Stop ids, stop strings, EOS, max_tokens and the context's end, reached in the middle of an
    accepted run of proposals: the request ends at the same token, with the same text and reason."""
    model_dir = models("qwen2")
    prompts = _prompts(rng, 6)
    first = _run(_engine(model_dir, None), [(f"f{i}", p, SamplingParams(max_tokens=30, temperature=0.0,
                                                                         ignore_eos=True))
                                            for i, p in enumerate(prompts)])
    reqs = []
    for i, p in enumerate(prompts):
        ids = first[(f"f{i}", 0)]["ids"]
        stop_at = ids[rng.randrange(5, len(ids))]
        kind = i % 4
        sp = SamplingParams(max_tokens=rng.randint(3, 30), temperature=0.0, ignore_eos=kind != 2,
                            stop_token_ids=[stop_at] if kind == 0 else [],
                            stop=["e", " t", "\n"] if kind == 1 else [])
        reqs.append((f"r{i}", p, sp))
    reqs.append(("edge", prompts[0][:20], SamplingParams(max_tokens=44, temperature=0.0, ignore_eos=True)))
    res = _same_as_plain(model_dir, reqs, max_model_len=64)
    assert {r["status"] for r in res.values()} <= {RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_STOPPED}


@pytest.mark.parametrize("mode", ["raw", "processed"])
def test_logprobs_penalties_bias_and_min_tokens_are_plain_decoding(models, mode, rng):
    """Logprobs (and top-n) of accepted tokens as plain decoding reports them; penalties that count
    only accepted tokens; logit_bias; min_tokens holding back EOS across a verify step. The sampled
    and penalized rows lean on one token (a bias of PULL): a random model rarely copies when sampled
    or penalized, and those rows must meet verify steps. The penalties grow with each accepted copy
    until another token wins, at plain decoding's position only if they count what was accepted."""
    model_dir = models("mistral")
    prompts = _prompts(rng, 5)
    pull = {COPY_TOKEN: PULL}
    reqs = [
        ("lp", prompts[0], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=3)),
        ("lps", prompts[1], SamplingParams(max_tokens=24, temperature=0.5, seed=rng.randrange(2**40), logprobs=2,
                                           ignore_eos=True, logit_bias=pull)),
        ("pen", prompts[2], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, repetition_penalty=1.2,
                                           frequency_penalty=0.3, presence_penalty=0.2, logprobs=1, logit_bias=pull)),
        ("bias", prompts[3], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True,
                                            logit_bias={prompts[3][-1]: 2.0, prompts[3][0]: -5.0})),
        # EOS favoured by the bias, held back by min_tokens, then taken at once
        ("min", prompts[4], SamplingParams(max_tokens=24, temperature=0.0, min_tokens=9, logit_bias={2: 6.0})),
    ]
    res = _same_as_plain(model_dir, reqs, logprobs_mode=mode, accepting=("lps", "pen"))
    assert len(set(res[("pen", 0)]["ids"])) > 1, "the penalties never outweighed the pull"
    assert len(res[("lp", 0)]["logprobs"]) == 24 and len(res[("min", 0)]["ids"]) >= 9


def test_preemption_and_aborts(models, rng):
    """A pool too small for everyone: requests whose outputs hold accepted proposals are
    preempted and come back (recomputing them) with plain decoding's tokens; aborts mid-answer;
    no block leaks, the invariants hold after every step."""
    model_dir = models("llama")
    reqs = [(f"q{i}", p, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
            for i, p in enumerate(_prompts(rng, 8))]
    reqs.append(("copy", reqs[0][1], _copying(reqs[0][2])))
    kw = dict(num_kv_blocks=40, block_size=4)
    plain_engine, spec_engine = _engine(model_dir, None, **kw), _engine(model_dir, **kw)
    plain = _run(plain_engine, reqs)
    preempted_after_accepting = []
    preempt = spec_engine.scheduler._preempt
    spec_engine.scheduler._preempt = lambda r: (preempted_after_accepting.append(r.num_accepted_tokens > 0),
                                                preempt(r))[1]
    _assert_equal_runs(_run(spec_engine, reqs), plain)
    assert any(preempted_after_accepting), preempted_after_accepting
    spec_engine = _engine(model_dir, **kw)
    res = _run(spec_engine, reqs, abort_after={"q1": 3, "q5": 7})  # after that many tokens out
    for rid, n in (("q1", 3), ("q5", 7)):  # an abort ends it without a last output
        assert res[(rid, 0)]["status"] is None and len(res[(rid, 0)]["ids"]) >= n, res[(rid, 0)]
    assert all(res[(f"q{i}", 0)] == plain[(f"q{i}", 0)] for i in (0, 2, 3, 4, 6, 7))


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_prefix_cache_holds_accepted_tokens_only(models, async_scheduling, rng):
    """The same requests again hit the blocks the first run cached (whose hashes the invariants
    check against the requests' real ids after every step), and decode the same tokens."""
    model_dir = models("qwen3")
    reqs = [(f"c{i}", p, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
            for i, p in enumerate(_prompts(rng, 4))]
    reqs.append(("copy", reqs[0][1], _copying(reqs[0][2])))
    engine = _engine(model_dir, async_scheduling=async_scheduling)
    first = _run(engine, reqs)
    hits = engine.block_manager.prefix_cache_hits
    again = [(f"again-{rid}", p, sp) for rid, p, sp in reqs]
    # The prompts and the first run's outputs: blocks filled by accepted proposals are hit too.
    again += [(f"long-{rid}", p + first[(rid, 0)]["ids"][:20], replace(sp, max_tokens=10)) for rid, p, sp in reqs]
    seen: dict[str, dict] = {}
    second = _run(engine, again, seen=seen)
    assert engine.block_manager.prefix_cache_hits > hits
    # the copying row accepts (nearly) every proposal: its blocks past the prompt hold them
    block = engine.block_manager.block_size
    assert seen["long-copy"]["cached"] > len(reqs[-1][1]) // block * block, seen["long-copy"]
    for rid, _, _ in reqs:
        assert second[(f"again-{rid}", 0)]["ids"] == first[(rid, 0)]["ids"]
        assert second[(f"long-{rid}", 0)]["ids"] == first[(rid, 0)]["ids"][20:30]
    assert _accepted(engine) > 0


def test_structured_output_masks_every_proposed_position(models):
    """A choice constraint whose texts the prompt holds: proposals the matcher allows are verified
    under the mask the matcher gives after each of them (llguidance advances and rolls back), the
    output is one of the choices, and the tokens are plain decoding's."""
    model_dir = models("llama")
    tok = _engine(model_dir, None).tokenizer
    choices = ("the small red cat runs quickly under the old bridge", "a dark blue bird sings near the river today")
    prompt = tok.encode(" ".join(choices) + " " + choices[0] + " " + choices[1] + " ")
    reqs = [(f"j{i}", prompt, SamplingParams(max_tokens=40, temperature=t, seed=i,
                                             structured=StructuredOutputParams("choice", choices=choices)))
            for i, t in enumerate([0.0, 0.0, 1.0, 1.0])]
    res = _same_as_plain(model_dir, reqs, min_accepted=4)
    assert all(r["text"] in choices and r["status"] == RequestStatus.FINISHED_STOPPED for r in res.values())


def test_budget_counts_proposals_and_large_batches_do_not_speculate(models, rng):
    """A row with k proposals takes 1 + k tokens of the step's budget; a request that turns
    speculation off gets none; above speculative_max_batch running decodes nobody speculates.

    Whether a random model's greedy output repeats an n-gram while few rows decode is luck (one
    model and prompt draw in CI never did, and nothing speculated), so a copying row (`_copying`:
    it says COPY_TOKEN over and over) after a prompt that ends in COPY_TOKEN twice has a proposal
    at every decode, whatever the model: the suffix (COPY_TOKEN, COPY_TOKEN) occurred before. It is
    admitted first with a prompt of at most one step's budget, so its first decode comes while
    only its twin may decode too, and must speculate (one proposal: the latest earlier occurrence
    ends one token back); it says more tokens than the others, so it is still decoding once more
    than speculative_max_batch rows do, and then must not. Its twin, speculation off, would have
    the same proposals and must get none."""
    model_dir = models("llama")
    engine = _engine(model_dir, max_num_batched_tokens=12, speculative_max_batch=3)
    seen = []  # per step: (running decodes, proposals, {decoding request id: its proposals})
    schedule = engine.scheduler.schedule

    def watched():
        out = schedule()
        assert out.num_batched_tokens <= 12
        assert out.num_spec_tokens == sum(s.num_spec for s in out.scheduled)
        assert out.num_batched_tokens == sum(s.num_new_tokens for s in out.scheduled)
        assert all(s.num_new_tokens == 1 + s.num_spec for s in out.scheduled if s.num_spec)
        decodes = {s.request.request_id: s.num_spec for s in out.scheduled
                   if s.num_new_tokens - s.num_spec == 1 and s.sample}
        seen.append((len(decodes), out.num_spec_tokens, decodes))
        return out

    engine.scheduler.schedule = watched
    sp = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    copy_prompt = [rng.randrange(3, VOCAB) for _ in range(rng.randint(0, 6))] + [COPY_TOKEN] * 2
    copy_sp = _copying(replace(sp, max_tokens=40))
    prompts = _prompts(rng, 5)
    reqs = [("copy", copy_prompt, copy_sp), ("copy-off", copy_prompt, replace(copy_sp, disable_speculation=True))]
    reqs += [(f"b{i}", p, sp) for i, p in enumerate(prompts)]
    reqs.append(("off", prompts[0], replace(sp, disable_speculation=True)))
    res = _run(engine, reqs)
    assert res[("copy", 0)]["ids"] == res[("copy-off", 0)]["ids"] == [COPY_TOKEN] * 40
    assert res[("off", 0)]["ids"] == res[("b0", 0)]["ids"]
    assert all(rows.get(rid, 0) == 0 for _, _, rows in seen for rid in ("off", "copy-off"))
    assert any(n <= 3 and "copy-off" in rows for n, _, rows in seen), "copy-off never decoded where others speculate"
    assert all(spec == 0 for n, spec, _ in seen if n > 3), "speculated above the batch bound"
    first = next(step for step in seen if "copy" in step[2])
    assert first[0] <= 3 and first[2]["copy"] == 1, f"the copying row did not speculate: {first}"
    assert any(n > 3 and "copy" in rows for n, _, rows in seen), "the copying row never decoded in a large batch"
    assert engine.stats().spec_num_draft_tokens > 0


def _always_wrong_draft(target: Path, folder: Path) -> Path:
    """A copy of target with its lm_head rows rolled by one: the draft's logit of token t is the
    model's of t - 1, so its greedy token is the model's plus one, and the first proposal of every
    verify step is rejected, whatever the random weights make of the prompts."""
    shutil.copytree(target, folder)
    tensors = load_file(folder / "model.safetensors")
    tensors["lm_head.weight"] = tensors["lm_head.weight"].roll(1, dims=0)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def test_rejected_proposals_give_their_blocks_back(models, rng, tmp_path):
    """Proposals reaching into new blocks, rejected: the blocks go back to the pool when the step
    is read back (the invariants would catch a table longer than the tokens need). 8 proposals
    over 2-token blocks always reach past the next boundary, and this draft's are always wrong."""
    model_dir = models("qwen2")
    draft = _always_wrong_draft(model_dir, tmp_path / "draft")
    # room for every request's prompt, output and proposals (800 tokens against at most 6 x 85): a
    # full pool gives proposals no blocks (speculation never preempts), and then none is rejected
    engine = _engine(model_dir, "draft", draft_model=str(draft), block_size=2, num_speculative_tokens=8,
                     num_kv_blocks=400)
    bm = engine.block_manager
    trim = bm.trim
    returned = []

    def counted(request):
        n = trim(request)
        returned.append(n)
        return n

    bm.trim = counted
    reqs = [(f"t{i}", p, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
            for i, p in enumerate(_prompts(rng, 6))]
    res = _run(engine, reqs)
    assert all(len(res[(rid, 0)]["ids"]) == 40 for rid, _, _ in reqs)
    stats = engine.stats()
    assert stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens, stats
    assert sum(returned) > 0, "no verify step gave back a block of its rejected proposals"


def test_off_by_default(models, rng):
    """No speculative flag: no speculator, no proposal looked up, steps as before."""
    assert EngineConfig().speculative is None
    engine = _engine(models("llama"), None)
    assert engine.speculator is None and engine.scheduler.speculator is None
    engine.add_request("d", _prompts(rng, 1)[0], SamplingParams(max_tokens=8, temperature=0.0))
    requests = list(engine.scheduler.waiting)
    while engine.has_unfinished():
        engine.step()
    assert all(r.ngram is None and r.num_drafts == 0 for r in requests)
    assert engine.stats().spec_num_drafts == 0


@pytest.mark.parametrize("kwargs, message", [
    (dict(speculative="eagle"), "speculative must be one of"),
    (dict(speculative="ngram", num_speculative_tokens=0), "num_speculative_tokens"),
    (dict(speculative="ngram", num_speculative_tokens=17), "num_speculative_tokens"),
    (dict(speculative="draft"), "needs draft_model"),
    (dict(speculative="ngram", draft_model="/x"), "only it takes one"),
    (dict(draft_model="/x"), "speculative decoding is off"),
    (dict(speculative="ngram", speculative_max_batch=0), "speculative_max_batch"),
    (dict(speculative="ngram", prompt_lookup_min=3, prompt_lookup_max=2), "prompt_lookup_min"),
    (dict(speculative="ngram", tensor_parallel_size=2), "tensor parallelism"),
])
def test_config_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kwargs)
