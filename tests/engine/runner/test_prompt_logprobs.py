"""Prompt logprobs against transformers: each prompt token's log_softmax given the tokens before it
and the top-k at each position, through the whole engine (chunked prefill over several steps, the
prefix cache skipped, n > 1, a preemption), and the host-side bookkeeping of the chunks."""

from __future__ import annotations

import pytest
import torch

from pie.engine.config import EngineConfig
from pie.engine.core.engine_core import EngineCore
from pie.engine.messages import RequestOutput, SampledToken
from pie.engine.sampling_params import SamplingParams
from pie.engine.scheduling.block_manager import BlockManager
from pie.engine.scheduling.request import Request
from pie.engine.scheduling.scheduler import Scheduler
from pie.engine.scheduling.step import StepOutput
from tests.helpers import make_hf_model_dir

TOLERANCE = 1e-3  # against transformers' log_softmax in fp32 (measured ~1e-6 on the CPU)


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def model_dir(request, tmp_path_factory):
    return make_hf_model_dir(tmp_path_factory.mktemp(request.param), request.param, weight_scale=4.0)


@pytest.fixture(scope="module")
def hf(model_dir):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_logprobs(hf, prompt: list[int]) -> torch.Tensor:
    """(P, V) log_softmax of transformers' logits: row j predicts prompt token j + 1."""
    with torch.inference_mode():
        return torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), -1)


def engine(model_dir, **kwargs) -> EngineCore:
    cfg = dict(model=str(model_dir), device="cpu", kv_cache_dtype="fp32", block_size=16, num_kv_blocks=64,
               max_num_seqs=8, max_num_batched_tokens=24)  # 24 tokens a step: long prompts take several
    return EngineCore(EngineConfig(**{**cfg, **kwargs}))


def run(eng: EngineCore, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, list[RequestOutput]]:
    for rid, (prompt, sp) in requests.items():
        eng.add_request(rid, prompt, sp)
    outputs: dict[str, list[RequestOutput]] = {rid: [] for rid in requests}
    while eng.has_unfinished():
        for o in eng.step():
            outputs.setdefault(o.request_id, []).append(o)
    return outputs


def check_against_hf(hf, prompt: list[int], entries: list[SampledToken], k: int) -> None:
    ref = hf_logprobs(hf, prompt)
    assert [e.token_id for e in entries] == prompt[1:]
    for i, e in enumerate(entries, start=1):
        row = ref[i - 1]
        assert abs(e.logprob - row[prompt[i]].item()) < TOLERANCE, (i, e.logprob, row[prompt[i]].item())
        assert len(e.top) == k
        top = row.topk(k).values.tolist() if k else []
        assert [lp for _, lp in e.top] == pytest.approx(top, abs=TOLERANCE)
        for token, lp in e.top:  # each id's own value (ties may order equal values either way)
            assert abs(lp - row[token].item()) < TOLERANCE


def test_chunked_prompts_match_transformers(model_dir, hf, rng):
    """Prompts of 1 to 70 tokens, batched, with a budget of 24 tokens a step: positions of every
    chunk of every prompt, with 0 and with several alternatives."""
    eng = engine(model_dir)
    vocab = eng.vocab_size
    lens = [1, 2, 5, 23, 24, 25, 70]
    prompts = {f"p{n}": [rng.randrange(3, vocab) for _ in range(n)] for n in lens}
    ks = {rid: rng.choice([0, 1, 5, 20]) for rid in prompts}
    outputs = run(eng, {rid: (p, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True,
                                                prompt_logprobs=ks[rid])) for rid, p in prompts.items()})
    for rid, prompt in prompts.items():
        outs = outputs[rid]
        assert outs[0].prompt_logprobs is not None and all(o.prompt_logprobs is None for o in outs[1:])
        assert len(outs[0].prompt_logprobs) == len(prompt) - 1
        check_against_hf(hf, prompt, outs[0].prompt_logprobs, ks[rid])
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_total_blocks


def test_prefix_cache_is_skipped_for_the_asking_request_only(model_dir, hf, rng):
    eng = engine(model_dir)
    prompt = [rng.randrange(3, eng.vocab_size) for _ in range(50)]  # 3 full blocks of 16
    greedy = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    first = run(eng, {"a": (prompt, greedy)})["a"]
    asked = run(eng, {"b": (prompt, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True,
                                                   prompt_logprobs=2))})["b"]
    assert asked[0].num_cached_tokens == 0  # computed in full, though its blocks were cached
    check_against_hf(hf, prompt, asked[0].prompt_logprobs, 2)
    assert [t for o in asked for t in o.new_token_ids] == [t for o in first for t in o.new_token_ids]
    again = run(eng, {"c": (prompt, greedy)})["c"]
    assert again[0].num_cached_tokens == 48 and again[0].prompt_logprobs is None


def test_n_samples_report_them_once(model_dir, hf, rng):
    eng = engine(model_dir)
    prompt = [rng.randrange(3, eng.vocab_size) for _ in range(40)]
    outs = run(eng, {"r": (prompt, SamplingParams(max_tokens=3, temperature=1.0, seed=5, n=3, prompt_logprobs=1))})["r"]
    with_prompt = [o for o in outs if o.prompt_logprobs is not None]
    assert len(with_prompt) == 1 and with_prompt[0].index == 0 and with_prompt[0].new_token_ids
    check_against_hf(hf, prompt, with_prompt[0].prompt_logprobs, 1)
    cached = {o.index: o.num_cached_tokens for o in outs if o.num_output_tokens == 1}
    assert cached[0] == 0 and cached[1] == cached[2] == 32  # the other samples read sample 0's blocks


def test_only_the_asking_steps_compute_more_logits(model_dir, rng):
    """A step makes logits for its sampling rows only, unless a chunk in it asks for prompt
    logprobs: then for that chunk's prompt positions too, and nothing else."""
    eng = engine(model_dir)
    rows: list[int] = []
    compute = eng.model.compute_logits

    def counting(hidden):
        rows.append(hidden.shape[0])
        return compute(hidden)

    eng.model.compute_logits = counting
    prompts = {f"q{i}": [rng.randrange(3, eng.vocab_size) for _ in range(30)] for i in range(3)}
    run(eng, {rid: (p, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)) for rid, p in prompts.items()})
    assert sum(rows) == 3 * 4  # one row per sampled token
    rows.clear()
    run(eng, {"x": (prompts["q0"], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, prompt_logprobs=0)),
              "y": (prompts["q1"], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))})
    assert sum(rows) == 2 * 4 + 29


def test_preempted_request_reports_each_position_once(model_dir, hf, rng):
    """A pool too small for both: the later request is preempted in the middle of its prompt
    (more than once) and computes it again from the start; its entries are those of one pass."""
    eng = engine(model_dir, num_kv_blocks=7, max_num_batched_tokens=16)
    vocab = eng.vocab_size
    a = [rng.randrange(3, vocab) for _ in range(45)]
    b = [rng.randrange(3, vocab) for _ in range(80)]
    mid_prompt = []
    preempt = eng.scheduler._preempt

    def recording(request):
        if request.request_id == "b" and request.prompt_logprobs:
            mid_prompt.append(len(request.prompt_logprobs))
        preempt(request)

    eng.scheduler._preempt = recording
    outputs = run(eng, {"a": (a, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)),
                        "b": (b, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, prompt_logprobs=3))})
    assert mid_prompt, "b was never preempted with prompt entries collected"
    check_against_hf(hf, b, outputs["b"][0].prompt_logprobs, 3)


def test_overlapping_chunks_are_collected_once():
    """The scheduler's bookkeeping: entries of a chunk computed twice (a preemption while its step
    was in flight) are kept once, in order; a finished request's are dropped."""
    sched = Scheduler(BlockManager(8, 4), max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
    r = Request("r", list(range(10, 20)), SamplingParams(prompt_logprobs=0), max_model_len=64)

    def entries(first: int, count: int) -> list[SampledToken]:
        return [SampledToken(r.prompt_token_ids[i], -float(i), []) for i in range(first, first + count)]

    sched.update_from_output(StepOutput(prompt_logprobs=[(r, 1, entries(1, 4))]))
    sched.update_from_output(StepOutput(prompt_logprobs=[(r, 1, entries(1, 6))]))  # recomputed from the start
    sched.update_from_output(StepOutput(prompt_logprobs=[(r, 7, entries(7, 3))]))
    assert r.prompt_logprobs is not None
    assert [e.logprob for e in r.prompt_logprobs] == [-float(i) for i in range(1, 10)]


@pytest.mark.gpu
def test_on_cuda_beside_graph_replayed_decodes(model_dir, hf, rng):
    """On CUDA (async scheduling, CUDA graphs for pure decode steps, pinned read-back): requests
    asking for prompt logprobs arrive while others decode; their steps run eagerly, the values come
    back with the first token, and logit_bias / min_tokens hold in the same batches (H200,
    2026-12-02: largest error 1.9e-6 against transformers on the CPU)."""
    eng = engine(model_dir, device="cuda", dtype="fp32")
    assert eng.runner.graphs.graphs, "no CUDA graphs captured"
    vocab = eng.vocab_size
    decoding = {f"d{i}": ([rng.randrange(3, vocab) for _ in range(8)],
                          SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)) for i in range(4)}
    for rid, (prompt, sp) in decoding.items():
        eng.add_request(rid, prompt, sp)
    for _ in range(5):  # the decoders are in their graph-replayed steady state
        eng.step()
    asking = {f"p{n}": [rng.randrange(3, vocab) for _ in range(n)] for n in (1, 25, 70)}
    requests = {rid: (p, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, prompt_logprobs=3))
                for rid, p in asking.items()}
    requests["bias"] = ([5, 6, 7], SamplingParams(max_tokens=10, temperature=0.7, seed=2, min_tokens=4,
                                                  logit_bias={2: 100.0}))
    outputs = run(eng, requests)
    worst = 0.0
    for rid, prompt in asking.items():
        entries = outputs[rid][0].prompt_logprobs
        assert [e.token_id for e in entries] == prompt[1:]
        ref = hf_logprobs(hf, prompt)
        for i, e in enumerate(entries, start=1):
            worst = max(worst, abs(e.logprob - ref[i - 1, prompt[i]].item()))
            assert len(e.top) == 3
    print(f"largest prompt logprob error on CUDA: {worst:.2e}")
    assert worst < TOLERANCE
    bias = [t for o in outputs["bias"] for t in o.new_token_ids]
    assert bias[-1] == 2 and len(bias) == 5 and 2 not in bias[:4]
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_total_blocks


def test_entries_beyond_the_bound_are_refused_by_field():
    """prompt tokens x (1 + prompt_logprobs) is bounded, so one answer stays a sane message."""
    from pie.engine.errors import RequestError
    from pie.engine.limits import check_request
    from pie.engine.sampling_params import MAX_PROMPT_LOGPROB_ENTRIES

    limits = dict(config=EngineConfig(), vocab_size=512, max_model_len=10**7, num_kv_blocks=10**7)
    n = MAX_PROMPT_LOGPROB_ENTRIES // 21
    check_request([5] * n, SamplingParams(prompt_logprobs=20), **limits)
    with pytest.raises(RequestError) as err:
        check_request([5] * (n + 1), SamplingParams(prompt_logprobs=20), **limits)
    assert err.value.field == "prompt_logprobs"
    check_request([5] * (n + 1), SamplingParams(), **limits)  # not asked: no bound
