"""Tensor parallelism on the CPU with gloo (engine/runner/tensor_parallel.py): N processes give the same
greedy tokens as one, for the four families with grouped-query attention (KV heads fewer than
ranks included), with preemption and prefix caching, through the gRPC service; a worker that dies
or hangs ends the server's engine with a clear error; a size that does not divide the heads is
refused before any process starts."""

from __future__ import annotations

import os
import signal
import time

import pytest

from pie.engine.config import EngineConfig
from pie.engine.core.engine_core import EngineCore
from pie.engine.sampling_params import SamplingParams
from pie.service.server import BackgroundServer, ServerConfig
from pie_client import Client, Unavailable
from tests.helpers import make_hf_model_dir, wait_until
from tests.service.processes import alive, engine_children

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def _config(model_dir, tp: int, **kw) -> EngineConfig:
    kw = {"device": "cpu", "kv_cache_dtype": "fp32", "num_kv_blocks": 96, "cpu_threads": 1, **kw}
    return EngineConfig(model=str(model_dir), tensor_parallel_size=tp, **kw)


def _generate(model_dir, tp: int, prompts, sampling=GREEDY, **kw) -> tuple[list[list[int]], EngineCore]:
    engine = EngineCore(_config(model_dir, tp, **kw))
    try:
        return engine.generate(prompts, sampling), engine
    finally:
        engine.close()


def _prompts(rng, n: int, vocab: int = 512) -> list[list[int]]:
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(3, 40))] for _ in range(n)]


def _workers(parent: int | None = None) -> list[int]:
    """Pids of the tensor-parallel workers of `parent` (this process by default)."""
    return engine_children(os.getpid() if parent is None else parent, marker="pie.engine.runner.tensor_parallel")


CASES = [("llama", {}, 2), ("mistral", {}, 2), ("qwen2", {}, 2), ("qwen3", {}, 2),
         ("llama", {"num_key_value_heads": 1}, 2), ("qwen2", {}, 4)]


@pytest.mark.slow
@pytest.mark.parametrize("arch, overrides, tp", CASES, ids=[f"{a}-{'kv1-' if o else ''}tp{n}" for a, o, n in CASES])
def test_greedy_tokens_match_one_process(rng, tmp_path, arch, overrides, tp) -> None:
    model_dir = make_hf_model_dir(tmp_path, arch, weight_scale=4.0, **overrides)
    prompts = _prompts(rng, 4)
    want, _ = _generate(model_dir, 1, prompts)
    got, _ = _generate(model_dir, tp, prompts)
    assert got == want
    assert _workers() == [], "the workers outlived their engine"


@pytest.mark.slow
def test_int8_pages_with_smoothing(rng, tmp_path) -> None:
    """The int8 path calibrates its smoothing with a collective forward pass on every rank."""
    model_dir = make_hf_model_dir(tmp_path, "llama", weight_scale=4.0)
    prompts = _prompts(rng, 4)
    want, _ = _generate(model_dir, 1, prompts, kv_cache_dtype="int8")
    got, _ = _generate(model_dir, 2, prompts, kv_cache_dtype="int8")
    agree = sum(a == b for w, g in zip(want, got) for a, b in zip(w, g)) / sum(map(len, want))
    assert agree >= 0.9, (agree, want, got)  # the ranks round their own heads; the first tokens agree
    assert [w[0] for w in want] == [g[0] for g in got]


@pytest.mark.slow
def test_vocab_split_unevenly_and_seeded_sampling(rng, tmp_path) -> None:
    """A prime vocabulary (the last rank's LM head rows padded) with tied embeddings: the gathered
    logits are the whole distribution in order, so seeded sampling with top-k/top-p draws the
    same tokens as one process."""
    model_dir = make_hf_model_dir(tmp_path, "qwen3", weight_scale=4.0, vocab_size=509, tie_word_embeddings=True)
    prompts = _prompts(rng, 4, vocab=509)
    sampling = SamplingParams(max_tokens=12, temperature=0.9, top_k=50, top_p=0.95, seed=rng.randrange(2**31),
                              ignore_eos=True)
    want, _ = _generate(model_dir, 1, prompts, sampling)
    got, _ = _generate(model_dir, 2, prompts, sampling)
    assert got == want


@pytest.mark.slow
def test_prompt_logprobs_and_logit_bias(rng, tmp_path) -> None:
    """Prompt logprobs make the LM head run on prompt positions too, a collective every rank must
    join in the same slices: chunked prompts give the same values and tokens as one process, with
    logit_bias and min_tokens in the same batch."""
    model_dir = make_hf_model_dir(tmp_path, "qwen3", weight_scale=4.0, vocab_size=509)
    prompts = _prompts(rng, 3, vocab=509)
    sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, prompt_logprobs=3,
                        logit_bias={7: 3.0}, min_tokens=2)
    small = {"max_num_batched_tokens": 16, "decode_stall_factor": 0}  # several chunks a prompt, as in both runs

    def run(tp: int):
        engine = EngineCore(_config(model_dir, tp, **small))
        try:
            for i, prompt in enumerate(prompts):
                engine.add_request(f"r{i}", prompt, sp)
            tokens, entries = {}, {}
            while engine.has_unfinished():
                for o in engine.step():
                    tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
                    if o.prompt_logprobs is not None:
                        entries[o.request_id] = o.prompt_logprobs
            return tokens, entries
        finally:
            engine.close()

    want_tokens, want = run(1)
    got_tokens, got = run(2)
    assert got_tokens == want_tokens
    assert sorted(got) == sorted(want) == [f"r{i}" for i in range(3)]
    for rid, entries in want.items():
        assert [e.token_id for e in got[rid]] == [e.token_id for e in entries]
        assert [e.logprob for e in got[rid]] == pytest.approx([e.logprob for e in entries], abs=1e-4)
        assert [[t for t, _ in e.top] for e in got[rid]] == [[t for t, _ in e.top] for e in entries]
    assert _workers() == [], "the workers outlived their engine"


@pytest.mark.slow
def test_preemption_and_prefix_caching(rng, tmp_path) -> None:
    """A pool too small for the batch preempts and recomputes; shared prefixes hit the cache. Both
    touch only rank 0's block manager: the workers' pools follow the same block ids."""
    model_dir = make_hf_model_dir(tmp_path, "qwen2", weight_scale=4.0)
    prefix = [rng.randrange(3, 512) for _ in range(40)]
    prompts = [prefix + [rng.randrange(3, 512) for _ in range(rng.randint(1, 8))] for _ in range(6)]
    sampling = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    # 18 blocks a request, 10 shared; the stall bound off, so that the two runs schedule alike
    # (it chunks prompts by step times, which differ between one rank and two)
    small = {"num_kv_blocks": 30, "block_size": 4, "max_num_seqs": 6, "decode_stall_factor": 0}
    want, one = _generate(model_dir, 1, prompts, sampling, **small)
    got, two = _generate(model_dir, 2, prompts, sampling, **small)
    assert got == want
    stats = two.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0, stats
    assert stats.num_preemptions == one.stats().num_preemptions


@pytest.mark.slow
def test_through_the_grpc_service_in_the_engine_process(rng, tmp_path) -> None:
    model_dir = make_hf_model_dir(tmp_path, "llama", weight_scale=4.0)
    prompt = _prompts(rng, 1)[0]
    with BackgroundServer(ServerConfig(port=0, grace_s=2), _config(model_dir, 1)) as s, Client(s.address) as c:
        want = c.generate(prompt, max_tokens=10, temperature=0, ignore_eos=True).token_ids
    with BackgroundServer(ServerConfig(port=0, grace_s=2, engine_process=True), _config(model_dir, 2)) as s:
        with Client(s.address, timeout=60) as c:
            assert c.generate(prompt, max_tokens=10, temperature=0, ignore_eos=True).token_ids == want
            assert [t for d in c.stream(prompt, max_tokens=10, temperature=0, ignore_eos=True) for t in d.token_ids] \
                == want
        workers = _workers(s.pie.engine_client.pid)
        assert len(workers) == 1
    wait_until(lambda: not any(alive(pid) for pid in workers), what="the worker to end with its server")


@pytest.mark.slow
def test_a_dead_worker_ends_the_engine(tmp_path) -> None:
    model_dir = make_hf_model_dir(tmp_path, "llama", weight_scale=4.0)
    with BackgroundServer(ServerConfig(port=0, grace_s=1), _config(model_dir, 2)) as s, \
            Client(s.address, timeout=60) as c:
        assert c.generate("hello", max_tokens=3, ignore_eos=True).completion_tokens == 3
        (worker,) = _workers()
        os.kill(worker, signal.SIGKILL)
        wait_until(lambda: not alive(worker), what="the worker to die")
        with pytest.raises(Unavailable) as err:
            c.generate("hello", max_tokens=3, ignore_eos=True)
        assert err.value.reason == "ENGINE_STOPPED", err.value
        wait_until(lambda: s.pie.fatal.is_set(), what="the server to give up on its engine")
        assert "tensor-parallel worker rank 1 exited" in str(s.pie.engine_client.dead)


@pytest.mark.slow
def test_a_hung_worker_trips_the_step_watchdog(tmp_path) -> None:
    model_dir = make_hf_model_dir(tmp_path, "llama", weight_scale=4.0)
    with BackgroundServer(ServerConfig(port=0, grace_s=1, step_timeout_s=2.0), _config(model_dir, 2)) as s, \
            Client(s.address, timeout=60) as c:
        assert c.generate("hello", max_tokens=3, ignore_eos=True).completion_tokens == 3
        (worker,) = _workers()
        os.kill(worker, signal.SIGSTOP)
        try:
            started = time.monotonic()
            with pytest.raises(Unavailable):
                c.generate("hello", max_tokens=3, ignore_eos=True)
            assert time.monotonic() - started < 30
            assert s.pie.fatal.is_set()
        finally:
            os.kill(worker, signal.SIGCONT)
            os.kill(worker, signal.SIGKILL)


def test_a_size_that_does_not_divide_the_heads_is_refused_before_any_process(tmp_path) -> None:
    model_dir = make_hf_model_dir(tmp_path, "llama")  # 4 query heads, 2 KV heads, MLP 128
    with pytest.raises(ValueError, match="--tensor-parallel-size 3 cannot split this model: num_attention_heads 4"):
        EngineCore(_config(model_dir, 3))
    assert _workers() == []


def test_more_ranks_than_visible_gpus_is_refused() -> None:
    import torch

    from pie.engine.runner.tensor_parallel import check_devices

    check_devices(torch.device("cpu"), 4, 0)  # gloo ranks share the CPU
    check_devices(torch.device("cuda"), 2, 2)
    check_devices(torch.device("cuda", 2), 2, 4)
    with pytest.raises(ValueError, match=r"--tensor-parallel-size 2 needs GPUs cuda:0\.\.cuda:1, one per rank, "
                                         r"but 1 is visible"):
        check_devices(torch.device("cuda"), 2, 1)
    with pytest.raises(ValueError, match=r"needs GPUs cuda:3\.\.cuda:4, one per rank, but 4 are visible"):
        check_devices(torch.device("cuda", 3), 2, 4)


def _two_gpus() -> None:
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs (NCCL puts one rank on each); {torch.cuda.device_count()} visible")


@pytest.mark.slow
@pytest.mark.gpu
@pytest.mark.parametrize("overrides", [{}, {"num_key_value_heads": 1}], ids=["gqa", "kv1"])
def test_greedy_tokens_match_one_gpu_with_nccl(rng, tmp_path, overrides) -> None:
    """Two GPUs, NCCL, the Triton kernels on each rank's heads: fp32 weights and pages give the
    single GPU's greedy tokens."""
    _two_gpus()
    model_dir = make_hf_model_dir(tmp_path, "llama", weight_scale=4.0, head_dim=64, **overrides)
    prompts = _prompts(rng, 6)
    kw = {"device": "cuda", "dtype": "fp32", "cpu_threads": None}
    want, _ = _generate(model_dir, 1, prompts, **kw)
    got, _ = _generate(model_dir, 2, prompts, **kw)
    assert got == want
    assert _workers() == [], "the workers outlived their engine"


@pytest.mark.slow
@pytest.mark.gpu
def test_int8_pages_in_bf16_on_two_gpus(rng, tmp_path) -> None:
    """The served configuration (bf16 weights, int8 pages, smoothing) on two GPUs against one:
    sharded sums round differently in bf16, so greedy tokens agree mostly, not exactly."""
    _two_gpus()
    model_dir = make_hf_model_dir(tmp_path, "qwen2", weight_scale=4.0, head_dim=64)
    prompts = _prompts(rng, 8)
    kw = {"device": "cuda", "dtype": "bf16", "kv_cache_dtype": "int8", "cpu_threads": None}
    want, _ = _generate(model_dir, 1, prompts, **kw)
    got, _ = _generate(model_dir, 2, prompts, **kw)
    same = sum(a == b for w, g in zip(want, got) for a, b in zip(w, g))
    assert same / sum(map(len, want)) >= 0.9, (want, got)
