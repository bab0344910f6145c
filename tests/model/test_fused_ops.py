"""The model takes its fused elementwise ops from its owner (FusedOps, like the attention backend):
they are called where the torch ops would run, only for inference, and dropped again with None.
The ops here are recording stand-ins with the torch math; tests/kernels/test_triton_fused.py runs
the model with the real Triton kernels."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from pie.model.attention import DenseCausalAttention
from pie.model.config import ModelConfig
from pie.model.layers import FusedOps
from pie.model.llama import LlamaForCausalLM
from pie.model.rope import apply_rotary


def tiny_model(qk_norm: bool, seed: int) -> LlamaForCausalLM:
    cfg = ModelConfig.from_hf({
        "model_type": "qwen3" if qk_norm else "llama", "architectures": ["X"], "vocab_size": 97,
        "hidden_size": 48, "intermediate_size": 80, "num_hidden_layers": 3, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 256})
    model = LlamaForCausalLM(cfg)
    model.init_weights(std=0.2, generator=torch.Generator().manual_seed(seed))
    for name, p in model.named_parameters():  # norms away from 1, so that a skipped weight shows
        if name.endswith("norm.weight"):
            p.data.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(seed + len(name)))
    return model.eval()


class Recording:
    """FusedOps with the torch math, counting calls."""

    def __init__(self) -> None:
        self.calls = {"rms_norm": 0, "silu_mul": 0, "rotary_": 0}

    def rms_norm(self, x, weight, eps, residual):
        self.calls["rms_norm"] += 1
        s = x if residual is None else residual.copy_(x + residual)
        return weight * F.rms_norm(s.float(), (s.shape[-1],), eps=eps).to(s.dtype), s

    def silu_mul(self, gate_up):
        self.calls["silu_mul"] += 1
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def rotary_(self, qk, cos, sin):
        self.calls["rotary_"] += 1
        return qk.copy_(apply_rotary(qk, cos, sin))


def _forward(model: LlamaForCausalLM, ids: torch.Tensor, lens: list[int]) -> torch.Tensor:
    positions = torch.cat([torch.arange(n) for n in lens])
    return model.compute_logits(model(ids, positions, DenseCausalAttention(lens, model.attn_scale)))


@pytest.mark.parametrize("qk_norm", [False, True])
def test_fused_ops_replace_the_torch_ops_for_inference_only(rng: random.Random, qk_norm: bool) -> None:
    model = tiny_model(qk_norm, rng.randrange(2**31))
    lens = [rng.randint(1, 9) for _ in range(3)]
    ids = torch.tensor([rng.randrange(97) for _ in range(sum(lens))])
    with torch.no_grad():
        want = _forward(model, ids, lens)
        ops = Recording()
        _: FusedOps = ops  # the stand-in satisfies the protocol
        model.use_fused_ops(ops)
        got = _forward(model, ids, lens)
    layers = model.config.num_hidden_layers
    # Two norms per layer and the final one; Qwen3's per-head q/k norms (3-D) and its RoPE (after
    # them, on q and k apart) keep the torch ops.
    assert ops.calls == {"rms_norm": 2 * layers + 1, "silu_mul": layers, "rotary_": 0 if qk_norm else layers}
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

    ops.calls = dict.fromkeys(ops.calls, 0)
    _forward(model, ids, lens).sum().backward()  # autograd records: the torch ops run
    assert set(ops.calls.values()) == {0}
    model.use_fused_ops(None)
    with torch.no_grad():
        torch.testing.assert_close(_forward(model, ids, lens), want, rtol=0, atol=0)
    assert set(ops.calls.values()) == {0}
