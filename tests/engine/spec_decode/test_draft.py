"""Speculative decoding with a draft model (engine/spec_decode/draft.py) on the CPU engine: greedy output is
plain decoding's token for token whatever the draft, a draft equal to the model is accepted almost
always, seeded sampled runs repeat, the draft's cache follows preemption and rollback, and a draft
that cannot serve is refused at start with the reason."""

from __future__ import annotations

import json
import random

import pytest

from pie.engine.config import EngineConfig
from pie.engine.core.engine_core import EngineCore
from pie.engine.errors import StartupError
from pie.engine.sampling_params import SamplingParams
from tests.engine.spec_decode.test_speculative import _assert_equal_runs, _engine, _prompts, _run
from tests.helpers import make_hf_model_dir


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """The model (llama), an unrelated smaller draft of another family with the same tokenizer,
    and a copy of the model to serve as its own draft."""
    target = make_hf_model_dir(tmp_path_factory.mktemp("target"), "llama", weight_scale=3.0)
    other = make_hf_model_dir(tmp_path_factory.mktemp("other"), "qwen2", weight_scale=3.0, num_hidden_layers=1)
    return target, other


def _draft(target, draft, **kw) -> EngineCore:
    return _engine(target, "draft", draft_model=str(draft), **kw)


def _stats(engine: EngineCore) -> tuple[int, int]:
    s = engine.stats()
    return s.spec_num_draft_tokens, s.spec_num_accepted_tokens


def _greedy(rng: random.Random, n: int, max_tokens: int = 32) -> list[tuple[str, list[int], SamplingParams]]:
    return [(f"g{i}", p, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
            for i, p in enumerate(_prompts(rng, n))]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_greedy_with_an_unrelated_draft_is_plain_decoding(dirs, async_scheduling, rng):
    target, other = dirs
    reqs = _greedy(rng, 5)
    plain = _run(_engine(target, None, async_scheduling=async_scheduling), reqs)
    engine = _draft(target, other, async_scheduling=async_scheduling)
    _assert_equal_runs(_run(engine, reqs), plain)
    drafted, _ = _stats(engine)
    assert drafted > 0, "the draft proposed nothing: nothing was tested"


def test_the_model_as_its_own_draft_is_accepted(dirs, rng):
    """q = p (up to the last bits of another kernel shape): greedy proposals are the model's own
    argmax, so nearly all are accepted, and the output is still plain decoding's."""
    target, _ = dirs
    reqs = _greedy(rng, 4, max_tokens=40)
    plain = _run(_engine(target, None), reqs)
    engine = _draft(target, target)
    _assert_equal_runs(_run(engine, reqs), plain)
    drafted, accepted = _stats(engine)
    assert drafted > 0 and accepted >= 0.9 * drafted, (drafted, accepted)
    # Every step of a request carried K proposals (fewer only at max_tokens): steps ~ tokens / (K + 1).
    s = engine.stats()
    assert s.spec_num_drafts <= sum(sp.max_tokens for _, _, sp in reqs) // 3


def test_sampled_draft_runs_repeat_per_seed_and_accept_their_own_distribution(dirs, rng):
    """Temperature 1 with the model as its own draft: accepted with probability min(1, p/q) ~ 1;
    the same seeds give the same tokens run after run, alone or in a batch, n > 1 included."""
    target, _ = dirs
    reqs = [(f"s{i}", p, SamplingParams(max_tokens=24, temperature=1.0, seed=rng.randrange(2**40), ignore_eos=True,
                                        n=1 + i % 2, logprobs=1))
            for i, p in enumerate(_prompts(rng, 4))]
    engine = _draft(target, target)
    first = _run(engine, reqs)
    drafted, accepted = _stats(engine)
    assert drafted > 0 and accepted >= 0.8 * drafted, (drafted, accepted)
    _assert_equal_runs(_run(_draft(target, target), reqs), first)
    alone = _run(_draft(target, target), reqs[1:2])
    assert alone[("s1", 0)]["ids"] == first[("s1", 0)]["ids"]


def test_preemption_and_a_small_pool(dirs, rng):
    """A pool too small for every request: preempted requests restart their draft cache too; the
    output is plain decoding's and every block comes back (checked by _run)."""
    target, other = dirs
    reqs = _greedy(rng, 8, max_tokens=40)
    plain = _run(_engine(target, None, num_kv_blocks=40), reqs)
    engine = _draft(target, target, num_kv_blocks=40)
    _assert_equal_runs(_run(engine, reqs), plain)
    assert engine.scheduler.num_preemptions > 0, "nothing was preempted: raise the load"


def test_long_prompts_catch_up_in_chunks(dirs, rng):
    """Prompts longer than the token budget: the draft runs them in several forward passes."""
    target, _ = dirs
    reqs = [(f"l{i}", [rng.randrange(3, 512) for _ in range(150)] * 2,
             SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)) for i in range(2)]
    plain = _run(_engine(target, None, max_num_batched_tokens=64, max_model_len=512), reqs)
    engine = _draft(target, target, max_num_batched_tokens=64, max_model_len=512)
    _assert_equal_runs(_run(engine, reqs), plain)
    assert _stats(engine)[1] > 0


def test_a_draft_with_another_tokenizer_is_refused(dirs, tmp_path):
    target, _ = dirs
    odd = make_hf_model_dir(tmp_path, "llama", num_hidden_layers=1)
    file = odd / "tokenizer.json"
    tok = json.loads(file.read_text())
    vocab = tok["model"]["vocab"]
    a, b = list(vocab)[10], list(vocab)[11]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # two ids swapped: same size, another tokenizer
    file.write_text(json.dumps(tok))
    with pytest.raises(StartupError, match="tokenizer is not the model's"):
        _draft(target, odd)


def test_a_draft_with_a_shorter_context_is_refused(dirs, tmp_path):
    target, _ = dirs
    short = make_hf_model_dir(tmp_path, "llama", num_hidden_layers=1, max_position_embeddings=32)
    with pytest.raises(StartupError, match="lower --max-model-len to 32"):
        _draft(target, short, max_model_len=64)
    _draft(target, short, max_model_len=32)  # within its context: served


def test_a_draft_needs_speculative_draft():
    with pytest.raises(ValueError, match="draft_model is given but speculative decoding is off"):
        EngineConfig(model="m", draft_model="d")


@pytest.mark.gpu
@pytest.mark.parametrize("kv", ["int8", "bf16"])
def test_draft_on_cuda_with_graphs_is_plain_decoding(dirs, kv, rng):
    """On CUDA (bf16 weights, async scheduling, decode and verify graphs, the draft's own decode
    graphs): the model as its own draft is mostly accepted, and the tokens are plain decoding's up
    to near-ties."""
    from tests.engine.runner.test_verify_graphs import assert_plain_up_to_near_ties
    from tests.engine.sample.test_seed_consistency import Run

    target, _ = dirs
    sp = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    requests = {f"p{i}": (p, sp) for i, p in enumerate(_prompts(rng, 6))}
    cfg = dict(model=str(target), device="cuda", dtype="bf16", kv_cache_dtype=kv, max_num_seqs=8, num_kv_blocks=256)
    plain = Run(EngineCore(EngineConfig(**cfg)), requests)
    engine = EngineCore(EngineConfig(**cfg, speculative="draft", draft_model=str(target), num_speculative_tokens=4))
    draft_runner = engine.speculator.proposer.runner  # type: ignore[union-attr, attr-defined]
    assert draft_runner.graphs, "the draft's decode steps were not captured"
    spec = Run(engine, requests)
    drafted, accepted = _stats(engine)
    assert drafted > 0 and accepted >= 0.5 * drafted, (drafted, accepted)
    assert_plain_up_to_near_ties(plain, spec, sp)
