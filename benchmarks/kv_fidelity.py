"""End-to-end greedy agreement of the int8 KV cache against the bf16 and fp32 caches, on the tiny
random parity models of the tests (Llama, Mistral, Qwen2, Qwen3; weights x4 so that distributions
are not flat). Runs the engine on the CPU (torch reference path) or CUDA (Triton path).

    python benchmarks/kv_fidelity.py [--device cpu|cuda] [--prompts 16] [--tokens 32]

Two figures per pair: exact greedy match of the whole continuation (compounds: one near-tie flip
changes the rest) and mean common-prefix length; plus teacher-forced top-1 agreement of the int8
engine's own greedy choices against the fp32-cache engine's logits on the same context (does not
compound).
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engine.config import EngineConfig  # noqa: E402
from engine.engine import LLMEngine  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from tests.helpers import ARCHS, make_hf_model_dir  # noqa: E402


def generate(model_dir, kv: str, device: str, prompts, n) -> list[list[int]]:
    dtype = "bf16" if device == "cuda" else "fp32"
    eng = LLMEngine(EngineConfig(model=str(model_dir), device=device, dtype=dtype, kv_cache_dtype=kv,
                                 num_kv_blocks=256, max_num_seqs=64))
    return eng.generate(prompts, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))


def prefix_len(a, b) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=32)
    args = ap.parse_args(argv)
    rng = random.Random(0)
    print(f"| model | int8 = bf16 (whole) | int8 = fp32 (whole) | bf16 = fp32 (whole) | "
          f"int8 vs bf16 common prefix | int8 teacher-forced top-1 vs fp32 |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for arch in ARCHS:
            model_dir = make_hf_model_dir(Path(tmp), arch, seed=rng.randrange(2**31), weight_scale=4.0)
            prompts = [[rng.randrange(3, 512) for _ in range(rng.randrange(8, 64))] for _ in range(args.prompts)]
            out = {kv: generate(model_dir, kv, args.device, prompts, args.tokens) for kv in ("int8", "bf16", "fp32")}
            same = lambda a, b: sum(x == y for x, y in zip(out[a], out[b]))  # noqa: E731
            prefix = sum(prefix_len(x, y) for x, y in zip(out["int8"], out["bf16"])) / len(prompts)
            # teacher-forced: fp32-cache engine's greedy continuation of each int8 prefix, one token
            ref = LLMEngine(EngineConfig(model=str(model_dir), device=args.device,
                                         dtype="bf16" if args.device == "cuda" else "fp32",
                                         kv_cache_dtype="fp32", num_kv_blocks=256, max_num_seqs=64))
            contexts = [p + o[:i] for p, o in zip(prompts, out["int8"]) for i in range(args.tokens)]
            wanted = [o[i] for o in out["int8"] for i in range(args.tokens)]
            got = ref.generate(contexts, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
            tf = sum(g[0] == w for g, w in zip(got, wanted)) / len(wanted)
            n = len(prompts)
            print(f"| {arch} | {same('int8', 'bf16')}/{n} | {same('int8', 'fp32')}/{n} | {same('bf16', 'fp32')}/{n} | "
                  f"{prefix:.1f}/{args.tokens} | {100 * tf:.1f}% |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
