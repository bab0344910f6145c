"""Weight loading: sharded checkpoints, tying, and errors that name the offending tensor."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from model import load_model, read_generation_config
from tests.helpers import make_hf_model_dir
from tests.model.oracle import TOLERANCE, hf_logits, packed_logits, prompts, rel_error


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _rewrite_weights(path, edit):
    """Applies edit(dict of tensors) to a single-file checkpoint in place."""
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def test_sharded_checkpoint_loads(tmp_path):
    import transformers

    path = make_hf_model_dir(tmp_path, "qwen2", weight_scale=8.0, max_shard_size="40KB")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1 and not (path / "model.safetensors").exists()
    model, cfg = load_model(path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = prompts(cfg.vocab_size, lens=(9, 4))
    assert rel_error(packed_logits(model, ids), hf_logits(hf, ids)) <= TOLERANCE


def test_fused_params_and_tying(model_dir):
    model, cfg = load_model(model_dir("qwen3-tied"))
    assert model.lm_head.weight is model.embed_tokens.weight
    attn = model.layers[0].self_attn
    assert attn.qkv_proj.weight.shape == (cfg.q_size + 2 * cfg.kv_size, cfg.hidden_size)
    assert model.layers[1].mlp.gate_up_proj.weight.shape == (2 * cfg.intermediate_size, cfg.hidden_size)
    assert not any(p.requires_grad or p.is_meta for p in model.parameters())
    assert not model.training


def test_missing_lm_head_ties_embeddings(tmp_path, model_dir):
    path = _copy(model_dir("llama"), tmp_path / "no-head")
    _rewrite_weights(path, lambda t: t.pop("lm_head.weight"))
    model, cfg = load_model(path)
    assert cfg.tie_word_embeddings and model.lm_head.weight is model.embed_tokens.weight


def test_missing_tensor_is_named(tmp_path, model_dir):
    path = _copy(model_dir("qwen3"), tmp_path / "missing")
    _rewrite_weights(path, lambda t: t.pop("model.layers.1.self_attn.k_norm.weight"))
    with pytest.raises(ValueError, match=r"missing tensors: model\.layers\.1\.self_attn\.k_norm\.weight"):
        load_model(path)


def test_unexpected_tensor_is_named(tmp_path, model_dir):
    path = _copy(model_dir("llama"), tmp_path / "extra")
    _rewrite_weights(path, lambda t: t.update({"model.layers.0.mlp.extra.weight": torch.zeros(2)}))
    with pytest.raises(ValueError, match=r"unexpected tensors: model\.layers\.0\.mlp\.extra\.weight"):
        load_model(path)


def test_wrong_shape_is_named(tmp_path, model_dir):
    path = _copy(model_dir("llama"), tmp_path / "shape")
    _rewrite_weights(path, lambda t: t.update({"model.norm.weight": torch.ones(3)}))
    with pytest.raises(ValueError, match=r"model\.norm\.weight has shape \(3,\)"):
        load_model(path)


def test_generation_config(tmp_path):
    path = make_hf_model_dir(tmp_path, "llama", generation_eos=[2, 5])
    assert read_generation_config(path)["eos_token_id"] == [2, 5]
    (path / "generation_config.json").unlink()
    assert read_generation_config(path) == {}
