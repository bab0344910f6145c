"""Export a trained LlamaForCausalLM to the Hugging Face layout the server (and transformers) load.

Our fused parameters are split back into transformers' names: `self_attn.qkv_proj` rows
[0, q) | [q, q+kv) | [q+kv, q+2kv) -> q_proj, k_proj, v_proj; `mlp.gate_up_proj` rows [0, I) | [I, 2I)
-> gate_proj, up_proj. Everything else gains the `model.` prefix; lm_head is left out when tied.
"""

from __future__ import annotations

import json
import os
from os import PathLike
from pathlib import Path

import torch
from safetensors.torch import save

from pie.model.config import ModelConfig
from pie.model.llama import LlamaForCausalLM

from .tokenizer import BOS_ID, BOS_TOKEN, EOS_ID, EOS_TOKEN, PAD_ID, PAD_TOKEN

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def hf_state_dict(model: LlamaForCausalLM, cfg: ModelConfig, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """transformers-named, contiguous CPU tensors in `dtype` (un-fused; no lm_head when tied)."""
    out: dict[str, torch.Tensor] = {}
    q, kv, inter = cfg.q_size, cfg.kv_size, cfg.intermediate_size
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        t = tensor.detach().to("cpu", dtype)
        hf = name if name == "lm_head.weight" else f"model.{name}"
        if ".self_attn.qkv_proj." in name:
            for proj, part in zip(("q_proj", "k_proj", "v_proj"), t.split([q, kv, kv], dim=0)):
                out[hf.replace("qkv_proj", proj)] = part.contiguous()
        elif ".mlp.gate_up_proj." in name:
            for proj, part in zip(("gate_proj", "up_proj"), t.split([inter, inter], dim=0)):
                out[hf.replace("gate_up_proj", proj)] = part.contiguous()
        else:
            out[hf] = t.contiguous()
    return out


def hf_config(cfg: ModelConfig, dtype: torch.dtype) -> dict:
    """config.json for transformers' LlamaConfig (both rope spellings, so old and new readers agree)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "pretraining_tp": 1,
        "use_cache": True,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
        "dtype": _DTYPE_NAMES[dtype],
    }


def export_hf(model: LlamaForCausalLM, config, tokenizer_path: str | PathLike[str],
              out_dir: str | PathLike[str], *, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Writes config.json, model.safetensors, tokenizer.json, tokenizer_config.json and
    generation_config.json into `out_dir`; returns it. `config` is a ModelConfig or a TrainConfig
    (anything with `model_config()`); `tokenizer_path` a tokenizer.json or a folder holding one."""
    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"unsupported export dtype {dtype}; use one of {list(_DTYPE_NAMES)}")
    cfg = config if isinstance(config, ModelConfig) else config.model_config()
    if cfg.model_type != "llama" or cfg.qk_norm or cfg.attention_bias or cfg.mlp_bias or cfg.rope_scaling:
        raise ValueError("export_hf writes plain Llama checkpoints (no biases, q/k norm or RoPE scaling)")
    tok_file = Path(tokenizer_path)
    if tok_file.is_dir():
        tok_file = tok_file / "tokenizer.json"
    if not tok_file.is_file():
        raise FileNotFoundError(f"no tokenizer.json at {tok_file}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    # serialized in memory (one copy of the weights in `dtype`: small for the models trained here)
    _write(out / "model.safetensors", save(hf_state_dict(model, cfg, dtype), metadata={"format": "pt"}))
    _write(out / "config.json", _json_bytes(hf_config(cfg, dtype)))
    if tok_file.resolve() != (out / "tokenizer.json").resolve():
        _write(out / "tokenizer.json", tok_file.read_bytes())
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN, "unk_token": None,
        "add_bos_token": False,  # tokenizer.json's post-processor already prepends <s>
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,  # decoding must return the text exactly
        "model_max_length": cfg.max_position_embeddings,
    }
    _write(out / "tokenizer_config.json", _json_bytes(tokenizer_config))
    generation_config = {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID}
    _write(out / "generation_config.json", _json_bytes(generation_config))
    return out


def _json_bytes(obj: dict) -> bytes:
    return (json.dumps(obj, indent=2) + "\n").encode()


def _write(path: Path, data: bytes) -> None:
    """Writes `path` whole or not at all (a temp file renamed over it), always as a new file, so its
    mode is what open() gives under the umask, like any file the user writes, whatever an earlier
    export left there (safetensors' save_file creates its file 0600)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)
