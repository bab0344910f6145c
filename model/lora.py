"""LoRA adapters in PEFT's format, and the slots that hold them beside the base weights.

An adapter folder is what `peft` saves: `adapter_config.json` (r, lora_alpha, target_modules,
use_rslora, rank_pattern, alpha_pattern, ...) and `adapter_model.safetensors` with, per adapted
module, `base_model.model.model.layers.{i}.{self_attn|mlp}.{name}.lora_A.weight` (r, in) and
`...lora_B.weight` (out, r). A module's delta is x . A^T . B^T . scaling, with scaling =
lora_alpha / r (rsLoRA: lora_alpha / sqrt(r)).

The model fuses q/k/v into `qkv_proj` and gate/up into `gate_up_proj`; an adapter may adapt any
of their parts. Each fused projection gets one bank of S slots (the base weights are never
touched):

    A bank  (S, parts * rank, in)     part p's A in rank rows [p * rank, p * rank + r_p)
    B bank  (S, out, parts * rank)    part p's B in its output rows and the same rank columns,
                                      its scaling folded in; zeros elsewhere (block diagonal)

so one gathered shrink and expand (kernels/triton_lora.py, or its torch twin on the CPU) add the
whole fused projection's delta, for every row's own slot, in one pass. With `wide_b` a B bank is
stored as (out, S, parts * rank) and viewed as above: every slot's B side by side in one matrix,
for the library-GEMM path (triton_lora's shrink="masked"). A missing part or a lower
rank is zeros. Slots are filled and cleared by the engine (which decides which adapters are
resident); a step tells the model each token's slot through `LoraStep`.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch

from .config import ModelConfig

# PEFT's module name -> (our projection, its part index)
TARGETS = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "o_proj": ("o_proj", 0),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", 0),
}
PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
_KEY = re.compile(r"^(?:base_model\.model\.)?(?:model\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
# adapter_config.json options that change the forward in ways the slots do not compute
_REFUSED = {"use_dora": "DoRA", "lora_bias": "lora_bias", "fan_in_fan_out": "fan_in_fan_out"}


class AdapterError(ValueError):
    """An adapter that cannot be served, with its name: `str()` reads `adapter NAME: why`."""

    def __init__(self, name: str, message: str) -> None:
        super().__init__(f"adapter {name!r}: {message}")
        self.adapter = name
        self.reason = message


def part_sizes(cfg: ModelConfig) -> dict[str, tuple[int, tuple[int, ...]]]:
    """Each projection's input width and its parts' output widths."""
    return {
        "qkv_proj": (cfg.hidden_size, (cfg.q_size, cfg.kv_size, cfg.kv_size)),
        "o_proj": (cfg.q_size, (cfg.hidden_size,)),
        "gate_up_proj": (cfg.hidden_size, (cfg.intermediate_size, cfg.intermediate_size)),
        "down_proj": (cfg.intermediate_size, (cfg.hidden_size,)),
    }


@dataclass(slots=True)
class LoraAdapter:
    """One adapter in host memory, fp32, its scaling folded into B."""

    name: str
    rank: int  # the largest rank of its modules
    targets: frozenset[str]  # PEFT module names it adapts (q_proj, ...)
    # (layer, PEFT module name) -> (A (r, in), B (out, r) * scaling)
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(repr=False)

    @property
    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.weights.values())


def _module_value(pattern: dict, module: str, default):
    """PEFT's rank_pattern / alpha_pattern lookup: a key matches a module by name or as a regex
    suffix of its full name."""
    for key, value in pattern.items():
        if key == module or re.search(rf"(^|\.){key}$", module):
            return value
    return default


def load_peft_adapter(name: str, folder: str | Path, cfg: ModelConfig, *, max_rank: int) -> LoraAdapter:
    """Read a PEFT LoRA folder for the model `cfg`; AdapterError for anything it cannot serve
    (a missing or corrupt file, a rank above max_rank, an unsupported module or option, shapes of
    another base model)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    folder = Path(folder)
    try:
        conf = json.loads((folder / "adapter_config.json").read_text())
    except FileNotFoundError:
        raise AdapterError(name, f"no adapter_config.json in {folder}") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise AdapterError(name, f"adapter_config.json unreadable: {exc}") from None
    if not isinstance(conf, dict):
        raise AdapterError(name, "adapter_config.json is not an object")
    if conf.get("peft_type", "LORA") != "LORA":
        raise AdapterError(name, f"peft_type {conf.get('peft_type')!r} is not LORA")
    for key, what in _REFUSED.items():
        if conf.get(key):
            raise AdapterError(name, f"{what} is not supported")
    if conf.get("modules_to_save"):
        raise AdapterError(name, f"modules_to_save ({conf['modules_to_save']}) is not supported: only LoRA deltas")
    path = folder / "adapter_model.safetensors"
    if not path.exists():
        raise AdapterError(name, f"no adapter_model.safetensors in {folder} (a .bin adapter: save it with safetensors)")
    try:
        tensors = load_file(str(path))
    except (SafetensorError, OSError, ValueError) as exc:
        raise AdapterError(name, f"adapter_model.safetensors unreadable: {exc}") from None
    r_default, alpha_default = int(conf.get("r", 8)), float(conf.get("lora_alpha", 8))
    rank_pattern, alpha_pattern = conf.get("rank_pattern") or {}, conf.get("alpha_pattern") or {}
    rs = bool(conf.get("use_rslora", False))
    sizes = part_sizes(cfg)

    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _KEY.match(key)
        if m is None:
            raise AdapterError(name, f"unexpected tensor {key!r} (only LoRA A/B weights of decoder layers)")
        layer, module, ab = int(m.group(1)), m.group(2), m.group(3)
        if module not in TARGETS:
            raise AdapterError(name, f"target module {module!r} is not supported (only {', '.join(TARGETS)})")
        if not 0 <= layer < cfg.num_hidden_layers:
            raise AdapterError(name, f"layer {layer} is outside the model's {cfg.num_hidden_layers} layers")
        pairs.setdefault((layer, module), {})[ab] = t
    if not pairs:
        raise AdapterError(name, "adapter_model.safetensors holds no LoRA weights")

    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    rank = 0
    for (layer, module), ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise AdapterError(name, f"layer {layer} {module}: lora_A and lora_B must both be present")
        a, b = ab["A"].float(), ab["B"].float()
        proj, part = TARGETS[module]
        width, outs = sizes[proj]
        r = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != width or b.shape != (outs[part], r):
            raise AdapterError(name, f"layer {layer} {module}: A {tuple(a.shape)} and B {tuple(b.shape)} do not fit "
                                     f"this model (A ({r}, {width}), B ({outs[part]}, {r})): another base model?")
        if r > max_rank:
            raise AdapterError(name, f"rank {r} is above the server's --max-lora-rank {max_rank}")
        full = f"model.layers.{layer}.{'self_attn' if proj in ('qkv_proj', 'o_proj') else 'mlp'}.{module}"
        r_conf = int(_module_value(rank_pattern, full, r_default))
        alpha = float(_module_value(alpha_pattern, full, alpha_default))
        if r_conf != r:
            raise AdapterError(name, f"layer {layer} {module}: rank {r} in the weights, {r_conf} in adapter_config.json")
        scaling = alpha / math.sqrt(r) if rs else alpha / r
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise AdapterError(name, f"layer {layer} {module}: non-finite weights")
        weights[(layer, module)] = (a.contiguous(), (b * scaling).contiguous())
        rank = max(rank, r)
    return LoraAdapter(name=name, rank=rank, targets=frozenset(m for _, m in weights), weights=weights)


class LoraOps(Protocol):
    """The gathered delta (kernels/triton_lora.lora_delta_ or its torch twin), supplied by the
    model's owner: y (T, N) += x (T, K) . A[s]^T . B[s]^T per row's slot s; -1 rows untouched."""

    def __call__(self, y: torch.Tensor, x: torch.Tensor, a_bank: torch.Tensor, b_bank: torch.Tensor,
                 slots: torch.Tensor, order: torch.Tensor | None, *, onehot: torch.Tensor | None) -> torch.Tensor:
        ...


@dataclass(slots=True)
class LoraStep:
    """Each token row's slot in the step, shared by every adapted projection. The model's owner
    writes them into `buffer` (-1 = the base model, also for padding rows) before each forward;
    the forward then reads its first T (`begin`), so a CUDA graph captured over T rows reads the
    buffer at the same address on every replay."""

    buffer: torch.Tensor  # (capacity,) int32 on the model's device
    # > 0: each forward also makes `onehot` over this many slots, in `onehot_dtype` (the masked path)
    onehot_slots: int = 0
    onehot_dtype: torch.dtype = torch.float32
    slots: torch.Tensor | None = None  # (T,) the forward's rows: buffer[:T]
    order: torch.Tensor | None = None  # (T,) int32, their stable argsort (the kernels' visiting order)
    onehot: torch.Tensor | None = None  # (T, onehot_slots): 1 at each row's slot

    def begin(self, num_tokens: int) -> None:
        assert num_tokens <= self.buffer.shape[0], f"{num_tokens} rows, a slot buffer of {self.buffer.shape[0]}"
        self.slots = self.buffer[:num_tokens]
        self.order = torch.argsort(self.slots, stable=True).to(torch.int32)
        if self.onehot_slots:
            slot_ids = torch.arange(self.onehot_slots, device=self.slots.device, dtype=self.slots.dtype)
            self.onehot = (self.slots[:, None] == slot_ids).to(self.onehot_dtype)


class LoraBank:
    """S slots of adapter weights for every layer's four projections, on the model's device and in
    its dtype; `attach` hooks them into the model's Linear layers."""

    def __init__(self, cfg: ModelConfig, num_slots: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device | str, max_tokens: int, *, wide_b: bool = False) -> None:
        assert num_slots >= 1 and max_rank >= 1 and max_tokens >= 1
        self.cfg, self.num_slots, self.max_rank = cfg, num_slots, max_rank
        # wide_b: the masked path, which also wants the step's one-hot of each row's slot
        self.step = LoraStep(torch.full((max_tokens,), -1, dtype=torch.int32, device=device),
                             onehot_slots=num_slots if wide_b else 0, onehot_dtype=dtype)
        self.banks: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = []
        for _ in range(cfg.num_hidden_layers):
            layer = {}
            for proj, (width, outs) in part_sizes(cfg).items():
                rows = len(outs) * max_rank
                b = (torch.zeros(sum(outs), num_slots, rows, dtype=dtype, device=device).permute(1, 0, 2) if wide_b
                     else torch.zeros(num_slots, sum(outs), rows, dtype=dtype, device=device))
                layer[proj] = (torch.zeros(num_slots, rows, width, dtype=dtype, device=device), b)
            self.banks.append(layer)
        # Per layer, K/V smoothing folded into the base weights (model/smoothing.py), to fold into
        # each adapter as it is written: multipliers of qkv's output rows and o_proj's input columns.
        self._smoothing: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    def fold_smoothing(self, k: list[torch.Tensor], v: list[torch.Tensor]) -> None:
        """The base model's K/V factors (KVSmoothing.k / .v, (Hkv, D) per layer) apply to every
        adapter written from now on: K and V output rows divided, Q rows (where no q/k norm
        follows the projection) and o_proj's input columns multiplied, as in `smoothing.fold`."""
        cfg = self.cfg
        group = cfg.num_attention_heads // cfg.num_key_value_heads
        self._smoothing = []
        for s_k, s_v in zip(k, v, strict=True):
            rows = torch.ones(cfg.q_size + 2 * cfg.kv_size)
            if not cfg.qk_norm:  # Qwen3's factors live in its q/k norms, after the projection
                rows[:cfg.q_size] = s_k.float().repeat_interleave(group, dim=0).reshape(-1)
                rows[cfg.q_size:cfg.q_size + cfg.kv_size] = 1.0 / s_k.float().reshape(-1)
            rows[cfg.q_size + cfg.kv_size:] = 1.0 / s_v.float().reshape(-1)
            cols = s_v.float().repeat_interleave(group, dim=0).reshape(-1)
            self._smoothing.append((rows, cols))

    @staticmethod
    def nbytes(cfg: ModelConfig, num_slots: int, max_rank: int, dtype: torch.dtype) -> int:
        """Device bytes of a bank (what the KV pool's sizing must set aside first)."""
        per_slot = sum(len(outs) * max_rank * (width + sum(outs)) for width, outs in part_sizes(cfg).values())
        return num_slots * per_slot * cfg.num_hidden_layers * dtype.itemsize

    def write(self, slot: int, adapter: LoraAdapter) -> None:
        """Put `adapter` in `slot` (every part it lacks zeroed)."""
        assert 0 <= slot < self.num_slots
        if adapter.rank > self.max_rank:
            raise AdapterError(adapter.name, f"rank {adapter.rank} is above the bank's {self.max_rank}")
        sizes = part_sizes(self.cfg)
        self.clear(slot)
        for layer, banks in enumerate(self.banks):
            for module, (proj, part) in TARGETS.items():
                w = adapter.weights.get((layer, module))
                if w is None:
                    continue
                a, b = w
                a_bank, b_bank = banks[proj]
                outs = sizes[proj][1]
                r0, o0 = part * self.max_rank, sum(outs[:part])
                a_bank[slot, r0:r0 + a.shape[0]].copy_(a)
                b_bank[slot, o0:o0 + b.shape[0], r0:r0 + b.shape[1]].copy_(b)
            if self._smoothing is not None:
                rows, cols = self._smoothing[layer]
                b_qkv = banks["qkv_proj"][1][slot]
                b_qkv.copy_(b_qkv.float() * rows[:, None].to(b_qkv.device))
                a_o = banks["o_proj"][0][slot]
                a_o.copy_(a_o.float() * cols[None, :].to(a_o.device))

    def clear(self, slot: int) -> None:
        for banks in self.banks:
            for a_bank, b_bank in banks.values():
                a_bank[slot].zero_()
                b_bank[slot].zero_()

    def attach(self, model, ops: LoraOps) -> None:
        """Hook the banks into `model`'s projections (a LlamaForCausalLM of this config): from now
        on each adds its rows' deltas for the slots in `self.step`."""
        model.lora_step = self.step
        for layer, banks in zip(model.layers, self.banks, strict=True):
            for owner, proj in ((layer.self_attn, "qkv_proj"), (layer.self_attn, "o_proj"),
                                (layer.mlp, "gate_up_proj"), (layer.mlp, "down_proj")):
                getattr(owner, proj).lora = LoraHook(*banks[proj], self.step, ops)


@dataclass(slots=True)
class LoraHook:
    """What a Linear holds once a bank is attached: its A and B banks, the step, the ops."""

    a_bank: torch.Tensor
    b_bank: torch.Tensor
    step: LoraStep
    ops: LoraOps

    def add_(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """y (.., N) += the deltas of x (.., K)'s rows for the step's slots (nothing without slots)."""
        slots = self.step.slots
        if slots is None:
            return y
        y2 = y.view(-1, y.shape[-1])
        self.ops(y2, x.reshape(-1, x.shape[-1]), self.a_bank, self.b_bank, slots, self.step.order,
                 onehot=self.step.onehot)
        return y
