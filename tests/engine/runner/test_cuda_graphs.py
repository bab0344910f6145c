"""Step inputs, CUDA-graph buckets and padding, and (on a GPU) graphs against the eager forward,
graphs under tensor parallelism (a worker's replay, NCCL collectives captured) and the KV pool
sized from free memory."""

from __future__ import annotations

import dataclasses
import random
import time

import pytest
import torch
import torch.distributed as dist

from pie.engine.config import EngineConfig
from pie.engine.core.engine_core import EngineCore
from pie.engine.errors import StartupError
from pie.engine.runner import kv_sizing
from pie.engine.runner import warm_up as warm_up_module
from pie.engine.runner.cuda_graphs import graph_buckets, mixed_buckets
from pie.engine.runner.kv_cache import KVCache
from pie.engine.runner.kv_sizing import CPU_KV_CACHE_BYTES, num_kv_blocks
from pie.engine.runner.model_runner import ModelRunner
from pie.engine.runner.step_layout import StepFacts
from pie.engine.runner.tensor_parallel import OP_FORWARD, Leader, destroy_group, follow
from pie.engine.runner.warm_up import profile, warm_up
from pie.engine.sampling_params import SamplingParams
from pie.engine.scheduling.request import Request
from pie.engine.scheduling.step import ScheduledRequest, SchedulerOutput
from pie.model.parallel import TensorParallel
from tests.helpers import make_hf_model_dir

# A forward header's numbers (engine/runner/tensor_parallel.py): the step's facts, then the rows, the
# table width and the graph bucket.
GRAPH_BATCH = len(dataclasses.fields(StepFacts)) + 2


def test_graph_buckets():
    assert graph_buckets(1) == [1]
    assert graph_buckets(6) == [1, 2, 4, 6]
    assert graph_buckets(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert graph_buckets(40) == [1, 2, 4, 8, 16, 32, 40]
    for m in range(1, 300):
        b = graph_buckets(m)
        assert b[-1] == m and b == sorted(set(b))
        assert all(hi - lo <= 16 for lo, hi in zip(b, b[1:]))  # a batch pads by at most 15 rows


def test_mixed_buckets():
    assert mixed_buckets(0) == []
    assert mixed_buckets(40) == [16, 32, 40]
    assert mixed_buckets(2048)[:10] == [16, 32, 48, 64, 80, 96, 112, 128, 160, 192]
    for m in (1, 100, 129, 513, 1000, 2048, 3000, 8192):
        b = mixed_buckets(m)
        assert b[-1] == m and b == sorted(set(b))
        for lo, hi in zip([0, *b], b):  # a step of lo + 1 tokens pads to hi
            pad = hi - (lo + 1)
            assert pad < 16 or pad < (lo + 1) / (8 if lo >= 512 else 4), (lo, hi)


def _runner(block_size=4, max_num_seqs=8, max_model_len=64) -> ModelRunner:
    cache = KVCache(num_layers=1, num_blocks=64, block_size=block_size, num_kv_heads=1, head_dim=8,
                    kv_cache_dtype="fp32", device=torch.device("cpu"))
    return ModelRunner(torch.nn.Identity(), cache, vocab_size=32, softmax_scale=1.0, device=torch.device("cpu"),
                       max_num_seqs=max_num_seqs, max_num_batched_tokens=64, max_model_len=max_model_len)


def _scheduled(rng: random.Random, prompt_len: int, start: int, n: int, block_size: int) -> ScheduledRequest:
    req = Request(f"r{rng.random()}", [rng.randrange(32) for _ in range(prompt_len)], SamplingParams(),
                  max_model_len=64)
    req.block_ids = rng.sample(range(64), -(-(start + n) // block_size))  # shuffled physical blocks
    return ScheduledRequest(req, n, start, start + n == prompt_len)


def test_stage_packs_a_mixed_batch(rng):
    """Positions, slots, lengths and query offsets of a mixed step, against a per-token loop."""
    runner = _runner()
    # a decode, a prefill chunk in the middle of a prompt, a whole prompt
    sched = [_scheduled(rng, 10, 9, 1, 4), _scheduled(rng, 30, 8, 7, 4), _scheduled(rng, 5, 0, 5, 4)]
    step = runner.stager.stage(SchedulerOutput(scheduled=sched), [s.request.block_ids for s in sched], None, None)
    want_ids, want_pos, want_slots = [], [], []
    for s in sched:
        for p in range(s.start, s.start + s.num_new_tokens):
            want_ids.append(s.request.prompt_token_ids[p])
            want_pos.append(p)
            want_slots.append(s.request.block_ids[p // 4] * 4 + p % 4)
    assert step.input_ids.tolist() == want_ids
    assert step.positions.tolist() == want_pos
    md = step.metadata
    assert md.slot_mapping.tolist() == want_slots
    assert md.seq_lens.tolist() == [10, 15, 5]
    assert md.query_start_loc.tolist() == [0, 1, 8, 13]
    assert md.max_query_len == 7 and md.max_seq_len == 15
    for i, s in enumerate(sched):
        assert md.block_tables[i, :len(s.request.block_ids)].tolist() == s.request.block_ids
    assert step.graph_batch is None
    # the prefill part: the keys its attention gathers from the pages
    assert md.num_decodes == 1 and md.prefill_kv_tokens == 15 + 5


def test_stage_pads_a_decode_batch_for_its_graph(rng):
    """Rows past the batch: slot -1 (never written), length 0 (nothing attended), one query each."""
    runner = _runner()
    sched = [_scheduled(rng, 6 + i, 5 + i, 1, 4) for i in range(3)]
    step = runner.stager.stage(SchedulerOutput(scheduled=sched), [s.request.block_ids for s in sched], 8, None)
    md = step.metadata
    assert step.input_ids.shape == (8,) and step.graph_batch == 8 and step.num_seqs == 3
    assert step.input_ids.tolist()[3:] == [0] * 5
    assert step.positions.tolist() == [5, 6, 7] + [0] * 5
    assert md.slot_mapping.tolist()[3:] == [-1] * 5
    assert md.slot_mapping.tolist()[:3] == [s.request.block_ids[s.start // 4] * 4 + s.start % 4 for s in sched]
    assert md.seq_lens.tolist() == [6, 7, 8, 0, 0, 0, 0, 0]
    assert md.query_start_loc.tolist() == list(range(9))
    # the buffers are reused: a smaller eager step afterwards sees only its own values
    step2 = runner.stager.stage(SchedulerOutput(scheduled=sched[:1]), [sched[0].request.block_ids], None, None)
    assert step2.metadata.seq_lens.tolist() == [6] and step2.metadata.query_start_loc.tolist() == [0, 1]


def test_profile_step_runs_on_the_cpu(tmp_path):
    """The profiling step that sizes the KV pool on CUDA (every sampler feature on) runs anywhere."""
    engine = EngineCore(EngineConfig(model=str(make_hf_model_dir(tmp_path, "llama")), device="cpu",
                                    kv_cache_dtype="int8", num_kv_blocks=64, max_num_seqs=4))
    profile(engine.runner, [20, 7, 1])
    assert engine.generate([[1, 2, 3]], SamplingParams(max_tokens=3, temperature=0)) != []


def _decoding_engine(model_dir, batch: int, rng: random.Random, **kw) -> tuple[EngineCore, SchedulerOutput]:
    engine = EngineCore(EngineConfig(model=str(model_dir), device="cuda", dtype="bf16", max_num_seqs=16,
                                    kv_cache_memory_bytes=64 << 20, **kw))
    for i in range(batch):
        engine.add_request(f"r{i}", [rng.randrange(3, 500) for _ in range(rng.randint(5, 40))],
                           SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
    for _ in range(3):
        engine.step()
    out = engine.scheduler.schedule()
    assert all(s.num_new_tokens == 1 for s in out.scheduled) and len(out.scheduled) == batch
    return engine, out


@pytest.mark.gpu
@pytest.mark.parametrize("kv_cache_dtype", ["int8", "bf16"])
@pytest.mark.parametrize("batch", [3, 8, 16])
def test_graph_replay_matches_the_eager_forward(rng, tmp_path, batch, kv_cache_dtype):
    """A decode step replayed from its bucket's graph (3 rows pad to 4) gives the eager logits."""
    engine, out = _decoding_engine(make_hf_model_dir(tmp_path, "llama", weight_scale=4.0), batch, rng,
                                   kv_cache_dtype=kv_cache_dtype)
    assert engine.runner.graphs.bucket_for(out) == {3: 4, 8: 8, 16: 16}[batch]
    with torch.inference_mode():
        torch.cuda.synchronize()
        rows_g, graph_logits = engine.runner.forward_logits(out)
        graph_logits = graph_logits.clone()
        rows_e, eager_logits = engine.runner.forward_logits(out, eager=True)
    assert rows_g == rows_e == list(range(batch))
    err = ((graph_logits - eager_logits).abs().max() / eager_logits.abs().max()).item()
    assert err <= 2e-2, f"graph vs eager relative logit error {err:.3e}"
    agree = (graph_logits.argmax(-1) == eager_logits.argmax(-1)).float().mean().item()
    assert agree >= 0.9


@pytest.mark.gpu
@pytest.mark.parametrize("family,kv_cache_dtype,decodes", [("llama", "int8", 5), ("llama", "bf16", 5),
                                                           ("qwen3", "int8", 3), ("llama", "int8", 0)])
def test_piecewise_replay_matches_the_eager_forward(rng, tmp_path, family, kv_cache_dtype, decodes):
    """A step with prompt tokens (beside running decodes, or alone) replayed from the piecewise
    graphs of its token bucket, padding rows included, gives the eager logits."""
    model_dir = make_hf_model_dir(tmp_path, family, weight_scale=4.0)
    engine = EngineCore(EngineConfig(model=str(model_dir), device="cuda", dtype="bf16", max_num_seqs=16,
                                    kv_cache_memory_bytes=64 << 20, kv_cache_dtype=kv_cache_dtype,
                                    decode_stall_factor=0.0, max_num_batched_tokens=512))
    assert engine.runner.pieces and max(engine.runner.pieces.pieces) == 512
    sp = SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)
    for i in range(decodes):
        engine.add_request(f"d{i}", [rng.randrange(3, 500) for _ in range(rng.randint(5, 40))], sp)
    for _ in range(3 if decodes else 0):
        engine.step()
    for i, n in enumerate((37, 151)):  # a new prompt of 37 tokens, another of 151
        engine.add_request(f"p{i}", [rng.randrange(3, 500) for _ in range(n)], sp)
    out = engine.scheduler.schedule()
    tokens = sum(s.num_new_tokens for s in out.scheduled)
    assert tokens == decodes + 188 and len(out.scheduled) == decodes + 2
    bucket = engine.runner.pieces.bucket_for(tokens)
    assert bucket is not None and bucket > tokens  # padding rows computed, never read
    with torch.inference_mode():
        torch.cuda.synchronize()
        rows_p, piece_logits = engine.runner.forward_logits(out)
        piece_logits = piece_logits.clone()
        rows_e, eager_logits = engine.runner.forward_logits(out, eager=True)
    assert rows_p == rows_e == list(range(decodes + 2))
    err = ((piece_logits - eager_logits).abs().max() / eager_logits.abs().max()).item()
    assert err <= 2e-2, f"piecewise vs eager relative logit error {err:.3e}"
    agree = (piece_logits.argmax(-1) == eager_logits.argmax(-1)).float().mean().item()
    assert agree >= 0.9


@pytest.mark.gpu
def test_graphs_and_eager_generate_alike(rng, tmp_path):
    """Whole greedy generations with graphs (default) and with --enforce-eager."""
    model_dir = make_hf_model_dir(tmp_path, "qwen3", weight_scale=4.0)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randint(5, 60))] for _ in range(11)]
    sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    runs = []
    for eager in (False, True):
        engine = EngineCore(EngineConfig(model=str(model_dir), device="cuda", dtype="bf16", max_num_seqs=16,
                                        kv_cache_memory_bytes=64 << 20, enforce_eager=eager))
        assert bool(engine.runner.graphs) != eager and bool(engine.runner.pieces) != eager
        runs.append(engine.generate(prompts, sp))
    same = sum(a == b for ga, gb in zip(*runs) for a, b in zip(ga, gb))
    assert same / sum(len(g) for g in runs[1]) >= 0.9


class _RecordingLink:
    """Rank 0's broadcasts kept in order, then handed out to a follower as if it were a worker
    (engine/runner/tensor_parallel.py's _Link, without the process group)."""

    def __init__(self) -> None:
        self.headers: list[list[int]] = []
        self.tensors: list[torch.Tensor] = []

    def send_header(self, op: int, *numbers: int) -> None:
        self.headers.append([op, *numbers])

    def send(self, tensor: torch.Tensor) -> None:
        self.tensors.append(tensor.clone())

    def recv(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        t = self.tensors.pop(0)
        assert t.numel() == numel and t.dtype == dtype
        return t

    def recv_into(self, out: torch.Tensor) -> torch.Tensor:
        t = self.tensors.pop(0)
        assert t.shape == out.shape and t.dtype == out.dtype
        return out.copy_(t)


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [5, 16])
def test_a_worker_replays_the_graph_rank_0_replays(rng, tmp_path, batch):
    """Tensor parallelism's step protocol with graphs: what rank 0 broadcasts before replaying its
    graph (the header naming the bucket, the packed ints, the whole-width tables) lands in a
    follower's own graph buffers, and the follower's graph of that bucket gives rank 0's logits.
    The follower is a second runner over the same model and KV pool, on one GPU."""
    engine, out = _decoding_engine(make_hf_model_dir(tmp_path, "llama", weight_scale=4.0), batch, rng,
                                   kv_cache_dtype="int8")
    follower = ModelRunner.for_model(engine.model, engine.kv_cache, engine.config, engine.device,
                                     engine.max_model_len)
    follower.capture_cuda_graphs()  # its dummy decodes write no slot (-1)
    leader = Leader.__new__(Leader)  # only its link is used: a recording one
    leader._link = link = _RecordingLink()  # type: ignore[assignment]
    engine.runner._tp = leader
    with torch.inference_mode():
        rows, logits = engine.runner.forward_logits(out)
        op, *numbers = link.headers[0]
        assert op == OP_FORWARD and numbers[GRAPH_BATCH] == {5: 8, 16: 16}[batch]
        follower.graphs.graphs[numbers[GRAPH_BATCH]].logits.fill_(float("nan"))
        follow(follower, numbers, link)  # writes the same K/V to the same slots, reads the same pages
        torch.cuda.synchronize()
    assert rows == list(range(batch)) and not link.tensors
    torch.testing.assert_close(follower.graphs.graphs[numbers[GRAPH_BATCH]].logits[:batch], logits, rtol=0, atol=0)


@pytest.mark.gpu
def test_graphs_capture_the_nccl_collectives(rng, tmp_path):
    """Decode graphs with the layers' all-reduces and the logits' all-gather inside, through a
    one-rank NCCL group on one GPU (as each rank captures them under tensor parallelism): the
    replay gives the eager logits, which the gathered buffer, left unwritten by the capture, can
    only hold if the captured collective runs; then the group is destroyed without hanging."""
    engine, out = _decoding_engine(make_hf_model_dir(tmp_path, "qwen2", weight_scale=4.0), 6, rng,
                                   kv_cache_dtype="int8", enforce_eager=True)
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1)
    try:
        tp = TensorParallel(0, 1)
        for m in engine.model.modules():  # the one-rank share is the whole model: only the collectives differ
            if hasattr(m, "tp"):
                m.tp = tp
        engine.runner.capture_cuda_graphs()
        with torch.inference_mode():
            torch.cuda.synchronize()
            rows_g, graph_logits = engine.runner.forward_logits(out)
            graph_logits = graph_logits.clone()
            rows_e, eager_logits = engine.runner.forward_logits(out, eager=True)
        assert rows_g == rows_e == list(range(6))
        err = ((graph_logits - eager_logits).abs().max() / eager_logits.abs().max()).item()
        assert err <= 2e-2, f"graph vs eager relative logit error {err:.3e}"
        engine.runner.drop_cuda_graphs()
    finally:
        started = time.monotonic()
        destroy_group(timeout_s=30.0)
    assert not dist.is_initialized() and time.monotonic() - started < 30.0


@pytest.mark.gpu
def test_kv_pool_is_sized_from_free_memory(tmp_path):
    model_dir = make_hf_model_dir(tmp_path, "llama")
    torch.cuda.empty_cache()
    engines = {}
    for fraction in (0.3, 0.5):
        free, total = torch.cuda.mem_get_info()
        engine = EngineCore(EngineConfig(model=str(model_dir), device="cuda", gpu_memory_fraction=fraction))
        used = total - torch.cuda.mem_get_info()[0]
        assert used <= fraction * total + (256 << 20), f"{used / 2**30:.2f} GiB in use at fraction {fraction}"
        engines[fraction] = engine.block_manager.num_total_blocks
        del engine
        torch.cuda.empty_cache()
    assert engines[0.5] > engines[0.3] > 0
    with pytest.raises(StartupError, match="--gpu-memory-fraction"):
        EngineCore(EngineConfig(model=str(model_dir), device="cuda", gpu_memory_fraction=1e-6))


def test_kv_sizing_arithmetic_with_a_fake_device(monkeypatch):
    """The free-memory sizing path on the CPU, with the CUDA memory queries faked: budget =
    fraction * total - in use - the profiling step's peak; and the exact and byte-budget paths."""
    gib = 2**30
    fake = dict(synchronize=lambda *a: None, empty_cache=lambda: None, reset_peak_memory_stats=lambda *a: None,
                mem_get_info=lambda *a: (70 * gib, 100 * gib), memory_allocated=lambda *a: 10 * gib,
                max_memory_allocated=lambda *a: 12 * gib)
    for name, fn in fake.items():
        monkeypatch.setattr(torch.cuda, name, fn)
    profiled: list[list[int]] = []
    made: list[int] = []

    class Runner:  # stands for a ModelRunner over n blocks: the sizing only profiles it
        pass

    def make_runner(n: int) -> Runner:
        made.append(n)
        return Runner()

    monkeypatch.setattr(kv_sizing, "profile", lambda runner, lens: profiled.append(lens))

    cfg = EngineConfig(max_num_seqs=4, max_num_batched_tokens=64, gpu_memory_fraction=0.9)
    cuda = torch.device("cuda")
    assert num_kv_blocks(cfg, cuda, 1 << 20, 2048, make_runner) == (90 - 30 - 2) * 1024  # 1 MiB blocks
    assert profiled == [[16, 16, 16, 16]] and made == [64 // 16 + 4]  # one step of the whole budget
    cfg.gpu_memory_fraction = 0.3
    with pytest.raises(StartupError, match="^--gpu-memory-fraction 0.3 of 100.0 GiB leaves no room"):
        num_kv_blocks(cfg, cuda, 1 << 20, 2048, make_runner)
    cfg.gpu_memory_fraction = 0.33  # ~1 GiB left: ~1024 blocks of 16 tokens, fewer than a 32768-token sequence
    with pytest.raises(StartupError, match=r"^--gpu-memory-fraction 0.33 leaves room for 163\d\d tokens of KV cache, "
                                           "fewer than one sequence of 32768 tokens"):
        num_kv_blocks(cfg, cuda, 1 << 20, 32768, make_runner)
    assert num_kv_blocks(EngineConfig(num_kv_blocks=7), cuda, 1 << 20, 2048, make_runner) == 7
    assert num_kv_blocks(EngineConfig(kv_cache_memory_bytes=10 << 20), cuda, 1 << 20, 160, make_runner) == 10
    assert num_kv_blocks(EngineConfig(), torch.device("cpu"), 1 << 20, 2048, make_runner) == CPU_KV_CACHE_BYTES >> 20


def test_warm_up_runs_every_prefill_tile_on_the_cpu(tmp_path, monkeypatch):
    engine = EngineCore(EngineConfig(model=str(make_hf_model_dir(tmp_path, "llama")), device="cpu",
                                    kv_cache_dtype="int8", num_kv_blocks=64, max_num_seqs=4,
                                    max_num_batched_tokens=128))
    seen, mixed = [], []
    monkeypatch.setattr(warm_up_module, "profile", lambda runner, lens: (seen.append(lens[0]), profile(runner, lens)))
    mixed_step = warm_up_module.mixed_step
    monkeypatch.setattr(warm_up_module, "mixed_step", lambda runner, b: (mixed.append(b), mixed_step(runner, b)))
    sampled = []
    execute = engine.runner.execute
    engine.runner.execute = lambda out: sampled.append(execute(out).tokens) or sampled[-1]
    warm_up(engine.runner)
    assert seen == [2, 3, 5, 9, 17, 33, 65]  # 129 > the step's 128-token budget
    # then a step of B decodes beside a prompt chunk for each decode graph bucket (1, 2, 4), the
    # largest one decode short (the chunk takes the fourth row)
    assert mixed == [1, 2, 3]
    assert all(len(s) == b + 1 for s, b in zip(sampled[len(seen):], mixed))  # every row sampled
    assert engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0)) != []
