"""The whole engine path (scheduler -> runner -> paged KV cache -> model) against transformers.

Every hidden state the engine computes, in chunked prefill and in decode, is recorded and turned
into logits; transformers computes the same sequence (prompt + what the engine generated) in one
pass. With the fp32 cache the two must agree to 1e-4 relative; with the int8 cache we measure the
logit error and teacher-forced top-1 agreement (which does not compound along the sequence).
"""

from __future__ import annotations

import random

import pytest
import torch

from pie.engine.config import EngineConfig
from pie.engine.core.engine_core import EngineCore
from pie.engine.sampling_params import SamplingParams
from pie.model.config import ModelConfig
from tests.helpers import ARCHS, make_hf_model_dir

TOLERANCE = 1e-4


class _Recorder(torch.nn.Module):
    """Wraps the model: keeps (request id, position, hidden) for every token the engine runs."""

    def __init__(self, inner, engine: EngineCore):
        super().__init__()
        self.inner = inner
        self.engine = engine
        self.rows: dict[str, dict[int, torch.Tensor]] = {}
        self.step_ids: list[str] = []

    def forward(self, input_ids, positions, attn):
        hidden = self.inner(input_ids, positions, attn)
        qsl = attn.metadata.query_start_loc.tolist()
        for i, rid in enumerate(self.step_ids):
            for t in range(qsl[i], qsl[i + 1]):
                self.rows.setdefault(rid, {})[int(positions[t])] = hidden[t].clone()
        return hidden

    def compute_logits(self, hidden):
        return self.inner.compute_logits(hidden)


def run_recorded(model_dir, kv_cache_dtype: str, prompts: list[list[int]], max_tokens: int, **engine_kwargs):
    engine = EngineCore(EngineConfig(**{
        **dict(model=str(model_dir), device="cpu", kv_cache_dtype=kv_cache_dtype, block_size=16, num_kv_blocks=64,
               max_num_seqs=8, max_num_batched_tokens=24),  # small budget: prompts are prefilled in chunks
        **engine_kwargs}))
    rec = _Recorder(engine.model, engine)
    engine.runner.model = rec
    schedule = engine.scheduler.schedule

    def recording_schedule():
        out = schedule()
        rec.step_ids = [s.request.request_id for s in out.scheduled]
        return out

    engine.scheduler.schedule = recording_schedule
    ids = [f"r{i}" for i in range(len(prompts))]
    outputs = {rid: [] for rid in ids}
    for rid, p in zip(ids, prompts):
        engine.add_request(rid, p, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    while engine.has_unfinished():
        for o in engine.step():
            outputs[o.request_id].extend(o.new_token_ids)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_total_blocks
    results = []
    for rid, p in zip(ids, prompts):
        seq = p + outputs[rid][:-1]  # the last sampled token never goes through the model
        rows = rec.rows[rid]
        assert sorted(rows) == list(range(len(seq))), "every position computed exactly once"
        with torch.inference_mode():
            logits = engine.model.compute_logits(torch.stack([rows[i] for i in range(len(seq))])).float().cpu()
        results.append((seq, outputs[rid], logits))
    return results


def hf_full_logits(model_dir, seq: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        return hf(torch.tensor([seq])).logits[0]


def random_prompts(rng: random.Random, n: int, vocab: int = 512) -> list[list[int]]:
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(5, 60))] for _ in range(n)]


@pytest.mark.parametrize("arch", ARCHS)
def test_fp32_cache_logits_match_transformers(rng, tmp_path, arch):
    model_dir = make_hf_model_dir(tmp_path, arch, weight_scale=4.0)
    for seq, generated, logits in run_recorded(model_dir, "fp32", random_prompts(rng, 3), max_tokens=12):
        ref = hf_full_logits(model_dir, seq)
        err = ((logits - ref).abs().max() / ref.abs().max()).item()
        assert err <= TOLERANCE, f"{arch}: relative logit error {err:.2e}"
        # the engine's greedy picks are the argmax of its own logits
        n_prompt = len(seq) - len(generated) + 1
        assert logits[n_prompt - 1:].argmax(-1).tolist() == generated


@pytest.mark.parametrize("arch", ARCHS)
def test_int8_cache_fidelity(rng, tmp_path, arch):
    """int8 K/V per (token, kv head): logits stay close and teacher-forced greedy agrees >= 90%."""
    model_dir = make_hf_model_dir(tmp_path, arch, weight_scale=4.0)
    agree = total = 0
    worst = 0.0
    for seq, generated, logits in run_recorded(model_dir, "int8", random_prompts(rng, 4), max_tokens=32):
        ref = hf_full_logits(model_dir, seq)
        worst = max(worst, ((logits - ref).abs().max() / ref.abs().max()).item())
        n_prompt = len(seq) - len(generated) + 1
        ours = logits[n_prompt - 1:].argmax(-1)
        theirs = ref[n_prompt - 1:].argmax(-1)
        agree += int((ours == theirs).sum())
        total += len(ours)
    print(f"{arch}: int8 teacher-forced top-1 agreement {agree}/{total}, worst relative logit error {worst:.3e}")
    assert agree / total >= 0.9
    assert worst < 0.1


@pytest.mark.gpu
@pytest.mark.parametrize("kv_cache_dtype", ["bf16", "int8"])
@pytest.mark.parametrize("arch", ARCHS)
def test_triton_path_matches_transformers_on_gpu(rng, tmp_path, arch, kv_cache_dtype):
    """The CUDA path (bf16 weights, Triton cache-write/decode/extend kernels) against transformers
    in fp32: bf16 tolerance on the logits, and teacher-forced greedy agreement."""
    model_dir = make_hf_model_dir(tmp_path, arch, weight_scale=4.0)
    agree = total = 0
    for seq, generated, logits in run_recorded(model_dir, kv_cache_dtype, random_prompts(rng, 4), max_tokens=24,
                                               device="cuda", dtype="bf16", attention_backend="triton",
                                               enforce_eager=True):  # the recorder wraps the eager forward
        ref = hf_full_logits(model_dir, seq)
        err = ((logits - ref).abs().max() / ref.abs().max()).item()
        assert err <= 5e-2, f"{arch}/{kv_cache_dtype}: relative logit error {err:.3e}"
        n_prompt = len(seq) - len(generated) + 1
        ours = logits[n_prompt - 1:].argmax(-1)
        agree += int((ours == ref[n_prompt - 1:].argmax(-1)).sum())
        total += len(ours)
    print(f"{arch}/{kv_cache_dtype} on cuda: teacher-forced top-1 agreement {agree}/{total}")
    assert agree / total >= 0.9


@pytest.mark.parametrize("kv_cache_dtype", ["fp32", "int8"])
def test_triton_kernels_in_the_engine_on_the_interpreter(rng, tmp_path, kv_cache_dtype):
    """The engine through the Triton cache-write, extend and decode kernels (Triton's interpreter on
    the CPU): the same logits as the torch reference path, chunked prefill and decode included."""
    if torch.cuda.is_available():
        pytest.skip("the GPU runs the Triton path in test_triton_path_matches_transformers_on_gpu")
    model_dir = make_hf_model_dir(tmp_path, "llama", weight_scale=4.0, head_dim=64, num_hidden_layers=1)
    prompts = random_prompts(rng, 2)
    ours = run_recorded(model_dir, kv_cache_dtype, prompts, max_tokens=4, attention_backend="triton")
    ref = run_recorded(model_dir, kv_cache_dtype, prompts, max_tokens=4, attention_backend="torch")
    for (_, gen, logits), (_, ref_gen, ref_logits) in zip(ours, ref):
        assert gen == ref_gen
        err = ((logits - ref_logits).abs().max() / ref_logits.abs().max()).item()
        assert err <= 1e-4, f"triton vs torch attention path: relative logit error {err:.2e}"


# Sliding-window checkpoints: Mistral applies its window on every layer; Qwen2 from
# max_window_layers on (here the second of two layers). Windows far shorter than the sequences.
WINDOW_CASES = {
    "mistral-window": ("mistral", dict(sliding_window=7)),
    "qwen2-window": ("qwen2", dict(sliding_window=9, use_sliding_window=True, max_window_layers=1)),
}


@pytest.mark.parametrize("case", WINDOW_CASES)
@pytest.mark.parametrize("kv_cache_dtype", ["fp32", "int8"])
def test_sliding_window_models_match_transformers(rng, tmp_path, case, kv_cache_dtype):
    """Served past the window (chunked prefill across it, then decode), as transformers applies
    it: fp32 pages to 1e-4, int8 pages with teacher-forced agreement."""
    arch, overrides = WINDOW_CASES[case]
    model_dir = make_hf_model_dir(tmp_path, arch, weight_scale=4.0, **overrides)
    agree = total = 0
    for seq, generated, logits in run_recorded(model_dir, kv_cache_dtype, random_prompts(rng, 3), max_tokens=16):
        ref = hf_full_logits(model_dir, seq)
        n_prompt = len(seq) - len(generated) + 1
        if kv_cache_dtype == "fp32":
            err = ((logits - ref).abs().max() / ref.abs().max()).item()
            assert err <= TOLERANCE, f"{case}: relative logit error {err:.2e}"
        agree += int((logits[n_prompt - 1:].argmax(-1) == ref[n_prompt - 1:].argmax(-1)).sum())
        total += len(generated)
    assert agree / total >= (1.0 if kv_cache_dtype == "fp32" else 0.85)
    assert len(seq) > 2 * ModelConfig.from_hf(model_dir).sliding_window  # served well past it


@pytest.mark.gpu
@pytest.mark.parametrize("case", WINDOW_CASES)
def test_sliding_window_models_on_gpu(rng, tmp_path, case):
    arch, overrides = WINDOW_CASES[case]
    model_dir = make_hf_model_dir(tmp_path, arch, weight_scale=4.0, **overrides)
    for seq, _, logits in run_recorded(model_dir, "bf16", random_prompts(rng, 3), max_tokens=16,
                                               device="cuda", dtype="bf16", attention_backend="triton",
                                               enforce_eager=True):
        ref = hf_full_logits(model_dir, seq)
        err = ((logits - ref).abs().max() / ref.abs().max()).item()
        assert err <= 5e-2, f"{case}: relative logit error {err:.3e}"
