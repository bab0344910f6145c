"""INT8 fidelity end to end: greedy agreement and teacher-forced top-1 of the engine against
transformers (fp32 weights), per KV cache dtype, on random head-dim-64 models of the four families,
with and without massive K channels (K channel pairs x16, Q / 16: the same function), with and
without the engine's K/V smoothing. Runs the engine on the CPU (torch reference path) or CUDA
(Triton path).

    python benchmarks/kv_fidelity.py [--device cpu|cuda] [--seeds 4] [--prompts 16] [--tokens 32]

Figures are means over the four families and the seeds; tests/fidelity.py defines them.
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
from pathlib import Path

import structlog
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.fidelity import MASSIVE_K, family_fidelity, mean  # noqa: E402
from tests.helpers import ARCHS  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seeds", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--weight-scale", type=float, default=2.5)
    args = ap.parse_args(argv)
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    print("| models | cache | smoothing | greedy agreement | teacher-forced top-1 | first token |")
    print("|---|---|---|---|---|---|")
    for massive in (None, MASSIVE_K):
        for kvs, smooth in ((("int8", "bf16", "fp32"), True), (("int8",), False)):
            sums: dict[str, list[float]] = {}
            for seed in range(1, args.seeds + 1):
                with tempfile.TemporaryDirectory() as tmp:
                    res = family_fidelity(Path(tmp), ARCHS, kvs, prompts=args.prompts, tokens=args.tokens, seed=seed,
                                          weight_scale=args.weight_scale, massive_k=massive, device=args.device,
                                          kv_smoothing=smooth)
                for kv in kvs:
                    acc = sums.setdefault(kv, [0.0, 0.0, 0.0])
                    for i, f in enumerate(("agreement", "teacher_forced", "first_token")):
                        acc[i] += mean(res, kv, f) / args.seeds
            for kv, (agree, forced, first) in sums.items():
                models = "massive K x16" if massive else "plain"
                sm = ("on" if smooth else "off") if kv == "int8" else "-"
                print(f"| {models} | {kv} | {sm} | {agree:.3f} | {forced:.4f} | {first:.3f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
