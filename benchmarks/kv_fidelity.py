"""INT8 fidelity end to end against transformers (fp32 weights), per KV cache dtype and int8
smoothing mode (`--kv-smoothing`: auto, on, off; model/smoothing.py).

Random models: greedy agreement, teacher-forced top-1, first token and KL to fp32, on random
head-dim-64 models of the four families, with and without massive K channels (K channel pairs
x16, Q / 16: the same function). `--exact-prefill` also measures the rule before one answer per
seed (a prefill attending its own K/V as computed, not as stored): what that rule costs.

`--real`: the same on a trained checkpoint, SmolLM2-135M-Instruct (tests/smollm2.py builds
it), with text prompts from Python's documentation, and its perplexity and teacher-forced top-1
over that text in 512-token prompts (tests/fidelity.py: text_fidelity).

    python -m benchmarks.kv_fidelity [--device cpu|cuda] [--seeds 4] [--prompts 16] [--tokens 32]
    python -m benchmarks.kv_fidelity --real [--device cpu|cuda]

Figures of the random models are means over the four families and the seeds (one model each), with
the standard error of the mean over those models (± SE): greedy agreement, a common prefix, moves by
whole runs of tokens with one near-tie, so compare modes by the SE, or with more seeds. tests/fidelity.py
defines the figures.
"""

from __future__ import annotations

import logging
import statistics
import sys
import tempfile
from pathlib import Path

import structlog

from benchmarks.common import DEVICE_HELP, default_device, make_parser
from pie.engine.config import KV_SMOOTHING
from pie.engine.runner.attention import PagedAttention
from tests.fidelity import MASSIVE_K, docs_text, family_fidelity, measure, text_fidelity, text_prompts
from tests.helpers import ARCHS

HEADER = "| models | cache | smoothing | prefill reads | greedy agreement | teacher-forced top-1 | first token | KL to fp32 |"


def random_models(args) -> None:
    print(HEADER)
    print("|---|---|---|---|---|---|---|---|")
    fields = ("agreement", "teacher_forced", "first_token", "kl")
    # (kv dtypes, int8 smoothing mode, prefill reads its own K/V as computed): the float caches once
    runs = [(("int8", "bf16", "fp32") if i == 0 else ("int8",), mode, False) for i, mode in enumerate(args.kv_smoothing)]
    if args.exact_prefill:
        runs.append((("int8",), args.kv_smoothing[0], True))
    holds_exactly = PagedAttention.holds_exactly
    for massive in (None, MASSIVE_K):
        for kvs, mode, exact_prefill in runs:
            if exact_prefill:  # the old rule: every cache "holds" what the prefill computed
                PagedAttention.holds_exactly = lambda self, dtype: True  # type: ignore[method-assign]
            per_model: dict[str, list[list[float]]] = {}  # kv -> field -> one value per model
            try:
                for seed in range(1, args.seeds + 1):
                    with tempfile.TemporaryDirectory() as tmp:
                        res = family_fidelity(Path(tmp), ARCHS, kvs, prompts=args.prompts, tokens=args.tokens,
                                              seed=seed, weight_scale=args.weight_scale, massive_k=massive,
                                              device=args.device, kv_smoothing=mode)
                    for kv in kvs:
                        values = per_model.setdefault(kv, [[] for _ in fields])
                        for i, f in enumerate(fields):
                            values[i] += [getattr(r[kv], f) for r in res.values()]
            finally:
                PagedAttention.holds_exactly = holds_exactly  # type: ignore[method-assign]
            for kv, (agree, forced, first, kl) in per_model.items():
                models = "massive K x16" if massive else "plain"
                sm = mode if kv == "int8" else "-"
                reads = "own K/V as computed" if exact_prefill else "as stored"
                print(f"| {models} | {kv} | {sm} | {reads} | {_mean_se(agree, '.3f')} | {_mean_se(forced, '.4f')} | "
                      f"{_mean_se(first, '.3f')} | {statistics.mean(kl):.2e} |", flush=True)


def _mean_se(values: list[float], fmt: str) -> str:
    """The mean over the models, and its standard error where there are several."""
    m = format(statistics.mean(values), fmt)
    return m if len(values) < 2 else f"{m} ± {format(statistics.stdev(values) / len(values) ** 0.5, fmt)}"


def real_checkpoint(args) -> None:
    from tests.smollm2 import build

    folder = build()
    text = docs_text()
    print("| SmolLM2-135M-Instruct | cache | smoothing | perplexity (transformers) | against fp32 weights' | "
          "teacher-forced top-1 (text) | greedy agreement | teacher-forced top-1 (greedy) | KL to fp32 |")
    print("|---|---|---|---|---|---|---|---|---|")
    prompts = text_prompts(folder, text, args.prompts)
    for i, mode in enumerate(args.kv_smoothing):
        kvs = ("fp32", "bf16", "int8") if i == 0 else ("int8",)
        scored = text_fidelity(folder, kvs, text, device=args.device, kv_smoothing=mode)
        greedy = measure(folder, kvs, prompts=prompts, tokens=args.tokens, seed=0, device=args.device,
                         kv_smoothing=mode)
        for kv in kvs:
            t, g = scored[kv], greedy[kv]
            print(f"| {t.tokens} tokens | {kv} | {mode if kv == 'int8' else '-'} | {t.ppl:.4f} ({t.ppl_ref:.4f}) | "
                  f"{100 * (t.ppl / t.ppl_ref - 1):+.3f}% | {t.teacher_forced:.4f} | {g.agreement:.3f} | "
                  f"{g.teacher_forced:.4f} | {g.kl:.2e} |", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = make_parser(__doc__)
    ap.add_argument("--device", default=None, help=DEVICE_HELP)
    ap.add_argument("--real", action="store_true", help="the trained checkpoint (SmolLM2-135M-Instruct) instead")
    ap.add_argument("--kv-smoothing", default=",".join(KV_SMOOTHING),
                    help="int8 smoothing modes to measure, comma-separated; the first also runs the float caches")
    ap.add_argument("--seeds", type=int, default=4, help="random models per family (seeds 1..N); figures are means")
    ap.add_argument("--prompts", type=int, default=16, help="prompts per model")
    ap.add_argument("--tokens", type=int, default=32, help="tokens generated per prompt")
    ap.add_argument("--weight-scale", type=float, default=2.5,
                    help="multiplies the random projection and embedding weights (sharper distributions)")
    ap.add_argument("--exact-prefill", action="store_true",
                    help="also measure int8 with the prefill attending its own K/V as computed (the old rule)")
    args = ap.parse_args(argv)
    args.device = args.device or default_device()
    args.kv_smoothing = [m for m in args.kv_smoothing.split(",") if m]
    if not args.kv_smoothing or set(args.kv_smoothing) - set(KV_SMOOTHING):
        ap.error(f"--kv-smoothing: modes among {KV_SMOOTHING}")
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    if args.real:
        real_checkpoint(args)
    else:
        random_models(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
