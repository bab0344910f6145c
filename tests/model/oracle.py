"""The tiny checkpoints the model tests compare against transformers, and how they compare."""

import torch

from pie.model.attention import DenseCausalAttention

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
# max_position_embeddings (512) / original (128) == factor, as transformers expects for YaRN
YARN_ROPE = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}

# case name -> (arch, config overrides). Weights scaled x8 so attention is far from uniform and a
# wrong position, mask or head mapping moves the logits well past the tolerance.
CASES: dict[str, tuple[str, dict]] = {
    "llama": ("llama", {}),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "llama-bias": ("llama", {"attention_bias": True, "mlp_bias": True}),
    "llama-rope-llama3": ("llama", {"rope_scaling": LLAMA3_ROPE}),
    "llama-rope-linear": ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 4.0}}),
    "mistral": ("mistral", {}),
    "qwen2": ("qwen2", {}),
    "qwen2-tied": ("qwen2", {"tie_word_embeddings": True}),
    "qwen2-yarn": ("qwen2", {"rope_scaling": YARN_ROPE}),
    "qwen3": ("qwen3", {}),
    "qwen3-tied": ("qwen3", {"tie_word_embeddings": True}),
}
WEIGHT_SCALE = 8.0

SEQ_LENS = (5, 17, 33)
TOLERANCE = 1e-4  # max |ours - theirs| / max |theirs|


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def prompts(vocab_size: int, lens=SEQ_LENS, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=g) for n in lens]


def packed_logits(model, ids: list[torch.Tensor], positions: torch.Tensor | None = None) -> torch.Tensor:
    lens = [len(x) for x in ids]
    if positions is None:
        positions = torch.cat([torch.arange(n) for n in lens])
    with torch.inference_mode():
        hidden = model(torch.cat(ids), positions, DenseCausalAttention(lens, model.attn_scale))
        return model.compute_logits(hidden)  # (T, V)


def hf_logits(hf, ids: list[torch.Tensor]) -> torch.Tensor:
    with torch.inference_mode():
        return torch.cat([hf(x[None]).logits[0] for x in ids])  # each sequence alone, batch 1
