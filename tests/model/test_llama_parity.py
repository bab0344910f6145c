"""Our decoder against transformers' on the same checkpoint, fp32, full logits."""

from __future__ import annotations

import pytest
import torch

from pie.model.loader import load_model
from tests.model.oracle import CASES, SEQ_LENS, TOLERANCE, hf_logits, packed_logits, prompts, rel_error


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(case, model_dir, hf_model):
    model, cfg = load_model(model_dir(case))
    ids = prompts(cfg.vocab_size)
    ours = packed_logits(model, ids)
    theirs = hf_logits(hf_model(case), ids)
    assert ours.dtype == torch.float32 and ours.shape == theirs.shape == (sum(SEQ_LENS), cfg.vocab_size)
    assert rel_error(ours, theirs) <= TOLERANCE


@pytest.mark.parametrize("case", ["llama", "qwen3"])
@pytest.mark.parametrize("distortion", ["stride2", "zeros"])
def test_parity_check_catches_wrong_relative_positions(case, distortion, model_dir, hf_model):
    """The comparison above can fail: wrong relative positions move the logits far past tolerance.
    (A constant offset would not: RoPE attention depends only on position differences.)"""
    model, cfg = load_model(model_dir(case))
    ids = prompts(cfg.vocab_size)
    positions = torch.cat([torch.arange(n) for n in SEQ_LENS])
    positions = positions * 2 if distortion == "stride2" else torch.zeros_like(positions)
    assert rel_error(packed_logits(model, ids, positions), hf_logits(hf_model(case), ids)) > 100 * TOLERANCE


class AppendOnlyCache:
    """A one-sequence KV cache backend: appends each call's k/v per layer and lets the new queries
    attend to everything cached (causally within the new tokens), like an engine's decode step."""

    def __init__(self, scale: float) -> None:
        self.scale = scale
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}

    def __call__(self, layer_idx, q, k, v):
        k_all = torch.cat([self.k[layer_idx], k]) if layer_idx in self.k else k  # (S, Hkv, D)
        v_all = torch.cat([self.v[layer_idx], v]) if layer_idx in self.v else v
        self.k[layer_idx], self.v[layer_idx] = k_all, v_all
        group = q.shape[1] // k.shape[1]
        t, s = q.shape[0], k_all.shape[0]
        scores = torch.einsum("thd,shd->hts", q, k_all.repeat_interleave(group, dim=1)) * self.scale
        # query i (absolute position s - t + i) sees keys 0 .. s - t + i
        mask = torch.arange(s)[None, :] > (torch.arange(t)[:, None] + s - t)
        probs = scores.masked_fill(mask, float("-inf")).softmax(-1)
        return torch.einsum("hts,shd->thd", probs, v_all.repeat_interleave(group, dim=1))


@pytest.mark.parametrize("case", ["llama-rope-llama3", "qwen3"])
def test_prefill_then_decode_with_cache_matches_full_pass(case, model_dir, hf_model):
    """Positions not starting at 0 (decode after a prefill chunk) give transformers' logits."""
    model, cfg = load_model(model_dir(case))
    (ids,) = prompts(cfg.vocab_size, lens=(20,), seed=1)
    theirs = hf_logits(hf_model(case), [ids])
    cache = AppendOnlyCache(model.attn_scale)
    chunks = [(0, 12), (12, 17), *((i, i + 1) for i in range(17, 20))]  # prefill 12, chunk of 5, 3 decodes
    ours = []
    with torch.inference_mode():
        for start, end in chunks:
            hidden = model(ids[start:end], torch.arange(start, end), cache)
            ours.append(model.compute_logits(hidden))
    assert rel_error(torch.cat(ours), theirs) <= TOLERANCE


def test_bf16_load_runs_and_stays_close(model_dir, hf_model):
    model, cfg = load_model(model_dir("qwen3"), dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    ids = prompts(cfg.vocab_size)
    ours = packed_logits(model, ids)
    assert ours.dtype == torch.float32
    # bf16 has 8 bits of mantissa; through 2 layers a few percent of the logit range is expected
    assert rel_error(ours, hf_logits(hf_model("qwen3"), ids)) < 0.1
