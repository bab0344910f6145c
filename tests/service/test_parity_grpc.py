"""Greedy generation through the running gRPC server against transformers, for every architecture.

fp32 cache: exactly transformers' greedy ids. int8 cache: >= 90% of the int8 server's greedy picks
are transformers' argmax given the same context (teacher-forced agreement, which does not compound
after a first near-tie flip; the common prefix is printed too).
"""

from __future__ import annotations

import pytest
import torch

from pie.engine.config import EngineConfig
from pie.service.server import BackgroundServer, ServerConfig
from pie_client import Client
from tests.helpers import ARCHS, make_hf_model_dir

# slow: starts a BackgroundServer per model family
pytestmark = pytest.mark.slow

N_TOKENS = 32


def _serve(model_dir, kv_cache_dtype):
    cfg = EngineConfig(model=str(model_dir), device="cpu", kv_cache_dtype=kv_cache_dtype, num_kv_blocks=64,
                       max_num_seqs=8, max_num_batched_tokens=128)
    return BackgroundServer(ServerConfig(port=0, grace_s=1), cfg)


def _generate_all(address, prompts):
    with Client(address, timeout=120) as c:
        return [c.generate(p, max_tokens=N_TOKENS, temperature=0, ignore_eos=True).token_ids for p in prompts]


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    """transformers' argmax loop with EOS treated as any other token (what ignore_eos asks of us;
    `generate(min_new_tokens=...)` would instead forbid EOS)."""
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(hf(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(prompt):]


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_through_grpc_matches_transformers(rng, tmp_path, arch):
    from transformers import AutoModelForCausalLM

    model_dir = make_hf_model_dir(tmp_path, arch, weight_scale=4.0)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randrange(4, 48))] for _ in range(4)]
    with _serve(model_dir, "fp32") as s:
        fp32 = _generate_all(s.address, prompts)
    with _serve(model_dir, "int8") as s:
        int8 = _generate_all(s.address, prompts)

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    agree = prefix = 0
    with torch.inference_mode():
        for p, ours, quant in zip(prompts, fp32, int8):
            ref = hf_greedy(hf, p, N_TOKENS)
            assert ours == ref, f"{arch}: fp32-cache greedy ids differ from transformers"
            # teacher-forced: transformers' argmax after each prefix of the int8 server's output
            logits = hf(torch.tensor([p + quant[:-1]])).logits[0, len(p) - 1:]
            agree += int((logits.argmax(-1) == torch.tensor(quant)).sum())
            prefix += next((i for i, (a, b) in enumerate(zip(quant, ref)) if a != b), N_TOKENS)
    total = N_TOKENS * len(prompts)
    print(f"{arch}: int8 greedy teacher-forced agreement {agree}/{total}, common prefix {prefix}/{total}")
    assert agree / total >= 0.9
