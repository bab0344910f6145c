"""The batch-invariant mode (EngineConfig.batch_invariant, `pie serve --batch-invariant`): a seeded
request's logits are the same bits, and so its tokens the same, whether its prompt was computed
in one step (cold), read back from the prefix cache or computed in chunks, and whether it runs
alone or beside 7 or 63 other requests.

Without the mode the GPU does not hold this (cuBLAS picks a matrix product's kernel by the rows of
the step; benchmarks/seed_consistency.py measures how often tokens part), nor does the CPU's torch
path to the bit (its fp32 products round a row differently below 16 rows: test_seed_consistency.py
allows for that). The GPU tests hold the bits. On the CPU the mode runs the same Triton kernels
under Triton's interpreter, which cannot hold them: it computes a dot with numpy, whose fp32
products go to BLAS and round a row by its position in the tile, and a query's row moves with its
chunk's start (measured: a cold and a chunked prompt's attention output apart by ~3e-8 at the
chunk's first row). So the CPU test holds the mode's wiring (every projection, norm and attention
call on its invariant path) and the CPU's own promise through it, the same tokens up to float
rounding (test_seed_consistency.assert_same).
"""

from __future__ import annotations

import pytest
import torch

from pie.engine.config import EngineConfig
from pie.engine.core.engine_core import EngineCore
from pie.engine.sampling_params import SamplingParams
from pie.kernels import triton_matmul
from pie.model.layers import Linear, RMSNorm
from tests.engine.sample.test_seed_consistency import Run, assert_same
from tests.helpers import make_hf_model_dir

BLOCK = 16


def _engine(model_dir, kv: str, device: str, **kw) -> EngineCore:
    cfg = dict(model=str(model_dir), device=device, dtype="fp32" if device == "cpu" else "bf16", kv_cache_dtype=kv,
               block_size=BLOCK, num_kv_blocks=256 if device == "cpu" else 4096, max_num_seqs=64,
               max_num_batched_tokens=512, attention_backend="triton", batch_invariant=True)
    return EngineCore(EngineConfig(**{**cfg, **kw}))


def _requests(rng, n: int, vocab: int, sampled: bool, max_tokens: int, tag: str = "p", first_len: int | None = None):
    """n seeded (or greedy) requests of 33 to 47 prompt tokens (`first_len`: the first one's)."""
    out = {}
    for i in range(n):
        length = first_len if i == 0 and first_len is not None else 2 * BLOCK + rng.randrange(1, BLOCK)
        prompt = [rng.randrange(3, vocab) for _ in range(length)]
        sp = (SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=rng.randrange(2**32), ignore_eos=True)
              if sampled else SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
        out[f"{tag}{i}"] = (prompt, sp)
    return out


def assert_identical(first: Run, rid: str, other: Run, other_rid: str, what: str) -> None:
    """The same tokens, each sampled from the same logits to the bit."""
    assert other.tokens[other_rid] == first.tokens[rid], f"{what}: tokens differ"
    for i in range(len(first.tokens[rid])):
        a, b = first.logits[(rid, i)], other.logits[(other_rid, i)]
        assert torch.equal(a, b), f"{what}: the logits of token {i} differ by {float((a - b).abs().max()):.2e}"


def check_one_answer_per_seed(model_dir, kv: str, device: str, sampled: bool, rng, *, batches: tuple[int, ...],
                              max_tokens: int, vocab: int) -> None:
    """Two requests cold (together), again (their full prompt blocks cached), chunked (16 prompt
    tokens a step), alone (caching off), and beside b - 1 other requests for each b in `batches`.
    The first prompt is two blocks and one token: cached, or in chunks, its last token runs alone in
    its row, where a running decode's token would take the decode kernel."""
    requests = _requests(rng, 2, vocab, sampled, max_tokens, first_len=2 * BLOCK + 1)
    engine = _engine(model_dir, kv, device)
    cold = Run(engine, requests)
    hits = engine.block_manager.prefix_cache_hits
    cached = Run(engine, {f"{rid}-again": r for rid, r in requests.items()})
    assert engine.block_manager.prefix_cache_hits - hits >= 2 * 2 * BLOCK  # every full prompt block
    chunked = Run(_engine(model_dir, kv, device, max_num_batched_tokens=BLOCK), requests)
    alone_engine = _engine(model_dir, kv, device, enable_prefix_caching=False)
    for rid in requests:
        assert_identical(cold, rid, cached, f"{rid}-again", f"{kv} cached prefix")
        assert_identical(cold, rid, chunked, rid, f"{kv} chunked prefill")
        assert_identical(cold, rid, Run(alone_engine, {rid: requests[rid]}), rid, f"{kv} alone")
    for b in batches:
        others = _requests(rng, b - 1, vocab, sampled, max_tokens + rng.randrange(8), tag=f"b{b}-")
        batch = Run(alone_engine, {"p0": requests["p0"], **others})
        assert_identical(cold, "p0", batch, "p0", f"{kv} in a batch of {b}")


@pytest.mark.slow
def test_the_mode_on_the_interpreter(tmp_path, rng):
    """Every projection through the invariant matmul, every norm row by row, decode at fixed splits
    and prompts through the extend kernel at fixed tiles; and through that path a seeded request
    keeps the CPU's promise cold, cached, chunked, alone and in a batch of 8 (fp32 weights, fp16
    pages; the interpreter computes bf16 wrongly)."""
    if torch.cuda.is_available():
        pytest.skip("the GPU runs the mode compiled: test_one_answer_per_seed_on_gpu")
    model_dir = make_hf_model_dir(tmp_path, "qwen3", weight_scale=3.0, num_hidden_layers=1)
    engine = _engine(model_dir, "fp16", "cpu")
    linears = [m for m in engine.model.modules() if isinstance(m, Linear)]
    norms = [m for m in engine.model.modules() if isinstance(m, RMSNorm)]
    assert len(linears) == 5 and all(m.matmul is triton_matmul.linear for m in linears)
    assert len(norms) == 5 and all(m.per_row and m.fused is not None for m in norms)  # q/k norms included
    ops = engine.runner.attention.ops
    assert ops.batch_invariant and ops._invariant_split == 1024

    requests = _requests(rng, 2, 512, True, 6)
    cold = Run(engine, requests)
    cached = Run(engine, {f"{rid}-again": r for rid, r in requests.items()})
    chunked = Run(_engine(model_dir, "fp16", "cpu", max_num_batched_tokens=BLOCK), requests)
    alone_engine = _engine(model_dir, "fp16", "cpu", enable_prefix_caching=False)
    others = _requests(rng, 7, 512, True, 8, tag="b-")
    batch = Run(alone_engine, {"p0": requests["p0"], **others})
    for rid, (_, sp) in requests.items():
        assert_same(cold, rid, cached, f"{rid}-again", sp, "fp16", "cached prefix")
        assert_same(cold, rid, chunked, rid, sp, "fp16", "chunked prefill")
        assert_same(cold, rid, Run(alone_engine, {rid: requests[rid]}), rid, sp, "fp16", "alone")
    assert_same(cold, "p0", batch, "p0", requests["p0"][1], "fp16", "in a batch of 8")


@pytest.mark.gpu
@pytest.mark.parametrize("kv", ["int8", "bf16"])
@pytest.mark.parametrize("sampled", [True, False], ids=["sampled", "greedy"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_one_answer_per_seed_on_gpu(tmp_path, arch, kv, sampled, rng):
    """bf16 weights, CUDA graphs on: alone, in batches of 8 and 64, cold, cached and chunked."""
    model_dir = make_hf_model_dir(tmp_path, arch, weight_scale=3.0, hidden_size=512, intermediate_size=1024,
                                  num_attention_heads=8, num_key_value_heads=2, num_hidden_layers=4)
    check_one_answer_per_seed(model_dir, kv, "cuda", sampled, rng, batches=(8, 64), max_tokens=24, vocab=512)


@pytest.mark.gpu
@pytest.mark.parametrize("kv", ["int8", "bf16"])
def test_a_prompt_token_alone_in_its_step_on_gpu(tmp_path, kv, rng):
    """A prompt one token past its cached blocks, alone (every row of the step one token: the
    piecewise graphs, not the decode graph) and beside a running decode, gives cold's logits to the
    bit; CUDA graphs on."""
    model_dir = make_hf_model_dir(tmp_path, "qwen3", weight_scale=3.0, hidden_size=512, intermediate_size=1024,
                                  num_attention_heads=8, num_key_value_heads=2, num_hidden_layers=4)
    engine = _engine(model_dir, kv, "cuda")
    assert engine.runner.pieces.pieces, "the piecewise graphs are captured"
    prompt = [rng.randrange(3, 512) for _ in range(2 * BLOCK + 1)]
    sp = SamplingParams(max_tokens=16, temperature=1.0, seed=rng.randrange(2**32), ignore_eos=True)
    cold = Run(engine, {"cold": (prompt, sp)})
    assert_identical(cold, "cold", Run(engine, {"again": (prompt, sp)}), "again", f"{kv} alone over its cached prefix")
    other = [rng.randrange(3, 512) for _ in range(BLOCK + 3)]
    engine.add_request("other", other, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    engine.step()
    engine.step()  # "other" decodes from here on
    beside = Run(engine, {"third": (prompt, sp)})
    assert_identical(cold, "cold", beside, "third", f"{kv} beside a running decode")


@pytest.mark.gpu
@pytest.mark.parametrize("kv", ["int8", "bf16"])
def test_a_preempted_request_keeps_its_bits_on_gpu(tmp_path, kv, rng):
    """Eight seeded requests in a pool too small for them (recomputed after preemption, outputs one
    a step) give the logits of a pool that holds them all, to the bit; CUDA graphs on."""
    model_dir = make_hf_model_dir(tmp_path, "llama", weight_scale=3.0, hidden_size=512, intermediate_size=1024,
                                  num_attention_heads=8, num_key_value_heads=2, num_hidden_layers=4)
    requests = _requests(rng, 8, 512, True, 48)
    ample = Run(_engine(model_dir, kv, "cuda"), requests)
    tight_engine = _engine(model_dir, kv, "cuda", num_kv_blocks=24)
    tight = Run(tight_engine, requests)
    assert tight_engine.stats().num_preemptions > 0
    for rid in requests:
        assert_identical(ample, rid, tight, rid, f"{kv} recomputed after preemption")


def _routed_engine(model_dir, invariant: bool, **kw) -> tuple[EngineCore, list, list]:
    """A CPU engine whose runner routes one-token prompt rows as the batch-invariant mode does
    (`invariant`) or as by default, recording each step's (decode rows, rows) as staged and each
    attention call's (kernel, query rows)."""
    engine = EngineCore(EngineConfig(**{**dict(model=str(model_dir), device="cpu", dtype="fp32", block_size=BLOCK,
                                               num_kv_blocks=64, max_num_batched_tokens=64), **kw}))
    runner = engine.runner
    runner.stager.prompt_rows_decode = runner.graphs.prompt_rows_decode = not invariant
    ops, stager = runner.attention.ops, runner.stager
    calls: list[tuple[str, int]] = []
    staged: list[tuple[int, int]] = []
    decode, extend, stage = ops.decode, ops.extend, stager.stage

    def decode_spy(q, *a, **kw):
        calls.append(("decode", q.shape[0]))
        return decode(q, *a, **kw)

    def extend_spy(q, *a, **kw):
        calls.append(("extend", q.shape[0]))
        return extend(q, *a, **kw)

    def stage_spy(out, *a, **kw):
        step = stage(out, *a, **kw)
        staged.append((step.facts.num_decodes, len(out.scheduled)))
        return step

    ops.decode, ops.extend, stager.stage = decode_spy, extend_spy, stage_spy
    return engine, calls, staged


@pytest.mark.parametrize("invariant", [False, True], ids=["default", "invariant"])
def test_a_prompt_token_alone_in_its_row_is_attended_as_a_prompt(tmp_path, rng, invariant):
    """The decode and extend kernels round one query differently, so in the batch-invariant mode
    a prompt's tokens take the extend kernel however its chunks fall: its last token alone after a
    cached prefix, or beside running decodes, is not a decode row (on the GPU it was, and a prompt
    over its cached prefix parted from cold at its first logits). By default such a row attends as
    a decode, in the decode step's graph where there is one. Checked on the routing (the staged
    decode rows and the attention calls) on the CPU's torch path."""
    model_dir = make_hf_model_dir(tmp_path, "llama")  # 2 layers
    prompt = [rng.randrange(3, 512) for _ in range(2 * BLOCK + 1)]
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    engine, calls, staged = _routed_engine(model_dir, invariant)
    Run(engine, {"cold": (prompt, greedy)})
    # the prompt again over its two cached blocks: one row of one prompt token
    calls.clear(), staged.clear()
    engine.add_request("again", prompt, greedy)
    engine.step()
    assert engine.block_manager.prefix_cache_hits == 2 * BLOCK
    assert staged == [(0, 1) if invariant else (1, 1)]
    assert calls == ([("extend", 1)] if invariant else [("decode", 1)]) * 2
    # the same beside a running decode (which comes first in the step)
    engine.add_request("third", prompt, greedy)
    calls.clear(), staged.clear()
    engine.step()
    assert staged == [(1, 2) if invariant else (2, 2)]
    assert calls == ([("decode", 1), ("extend", 1)] if invariant else [("decode", 2)]) * 2
    engine.abort_all()


def test_a_preempted_request_recomputes_its_outputs_as_decodes(tmp_path, rng):
    """In the batch-invariant mode a request recomputed after preemption runs its prompt in chunks
    (never past it) and then each output token alone, staged among the step's leading decode rows,
    as when it was first decoded; the tokens are those of a run without preemption. Checked on the
    routing, on the CPU's torch path, with a pool too small for every request at once."""
    model_dir = make_hf_model_dir(tmp_path, "llama")
    requests = [(f"q{i}", [rng.randrange(3, 512) for _ in range(rng.randrange(5, 30))],
                 SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)) for i in range(6)]
    engine, calls, staged = _routed_engine(model_dir, True, num_kv_blocks=24, block_size=4)
    engine.scheduler.batch_invariant = True
    rows = []
    schedule = engine.scheduler.schedule

    def recording():
        out = schedule()
        rows.append([(s.start, s.num_new_tokens, s.request.num_prompt_tokens, s.sample) for s in out.scheduled])
        return out

    engine.scheduler.schedule = recording
    tokens = Run(engine, {rid: (prompt, sp) for rid, prompt, sp in requests}).tokens
    assert engine.stats().num_preemptions > 0
    recomputed = 0
    for step, (nd, b) in zip(rows, staged, strict=True):
        assert len(step) == b
        for i, (start, n, prompt_len, sample) in enumerate(step):
            if start >= prompt_len:  # a generated token's row: one token, a decode row
                assert n == 1 and i < nd, step
                recomputed += not sample  # an output token computed again (a decode samples)
            else:
                assert start + n <= prompt_len and i >= nd, step  # a prompt chunk, never past it
    assert recomputed > 0
    plain = EngineCore(EngineConfig(model=str(model_dir), device="cpu", dtype="fp32", block_size=4, num_kv_blocks=256))
    assert Run(plain, {rid: (prompt, sp) for rid, prompt, sp in requests}).tokens == tokens


def test_the_mode_refuses_what_it_cannot_hold(tmp_path):
    """The torch attention path, tensor parallelism and speculation are refused by name; on the CPU
    the mode needs the Triton path asked for (the interpreter), not the default torch one."""
    with pytest.raises(ValueError, match="attention_backend='torch'"):
        EngineConfig(batch_invariant=True, attention_backend="torch")
    with pytest.raises(ValueError, match="tensor parallelism"):
        EngineConfig(batch_invariant=True, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="speculative"):
        EngineConfig(batch_invariant=True, speculative="ngram")
    if torch.cuda.is_available():
        return
    model_dir = make_hf_model_dir(tmp_path, "llama")
    with pytest.raises(ValueError, match="needs CUDA"):
        EngineCore(EngineConfig(model=str(model_dir), device="cpu", batch_invariant=True, num_kv_blocks=16))
