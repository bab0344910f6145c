"""Loading a Hugging Face-layout folder (config.json + safetensors) into LlamaForCausalLM.

The module is built on the meta device (no memory, no random init); each checkpoint tensor is then
read on its own straight onto the target device, cast, and either installed as a parameter or, for
the fused projections, held until its siblings arrive and concatenated. Names are checked up front
against what the config implies, so a wrong checkpoint fails before anything is read, naming the
missing or unexpected tensors.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from os import PathLike
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from .config import ModelConfig
from .llama import LlamaForCausalLM
from .parallel import TensorParallel, check_shardable, intermediate, kv_heads, q_heads, vocab, vocab_per_rank
from .rope import RotaryEmbedding

# transformers module inside a layer -> (our fused module, index of its part, number of parts)
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0, 3),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1, 3),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2, 3),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0, 2),
    "mlp.up_proj": ("mlp.gate_up_proj", 1, 2),
}
# Buffers some older checkpoints saved; recomputed here, so skipped.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


def expected_hf_names(cfg: ModelConfig) -> list[str]:
    """Every tensor name a checkpoint for `cfg` holds, in transformers' naming (lm_head included
    only when the embeddings are not tied)."""
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not cfg.tie_word_embeddings:
        names.append("lm_head.weight")
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        for proj in ("q_proj", "k_proj", "v_proj"):
            names.append(p + f"self_attn.{proj}.weight")
            if cfg.attention_bias:
                names.append(p + f"self_attn.{proj}.bias")
        names.append(p + "self_attn.o_proj.weight")
        if cfg.o_proj_bias:
            names.append(p + "self_attn.o_proj.bias")
        if cfg.qk_norm:
            names += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
        for proj in ("gate_proj", "up_proj", "down_proj"):
            names.append(p + f"mlp.{proj}.weight")
            if cfg.mlp_bias:
                names.append(p + f"mlp.{proj}.bias")
    return names


def _target(hf_name: str) -> tuple[str, int, int]:
    """transformers name -> (our parameter name, index of the part, number of parts); a plain
    (unfused) parameter is part 0 of 1."""
    name = hf_name.removeprefix("model.")
    if name.startswith("layers."):
        _, idx, rest = name.split(".", 2)
        module, leaf = rest.rsplit(".", 1)
        if module in _FUSED:
            fused, part, num_parts = _FUSED[module]
            return f"layers.{idx}.{fused}.{leaf}", part, num_parts
    return name, 0, 1


def _checkpoint_files(path: Path) -> dict[str, Path]:
    """tensor name -> safetensors file holding it."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: path / file for name, file in weight_map.items()}
    single = path / "model.safetensors"
    if not single.is_file():
        raise FileNotFoundError(f"{path} has neither model.safetensors nor model.safetensors.index.json")
    with safe_open(single, framework="pt") as f:
        return {name: single for name in f.keys()}


def _shard_slice(hf_name: str, cfg: ModelConfig, tp: TensorParallel | None) -> tuple[str, slice] | None:
    """How rank `tp.rank` reads a tensor (model/parallel.py): ("rows" | "cols", the slice), ("vocab",
    its rows) for the embedding and LM head, ("zero", ...) for a row-parallel bias that only rank 0
    holds, or None for the whole tensor."""
    if tp is None or tp.size == 1:
        return None
    if hf_name in ("model.embed_tokens.weight", "lm_head.weight"):
        rows = vocab(cfg, tp)
        return "vocab", slice(rows.start, rows.stop)
    if ".layers." not in f".{hf_name}":
        return None
    d = cfg.head_dim
    module, leaf = hf_name.rsplit(".", 1)
    proj = module.rsplit(".", 1)[-1]

    def span(r: range, unit: int = 1) -> slice:
        return slice(r.start * unit, r.stop * unit)

    if proj == "q_proj":
        return "rows", span(q_heads(cfg, tp), d)
    if proj in ("k_proj", "v_proj"):
        return "rows", span(kv_heads(cfg, tp), d)
    if proj in ("gate_proj", "up_proj"):
        return "rows", span(intermediate(cfg, tp))
    if proj in ("o_proj", "down_proj"):
        if leaf == "bias":  # added once: by rank 0
            return None if tp.rank == 0 else ("zero", slice(None))
        return "cols", span(q_heads(cfg, tp), d) if proj == "o_proj" else span(intermediate(cfg, tp))
    return None


def _read_tensors(files: dict[str, Path], names: list[str], device: torch.device, dtype: torch.dtype,
                  cfg: ModelConfig, tp: TensorParallel | None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor on device in dtype) for `names`, opening each file once, in file order; with
    `tp`, only this rank's slice of each sharded tensor is read."""
    by_file: dict[Path, list[str]] = {}
    for name in names:
        by_file.setdefault(files[name], []).append(name)
    # safetensors takes "cpu", "cuda:0" or a device index; "cuda" alone means the current device.
    dev = "cpu" if device.type == "cpu" else (device.index if device.index is not None else torch.cuda.current_device())
    for file, file_names in by_file.items():
        with safe_open(file, framework="pt", device=dev) as f:
            for name in file_names:
                how = _shard_slice(name, cfg, tp)
                if how is None:
                    tensor = f.get_tensor(name)
                elif how[0] == "zero":
                    tensor = f.get_tensor(name).zero_()
                elif how[0] == "vocab":  # padded with zero rows to the share every rank holds
                    assert tp is not None
                    tensor = f.get_slice(name)[how[1]]
                    pad = vocab_per_rank(cfg, tp.size) - tensor.shape[0]
                    if pad:
                        tensor = torch.cat([tensor, tensor.new_zeros(pad, tensor.shape[1])])
                else:
                    part = f.get_slice(name)
                    tensor = part[how[1]] if how[0] == "rows" else part[:, how[1]]
                yield name, tensor.to(dtype)


def _install(model: nn.Module, name: str, tensor: torch.Tensor, hf_names: str) -> None:
    module_name, leaf = name.rsplit(".", 1)
    module = model.get_submodule(module_name)
    current = getattr(module, leaf)
    if tuple(current.shape) != tuple(tensor.shape):
        raise ValueError(f"checkpoint tensor {hf_names} has shape {tuple(tensor.shape)}; "
                         f"the config implies {tuple(current.shape)}")
    setattr(module, leaf, nn.Parameter(tensor, requires_grad=False))


def load_model(path: str | PathLike[str], *, device: str | torch.device = "cpu",
               dtype: torch.dtype = torch.float32,
               tp: TensorParallel | None = None) -> tuple[LlamaForCausalLM, ModelConfig]:
    """Reads `path`/config.json and its safetensors into a LlamaForCausalLM in eval mode on `device`.
    With `tp`, the module is rank `tp.rank`'s share (model/parallel.py) and only its slices are
    read; the returned config is the whole model's either way.

    Embeddings are tied when the config says so or when the checkpoint has no lm_head.weight (the
    returned config then says tie_word_embeddings=True). Raises ValueError naming any missing,
    unexpected or wrongly shaped tensor.
    """
    path = Path(path)
    device = torch.device(device)
    cfg = ModelConfig.from_hf(path)
    files = _checkpoint_files(path)
    present = {n for n in files if not n.endswith(_IGNORED_SUFFIXES)}
    if not cfg.tie_word_embeddings and "lm_head.weight" not in present:
        cfg = dataclasses.replace(cfg, tie_word_embeddings=True)
    expected = expected_hf_names(cfg)
    missing = [n for n in expected if n not in present]
    # A tied checkpoint may still carry its lm_head copy; transformers ignores it, so do we.
    unexpected = sorted(present - set(expected) - {"lm_head.weight"})
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing tensors: {', '.join(missing)}")
        if unexpected:
            parts.append(f"unexpected tensors: {', '.join(unexpected)}")
        raise ValueError(f"checkpoint {path} does not match its config ({cfg.model_type}): " + "; ".join(parts))

    if tp is not None:
        check_shardable(cfg, tp.size)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, tp)
    pending: dict[str, dict[int, tuple[str, torch.Tensor]]] = {}
    for hf_name, tensor in _read_tensors(files, expected, device, dtype, cfg, tp):
        name, part, num_parts = _target(hf_name)
        if num_parts == 1:
            _install(model, name, tensor, hf_name)
            continue
        parts = pending.setdefault(name, {})
        parts[part] = (hf_name, tensor)
        if len(parts) == num_parts:  # all siblings read: stack them along the output dim
            del pending[name]
            ordered = [parts[i] for i in range(num_parts)]
            _install(model, name, torch.cat([t for _, t in ordered], dim=0), " + ".join(n for n, _ in ordered))
    assert not pending, f"incomplete fused parameters: {sorted(pending)}"
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.rotary = RotaryEmbedding(model.config).to(device)  # the meta-built table holds no values
    leftover = [n for n, p in model.named_parameters() if p.is_meta]
    assert not leftover, f"parameters left on the meta device: {leftover}"
    return model.eval(), cfg


def read_generation_config(path: str | PathLike[str]) -> dict[str, Any]:
    """generation_config.json of a model folder as a dict ({} when absent). Its eos_token_id may be
    an int or a list; `model.config.as_token_ids` turns it into a tuple."""
    file = Path(path) / "generation_config.json"
    if not file.is_file():
        return {}
    return json.loads(file.read_text())
