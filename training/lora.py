"""Fine-tuning a LoRA adapter on a model folder (`pie train --lora BASE`), exported in PEFT's format.

The base weights are frozen; each adapted module gets trainable A (r, in) and B (out, r), PEFT's
initialisation (A Kaiming-uniform, B zeros: the adapter starts as the base model) and its scaling
(lora_alpha / r, or / sqrt(r) with rsLoRA). Our projections fuse q/k/v and gate/up, so a forward
hook on each fused projection adds the deltas of the parts it adapts, each into its own rows:

    qkv_proj output  |<- q rows ->|<- k rows ->|<- v rows ->|   + x.A_q^T.B_q^T*s | x.A_k^T.B_k^T*s | ...

The export is what `peft` writes (adapter_config.json, adapter_model.safetensors with
`base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_A.weight` / `.lora_B.weight`), so
transformers + peft, vLLM and `pie serve --lora` all load it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from pie.model.config import ModelConfig
from pie.model.llama import LlamaForCausalLM
from pie.model.lora import TARGETS, part_sizes

DEFAULT_TARGETS = ("q_proj", "v_proj")  # PEFT's default for Llama-family models


class LoraTraining(nn.Module):
    """The trainable A and B of every adapted module, registered on the model as `lora_train` (so
    the optimizer, checkpoints and `model.parameters()` see them), and the hooks that apply them."""

    def __init__(self, model: LlamaForCausalLM, targets: tuple[str, ...], rank: int, alpha: float,
                 rslora: bool = False, seed: int = 0) -> None:
        super().__init__()
        unknown = sorted(set(targets) - set(TARGETS))
        if unknown or not targets:
            raise ValueError(f"--lora-targets: {unknown or 'none given'}; choose among {', '.join(TARGETS)}")
        if rank < 1:
            raise ValueError(f"--lora-rank must be >= 1, got {rank}")
        cfg: ModelConfig = model.config
        self.targets, self.rank, self.alpha, self.rslora = tuple(targets), rank, alpha, rslora
        self.scaling = alpha / math.sqrt(rank) if rslora else alpha / rank
        sizes = part_sizes(cfg)
        gen = torch.Generator().manual_seed(seed)
        device = model.embed_tokens.weight.device
        self.a = nn.ParameterDict()
        self.b = nn.ParameterDict()
        for p in model.parameters():
            p.requires_grad_(False)
        for i in range(cfg.num_hidden_layers):
            for module in self.targets:
                proj, part = TARGETS[module]
                width, outs = sizes[proj]
                a = torch.empty(rank, width)
                nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=gen)  # as nn.Linear's (PEFT's A)
                self.a[f"{i}_{module}"] = nn.Parameter(a.to(device))
                self.b[f"{i}_{module}"] = nn.Parameter(torch.zeros(outs[part], rank, device=device))
        model.lora_train = self
        self._hooks = []
        for i, layer in enumerate(model.layers):
            for owner, proj in ((layer.self_attn, "qkv_proj"), (layer.self_attn, "o_proj"),
                                (layer.mlp, "gate_up_proj"), (layer.mlp, "down_proj")):
                parts = [m for m, (p, _) in TARGETS.items() if p == proj]
                if any(m in self.targets for m in parts):
                    linear = getattr(owner, proj)
                    self._hooks.append(linear.register_forward_hook(self._hook(i, parts, sizes[proj][1])))

    def _hook(self, layer: int, parts: list[str], outs: tuple[int, ...]):
        def add_delta(module: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> torch.Tensor:
            x = inputs[0]
            pieces = []
            for module_name, width in zip(parts, outs, strict=True):
                key = f"{layer}_{module_name}"
                if key in self.a:
                    a, b = self.a[key], self.b[key]
                    pieces.append((x.to(a.dtype) @ a.T @ b.T * self.scaling).to(output.dtype))
                else:
                    pieces.append(output.new_zeros(*output.shape[:-1], width))
            return output + (pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=-1))
        return add_delta

    def export(self, folder: str | Path, base: str = "") -> Path:
        """PEFT's adapter folder: adapter_config.json and adapter_model.safetensors (fp32)."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        tensors = {}
        for key, a in self.a.items():
            layer, module = key.split("_", 1)
            block = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            name = f"base_model.model.model.layers.{layer}.{block}.{module}"
            tensors[f"{name}.lora_A.weight"] = a.detach().float().cpu().contiguous()
            tensors[f"{name}.lora_B.weight"] = self.b[key].detach().float().cpu().contiguous()
        save_file(tensors, str(folder / "adapter_model.safetensors"))
        config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base, "r": self.rank,
                  "lora_alpha": self.alpha, "target_modules": sorted(self.targets), "use_rslora": self.rslora,
                  "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False, "inference_mode": True}
        (folder / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
        return folder
