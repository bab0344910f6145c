"""Long-context work offline: an 8B-class GQA model (Llama-3.1-8B's dimensions, random bf16
weights), 256 requests all queued at once, prompts log-normal (median 800 tokens, sigma 0.8, up to
6,000), a third of them after one shared 1,500-token prefix, 128-1,024 tokens out (greedy, EOS
ignored). int8 and bf16 pages in one run, each repeated (median and spread), first with memory
ample (the pool from --gpu-memory-fraction's default), then with the KV pool fixed at --kv-gib.

    python benchmarks/long_context.py [--kv-gib 8] [--repeats 3]
    python benchmarks/long_context.py --tiny       # CPU-sized smoke run of the same code path

Beside tokens/s, the ideal time of the work (benchmarks/mixed.py's: prefill FLOPs at --tflops, and
for each decode step run, the weights plus every scheduled sequence's K/V once at the copy
bandwidth measured in the same run) and the share of it reached; int8 pages read half the K/V
bytes, so their ideal is lower (1.17x at this work on an H200). Where the time went, per dtype.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

_ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(_ROOT), str(_ROOT / "clients")]  # benchmarks.*, and this checkout's pie
from benchmarks.common import DEVICE_HELP, SizedFlags, default_device, make_parser  # noqa: E402
from benchmarks.mixed import SHAPES, build_model, copy_bandwidth, report, run_engine, workload  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = make_parser(__doc__)
    ap.add_argument("--tiny", action="store_true", help="CPU-sized model (the tiny shape) and workload")
    ap.add_argument("--device", default=None, help=DEVICE_HELP)
    sized = SizedFlags(ap)
    sized.add("--shape", "llama-8b", "tiny", "model shape", type=str, choices=sorted(SHAPES))
    sized.add("--requests", 256, 12, "requests, all queued at once")
    sized.add("--prompt-median", 800, 60, "median prompt length in tokens (log-normal, sigma 0.8)")
    sized.add("--prompt-max", 6000, 300, "longest prompt in tokens (longer draws are clipped)")
    sized.add("--prefix-len", 1500, 96, "tokens of the prefix a third of the prompts share")
    sized.add("--out-min", 128, 8, "fewest tokens generated per request")
    sized.add("--out-max", 1024, 32, "most tokens generated per request")
    sized.add("--max-num-seqs", 256, 16, "running sequences per step at most")
    sized.add("--max-batched-tokens", 8192, 512, "tokens per step at most (prefill chunks + decodes)")
    sized.add("--kv-gib", 8.0, 0.05, "KV pool in GiB for the fixed-budget pass (0 skips it)", type=float)
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per KV cache dtype; the median is reported")
    ap.add_argument("--kv", default="int8,bf16", help="KV cache dtypes to run, comma-separated")
    ap.add_argument("--tflops", type=float, default=790.0, help="dense bf16 rate for the ideal prefill time")
    ap.add_argument("--decode-stall-factor", type=float, default=0.0,
                    help="the engine's stall bound, off at 0: offline work queued at once wants whole "
                         "budgets (the served bound is measured by benchmarks/serving.py)")
    ap.add_argument("--out", default=None, help="JSON file for every figure (default: none written)")
    args = ap.parse_args(argv)
    sized.fill(args, args.tiny)
    args.device = args.device or default_device()
    arch, shape = SHAPES[args.shape]
    prompts, outs = workload(args.requests, shape["vocab_size"], args.prompt_median, args.prompt_max,
                             args.prefix_len, (args.out_min, args.out_max), prefix_every=3)
    max_len = args.prefix_len + args.prompt_max + args.out_max + 16
    copy_bw = copy_bandwidth(args.device)
    passes = {"memory ample": None}
    if args.kv_gib:
        passes[f"KV pool {args.kv_gib:g} GiB"] = args.kv_gib
    figures: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        params = build_model(Path(tmp), arch, shape, torch.bfloat16 if args.device == "cuda" else torch.float32,
                             max_len=max_len)
        print(f"# {args.device}: {args.shape}-shaped random {arch} ({params / 1e9:.2f}B params); {args.requests} "
              f"requests, prompts median {statistics.median(map(len, prompts)):.0f} (max {max(map(len, prompts))}) "
              f"tokens, {sum(map(len, prompts)):,} prompt tokens, outputs {args.out_min}-{args.out_max} "
              f"({sum(outs):,} tokens); copy bandwidth {copy_bw / 1e12:.2f} TB/s")
        weight_bytes = params * (2 if args.device == "cuda" else 4)
        for name, kv_gib in passes.items():
            run_args = argparse.Namespace(device=args.device, max_num_seqs=args.max_num_seqs,
                                          max_batched_tokens=args.max_batched_tokens, kv_gib=kv_gib,
                                          repeats=args.repeats, single=False, hf=0,
                                          decode_stall_factor=args.decode_stall_factor)
            results = {kv: run_engine(Path(tmp), kv, prompts, outs, run_args) for kv in args.kv.split(",")}
            print(f"## {name}")
            summary = report(results, prompts, params, weight_bytes, copy_bw, args.tflops, args.max_num_seqs,
                             label=f" ({name})")
            figures[name] = {kv: {k: v for k, v in s.items()} for kv, s in summary.items()}
    if args.out:
        Path(args.out).write_text(json.dumps(dict(shape=args.shape, copy_tbs=copy_bw / 1e12, passes=figures),
                                             indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
