"""INT8 fidelity end to end: greedy agreement, teacher-forced top-1, first token and KL to fp32 of
the engine against transformers (fp32 weights), per KV cache dtype, on random head-dim-64 models of
the four families, with and without massive K channels (K channel pairs x16, Q / 16: the same
function), with and without the engine's K/V smoothing. Runs the engine on the CPU (torch
reference path) or CUDA (Triton path). `--exact-prefill` also measures the rule before one answer
per seed (a prefill attending its own K/V as computed, not as stored): what that rule costs.

    python benchmarks/kv_fidelity.py [--device cpu|cuda] [--seeds 4] [--prompts 16] [--tokens 32]

Figures are means over the four families and the seeds; tests/fidelity.py defines them.
"""

from __future__ import annotations

import logging
import sys
import tempfile
from pathlib import Path

import structlog

_ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(_ROOT), str(_ROOT / "clients")]  # benchmarks.*, and this checkout's pie
from benchmarks.common import DEVICE_HELP, default_device, make_parser  # noqa: E402
from pie.engine.attention import PagedAttention  # noqa: E402
from tests.fidelity import MASSIVE_K, family_fidelity, mean  # noqa: E402
from tests.helpers import ARCHS  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = make_parser(__doc__)
    ap.add_argument("--device", default=None, help=DEVICE_HELP)
    ap.add_argument("--seeds", type=int, default=4, help="random models per family (seeds 1..N); figures are means")
    ap.add_argument("--prompts", type=int, default=16, help="prompts per model")
    ap.add_argument("--tokens", type=int, default=32, help="tokens generated per prompt")
    ap.add_argument("--weight-scale", type=float, default=2.5,
                    help="multiplies the random projection and embedding weights (sharper distributions)")
    ap.add_argument("--exact-prefill", action="store_true",
                    help="also measure int8 with the prefill attending its own K/V as computed (the old rule)")
    args = ap.parse_args(argv)
    args.device = args.device or default_device()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    print("| models | cache | smoothing | prefill reads | greedy agreement | teacher-forced top-1 | first token | KL to fp32 |")
    print("|---|---|---|---|---|---|---|---|")
    fields = ("agreement", "teacher_forced", "first_token", "kl")
    runs = [(("int8", "bf16", "fp32"), True, False), (("int8",), False, False)]
    if args.exact_prefill:
        runs.append((("int8",), True, True))
    holds_exactly = PagedAttention.holds_exactly
    for massive in (None, MASSIVE_K):
        for kvs, smooth, exact_prefill in runs:
            if exact_prefill:  # the old rule: every cache "holds" what the prefill computed
                PagedAttention.holds_exactly = lambda self, dtype: True  # type: ignore[method-assign]
            sums: dict[str, list[float]] = {}
            try:
                for seed in range(1, args.seeds + 1):
                    with tempfile.TemporaryDirectory() as tmp:
                        res = family_fidelity(Path(tmp), ARCHS, kvs, prompts=args.prompts, tokens=args.tokens,
                                              seed=seed, weight_scale=args.weight_scale, massive_k=massive,
                                              device=args.device, kv_smoothing=smooth)
                    for kv in kvs:
                        acc = sums.setdefault(kv, [0.0] * len(fields))
                        for i, f in enumerate(fields):
                            acc[i] += mean(res, kv, f) / args.seeds
            finally:
                PagedAttention.holds_exactly = holds_exactly  # type: ignore[method-assign]
            for kv, (agree, forced, first, kl) in sums.items():
                models = "massive K x16" if massive else "plain"
                sm = ("on" if smooth else "off") if kv == "int8" else "-"
                reads = "own K/V as computed" if exact_prefill else "as stored"
                print(f"| {models} | {kv} | {sm} | {reads} | {agree:.3f} | {forced:.4f} | {first:.3f} | {kl:.2e} |",
                      flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
