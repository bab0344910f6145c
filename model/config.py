"""The decoder's shape and numerics, read from a Hugging Face `config.json`.

One `ModelConfig` covers the Llama family as this package implements it: Llama, Mistral, Qwen2
and Qwen3. They differ only in a few switches (biases, q/k norm, RoPE scaling, sliding window),
which `from_hf` reads from whichever spelling of the config the checkpoint uses:

- transformers 5 writes `rope_parameters: {"rope_type": ..., "rope_theta": ..., <scaling keys>}`
  and `dtype`;
- older checkpoints write a top-level `rope_theta`, `rope_scaling: {"type"|"rope_type": ...}` (or
  null) and `torch_dtype`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from os import PathLike
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")

# RoPE variants whose inverse frequencies model/rope.py computes. "dynamic" (dynamic NTK) rescales
# the frequencies with the sequence length at run time, which a cached cos/sin table and a paged KV
# cache cannot follow, so it is refused rather than silently served wrong.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def as_token_ids(value: int | list[int] | tuple[int, ...] | None) -> tuple[int, ...]:
    """A config's token id field (`eos_token_id` may be an int, a list, or null) as a tuple."""
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


@dataclass(slots=True)
class ModelConfig:
    model_type: str  # "llama" | "mistral" | "qwen2" | "qwen3": picks the per-family defaults below
    architecture: str  # architectures[0] of config.json, e.g. "LlamaForCausalLM" (reported, not used)
    vocab_size: int  # rows of embed_tokens / lm_head; may exceed the tokenizer's (padded for speed)
    hidden_size: int  # width of the residual stream
    intermediate_size: int  # width of the SwiGLU MLP's gate and up projections
    num_hidden_layers: int
    num_attention_heads: int  # query heads
    num_key_value_heads: int  # K/V heads; < num_attention_heads means grouped-query attention
    head_dim: int  # Qwen3 and Mistral-Nemo set it explicitly; otherwise hidden_size // heads
    rms_norm_eps: float
    rope_theta: float  # RoPE base wavelength
    # RoPE scaling with its `rope_type` ("linear" | "llama3" | "yarn") and that type's keys; None for
    # plain RoPE. For llama3/yarn `original_max_position_embeddings` is always filled in.
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int  # longest context the checkpoint was built for
    tie_word_embeddings: bool  # lm_head shares embed_tokens' weight
    attention_bias: bool  # bias on q/k/v projections (Qwen2 always; Llama when attention_bias)
    o_proj_bias: bool  # bias on o_proj (Llama's attention_bias covers it, Qwen2's does not)
    mlp_bias: bool  # bias on gate/up/down projections (Llama's mlp_bias; false elsewhere)
    qk_norm: bool  # Qwen3: RMSNorm over head_dim on each q and k head, before RoPE
    # Width of sliding-window attention where the checkpoint uses it (Mistral v0.1, Qwen2 with
    # use_sliding_window), else None: a query then sees only its last `sliding_window` keys.
    sliding_window: int | None
    dtype: str | None = None  # dtype the weights were saved in ("bfloat16", ...), informational
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)  # from config.json only
    hidden_act: str = "silu"  # the MLP's activation; only SiLU (SwiGLU) is implemented
    # Layers that use the sliding window, when not all do (Qwen2's layer_types / max_window_layers);
    # None = every layer (when sliding_window is set).
    sliding_window_layers: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unsupported model_type {self.model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
        if self.hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {self.hidden_act!r}; only 'silu' is implemented")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) is not a multiple of "
                             f"num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.rope_scaling is not None:
            rope_type = self.rope_scaling.get("rope_type")
            if rope_type == "dynamic":
                raise ValueError("rope_type 'dynamic' (dynamic NTK scaling) is not supported: it changes the "
                                 "frequencies with the sequence length, which a KV cache cannot follow")
            if rope_type not in SUPPORTED_ROPE_TYPES:
                raise ValueError(f"unsupported rope_type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
            if rope_type in ("linear", "llama3") and not self.rope_scaling.get("factor"):
                raise ValueError(f"rope_type {rope_type!r} needs a 'factor'")
            if rope_type == "llama3":
                missing = {"low_freq_factor", "high_freq_factor"} - self.rope_scaling.keys()
                if missing:
                    raise ValueError(f"rope_type 'llama3' needs {sorted(missing)}")

    @property
    def max_model_len(self) -> int:
        """Longest sequence (prompt + output) served: the checkpoint's context."""
        return self.max_position_embeddings

    def layer_window(self, layer_idx: int) -> int | None:
        """The sliding window of layer `layer_idx`, None where it attends to the whole context."""
        if self.sliding_window is None:
            return None
        if self.sliding_window_layers is not None and layer_idx not in self.sliding_window_layers:
            return None
        return self.sliding_window

    @property
    def attn_scale(self) -> float:
        """Softmax scale of attention, head_dim ** -0.5 for every supported family."""
        return self.head_dim ** -0.5

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_hf(cls, config: dict[str, Any] | str | PathLike[str]) -> ModelConfig:
        """From a config.json dict, a config.json path, or a model folder holding one."""
        if not isinstance(config, dict):
            path = Path(config)
            if path.is_dir():
                path = path / "config.json"
            if not path.is_file():
                raise FileNotFoundError(f"no config.json at {path}")
            config = json.loads(path.read_text())
        c = config
        model_type = c.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unsupported model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
        heads = int(c["num_attention_heads"])
        head_dim = c.get("head_dim") or int(c["hidden_size"]) // heads
        max_pos = int(c.get("max_position_embeddings", 2048))
        rope_theta, rope_scaling = _read_rope(c, max_pos)
        if c.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError("partial_rotary_factor != 1 is not supported")

        attention_bias = bool(c.get("attention_bias", False))
        o_proj_bias = attention_bias
        if model_type == "qwen2":
            # Qwen2 always has q/k/v biases and never an o_proj bias; its config has no flag for it.
            attention_bias, o_proj_bias = True, False

        window, window_layers = _read_sliding_window(c, model_type)
        return cls(
            model_type=model_type,
            architecture=(c.get("architectures") or ["?"])[0],
            vocab_size=int(c["vocab_size"]),
            hidden_size=int(c["hidden_size"]),
            intermediate_size=int(c["intermediate_size"]),
            num_hidden_layers=int(c["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(c.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            o_proj_bias=o_proj_bias,
            mlp_bias=bool(c.get("mlp_bias", False)),
            qk_norm=model_type == "qwen3",
            sliding_window=window,
            sliding_window_layers=window_layers,
            dtype=c.get("dtype") or c.get("torch_dtype"),
            bos_token_id=c.get("bos_token_id"),
            eos_token_ids=as_token_ids(c.get("eos_token_id")),
            hidden_act=c.get("hidden_act", "silu"),
        )


def _read_rope(c: dict[str, Any], max_pos: int) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, normalized rope_scaling) from either config spelling (see the module docstring)."""
    params = c.get("rope_parameters") or c.get("rope_scaling") or {}
    if any(isinstance(v, dict) for v in params.values()):
        raise ValueError("per-layer-type rope_parameters are not supported")
    params = dict(params)
    theta = float(params.pop("rope_theta", None) or c.get("rope_theta") or 10000.0)
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if rope_type == "default":
        return theta, None
    scaling = {"rope_type": rope_type, **params}
    if rope_type in ("llama3", "yarn"):
        # Like transformers: a top-level original_max_position_embeddings wins (Phi-3 style), then the
        # rope dict's own, then max_position_embeddings.
        if "original_max_position_embeddings" in c:
            scaling["original_max_position_embeddings"] = c["original_max_position_embeddings"]
        scaling.setdefault("original_max_position_embeddings", max_pos)
    return theta, scaling


def _read_sliding_window(c: dict[str, Any], model_type: str) -> tuple[int | None, tuple[int, ...] | None]:
    """(window, the layers that use it or None for all), as transformers applies them."""
    window = c.get("sliding_window")
    if window is None:
        return None, None
    if model_type == "mistral":
        return int(window), None  # Mistral applies its window on every layer whenever it is set
    if model_type in ("qwen2", "qwen3"):
        if not c.get("use_sliding_window", False):
            return None, None
        layers = int(c["num_hidden_layers"])
        layer_types = c.get("layer_types")
        if layer_types is not None:
            used = tuple(i for i, t in enumerate(layer_types) if t == "sliding_attention")
        else:  # older configs: layers from max_window_layers on use the window
            used = tuple(range(int(c.get("max_window_layers", 0)), layers))
        if not used:
            return None, None
        return int(window), None if len(used) == layers else used
    return None, None  # Llama has no sliding window
