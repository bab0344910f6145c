"""ModelConfig.from_hf over both config spellings, and RoPE frequencies against transformers."""

from __future__ import annotations

import json

import pytest
import torch

from pie.model.config import ModelConfig
from pie.model.rope import rope_inv_freq

BASE = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 1000,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
}


def test_llama_defaults_and_derived_fields():
    cfg = ModelConfig.from_hf({**BASE, "torch_dtype": "bfloat16", "eos_token_id": [7, 8], "bos_token_id": 1})
    assert cfg.architecture == "LlamaForCausalLM"
    assert cfg.num_key_value_heads == 8  # defaults to the query heads
    assert cfg.head_dim == 32 and cfg.attn_scale == 32 ** -0.5
    assert (cfg.q_size, cfg.kv_size) == (256, 256)
    assert cfg.rope_theta == 10000.0 and cfg.rope_scaling is None
    assert not (cfg.attention_bias or cfg.o_proj_bias or cfg.mlp_bias or cfg.qk_norm or cfg.tie_word_embeddings)
    assert cfg.dtype == "bfloat16" and cfg.eos_token_ids == (7, 8) and cfg.bos_token_id == 1
    assert cfg.max_model_len == 4096


def test_family_switches():
    qwen2 = ModelConfig.from_hf({**BASE, "model_type": "qwen2", "attention_bias": False})
    assert qwen2.attention_bias and not qwen2.o_proj_bias  # qwen2 always has q/k/v bias, no o bias
    qwen3 = ModelConfig.from_hf({**BASE, "model_type": "qwen3", "head_dim": 128, "num_key_value_heads": 2})
    assert qwen3.qk_norm and qwen3.head_dim == 128 and qwen3.q_size == 1024 and qwen3.kv_size == 256
    llama = ModelConfig.from_hf({**BASE, "attention_bias": True, "dtype": "float16"})
    assert llama.attention_bias and llama.o_proj_bias and llama.dtype == "float16"


def test_old_and_new_rope_spellings_agree():
    old = ModelConfig.from_hf({**BASE, "rope_theta": 500000.0, "rope_scaling": {
        "type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}})
    new = ModelConfig.from_hf({**BASE, "rope_parameters": {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}})
    assert old.rope_theta == new.rope_theta == 500000.0
    assert old.rope_scaling == new.rope_scaling == {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}
    plain = ModelConfig.from_hf({**BASE, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}})
    assert plain.rope_theta == 1e6 and plain.rope_scaling is None
    yarn = ModelConfig.from_hf({**BASE, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    assert yarn.rope_scaling["original_max_position_embeddings"] == 4096  # filled like transformers


def test_reads_a_folder_or_a_file(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(BASE))
    assert ModelConfig.from_hf(tmp_path) == ModelConfig.from_hf(tmp_path / "config.json")
    with pytest.raises(FileNotFoundError, match="config.json"):
        ModelConfig.from_hf(tmp_path / "nowhere")


@pytest.mark.parametrize("bad, match", [
    ({"model_type": "gpt2"}, "'gpt2'"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "dynamic"),
    ({"rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, "longrope"),
    ({"hidden_act": "gelu"}, "gelu"),
    ({"num_key_value_heads": 3}, "multiple"),
])
def test_refuses_what_is_not_implemented(bad, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf({**BASE, **bad})


@pytest.mark.parametrize("extra, windows", [
    ({"model_type": "mistral", "sliding_window": 1024}, [1024, 1024]),
    ({"model_type": "mistral", "sliding_window": None}, [None, None]),
    ({"model_type": "qwen2", "sliding_window": 1024, "use_sliding_window": False}, [None, None]),
    ({"model_type": "qwen2", "sliding_window": 1024, "use_sliding_window": True,
      "layer_types": ["full_attention", "sliding_attention"]}, [None, 1024]),
    ({"model_type": "qwen2", "sliding_window": 1024, "use_sliding_window": True, "max_window_layers": 1},
     [None, 1024]),
    ({"model_type": "qwen2", "sliding_window": 1024, "use_sliding_window": True, "max_window_layers": 28},
     [None, None]),
    ({"model_type": "llama", "sliding_window": 1024}, [None, None]),
])
def test_sliding_window_per_layer(extra, windows):
    """Windows are served (not capped at): the context stays the checkpoint's."""
    cfg = ModelConfig.from_hf({**BASE, "num_hidden_layers": 2, **extra})
    assert [cfg.layer_window(i) for i in range(2)] == windows
    assert cfg.max_model_len == 4096


@pytest.mark.parametrize("rope", [
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 512},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024},
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 512, "beta_fast": 16,
     "beta_slow": 2, "truncate": False},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024, "mscale": 0.707,
     "mscale_all_dim": 0.707},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024, "attention_factor": 1.5},
])
def test_inv_freq_matches_transformers(rope):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {**rope, "rope_theta": 500000.0}
    hf_cfg = LlamaConfig(hidden_size=256, num_attention_heads=2, max_position_embeddings=4096, rope_parameters=params)
    ours = ModelConfig.from_hf({**BASE, "num_attention_heads": 2, "rope_parameters": dict(params)})
    inv_freq, factor = rope_inv_freq(ours)
    ref_inv_freq, ref_factor = ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf_cfg, torch.device("cpu"))
    assert factor == pytest.approx(ref_factor, rel=1e-12)
    torch.testing.assert_close(inv_freq, ref_inv_freq.float(), rtol=1e-6, atol=0)
    assert not torch.equal(inv_freq, rope_inv_freq(ModelConfig.from_hf({**BASE, "num_attention_heads": 2,
                                                                        "rope_theta": 500000.0}))[0])
