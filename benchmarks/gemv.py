"""One row through each projection of a model on the GPU (issue 64): cuBLAS (F.linear) against
kernels/triton_gemv.py's launch configs, as a fraction of the copy bandwidth.

    python -m benchmarks.gemv                              # Llama-1B and Qwen3-4B shapes, every candidate config
    python -m benchmarks.gemv --shapes qwen2-7b --configs 16x512x1,8x256x4 --out gemv.json

A one-stream decode step reads every weight once: its GEMMs' bound is the weights' bytes over the
copy bandwidth, and cuBLAS reached 80% (Llama-1B) and 86% (Qwen3-4B) of it at one row
(benchmarks/HISTORY.md, tenth session). Per projection (qkv, o, gate_up, down, and the LM head),
each candidate is first checked against F.linear (bf16, with a bias where the shape has one), then
timed by `attention.bench_graph` (back-to-back calls replayed from one CUDA graph) over as many
copies of the weight as fill 256 MB, taken in turn, so that no call finds its weight in L2 (a
model's layers never do). The table gives microseconds per call and TB/s, F.linear's and the
fastest config's; the last line per shape sums a step (the layers' projections and the head).

Configs are BLOCK_NxBLOCK_KxSPLIT_K[xWARPS[xSTAGES]] (kernels/triton_gemv.GemvConfig); each one
compiles once per (N, K), so the candidate list is short. Rows that would start after --budget-s
seconds are skipped (the call's limit).
"""

from __future__ import annotations

import json
import math
import sys
import time

import torch

from benchmarks.common import make_parser, require_cuda
from benchmarks.mixed import SHAPES

NEEDS_GPU = True  # read by `pie bench` (with ast, without importing this file)

CANDIDATES = ("16x512x1", "8x512x1", "32x256x1", "16x1024x1x8x2", "32x512x1x8", "64x128x1x4x4",
              "8x256x2", "16x512x2", "4x512x4", "8x1024x4x8x2", "16x256x4x4x4", "8x512x8")


def parse_config(text: str):
    from pie.kernels.triton_gemv import GemvConfig

    parts = [int(v) for v in text.split("x")]
    if not 3 <= len(parts) <= 5:
        raise ValueError(f"config {text!r}: BLOCK_NxBLOCK_KxSPLIT_K[xWARPS[xSTAGES]]")
    names = ("block_n", "block_k", "split_k", "num_warps", "num_stages")
    return GemvConfig(**dict(zip(names, parts)))


def projections(shape: str) -> dict[str, tuple[int, int, bool]]:
    """name: (N, K, bias) of a shape of benchmarks/mixed.py, the fused projections as the model
    holds them."""
    arch, c = SHAPES[shape]
    hidden, inter, hq, hkv = c["hidden_size"], c["intermediate_size"], c["num_attention_heads"], c["num_key_value_heads"]
    d = c.get("head_dim", hidden // hq)
    return {"qkv": ((hq + 2 * hkv) * d, hidden, arch == "qwen2"), "o": (hidden, hq * d, False),
            "gate_up": (2 * inter, hidden, False), "down": (hidden, inter, False),
            "lm_head": (c["vocab_size"], hidden, False)}


def main(argv: list[str] | None = None) -> int:
    ap = make_parser(__doc__)
    ap.add_argument("--shapes", default="llama-1b,qwen3-4b", help="model shapes (benchmarks/mixed.py), comma-separated")
    ap.add_argument("--configs", default=",".join(CANDIDATES), help="launch configs, comma-separated (above)")
    ap.add_argument("--budget-s", type=float, default=480.0, help="no row starts after this many seconds")
    ap.add_argument("--out", default=None, help="JSON file of every timing (default: none written)")
    args = ap.parse_args(argv)
    require_cuda(ap)
    from benchmarks.attention import bench_graph, copy_bandwidth
    from pie.kernels.triton_gemv import gemv

    configs = {text: parse_config(text) for text in args.configs.split(",")}
    started = time.perf_counter()
    copy_bw = copy_bandwidth()
    gen = torch.Generator(device="cuda").manual_seed(0)
    print(f"# {torch.cuda.get_device_name()}, bf16, one row; copy bandwidth {copy_bw / 1e12:.2f} TB/s; "
          "microseconds per call (CUDA graph replay, weights not in L2)")
    results: dict = {}
    for shape in args.shapes.split(","):
        layers = SHAPES[shape][1]["num_hidden_layers"]
        print(f"\n## {shape}\n")
        print("| projection | N x K | MB | F.linear us (TB/s) | best gemv us (TB/s) | best config | gemv / F.linear |")
        print("|---|---|---|---|---|---|---|")
        step = {"F.linear": 0.0, "gemv": 0.0, "bytes": 0.0}
        for name, (n, k, has_bias) in projections(shape).items():
            if time.perf_counter() - started > args.budget_s:
                print(f"| {name} | skipped: past --budget-s {args.budget_s:.0f} |")
                continue
            nbytes = n * k * 2
            copies = max(1, math.ceil((256 << 20) / nbytes))
            weights = [torch.randn(n, k, device="cuda", generator=gen, dtype=torch.bfloat16) * k ** -0.5
                       for _ in range(copies)]
            bias = torch.randn(n, device="cuda", generator=gen, dtype=torch.bfloat16) if has_bias else None
            x = torch.randn(1, k, device="cuda", generator=gen, dtype=torch.bfloat16)
            out = torch.empty(1, n, device="cuda", dtype=torch.bfloat16)  # the candidates write here
            want = torch.nn.functional.linear(x, weights[0], bias)
            turn = iter(range(1 << 62))

            def base() -> None:
                torch.nn.functional.linear(x, weights[next(turn) % copies], bias)

            times = {"F.linear": bench_graph(base)}
            for text, cfg in configs.items():
                got = gemv(x, weights[0], bias, config=cfg)
                err = float((got.float() - want.float()).abs().max() / want.float().abs().max())
                if not err < 2e-2:
                    print(f"| {name} | {text}: FAIL, max error {err:.3g} of the largest output |")
                    continue

                def candidate(cfg=cfg) -> None:
                    gemv(x, weights[next(turn) % copies], bias, config=cfg, out=out)

                times[text] = bench_graph(candidate)
            weights.clear()  # (the graphs that read them are gone with bench_graph)
            best = min((t for t in times if t != "F.linear"), key=times.__getitem__, default=None)
            tbs = {t: nbytes / (ms * 1e-3) / 1e12 for t, ms in times.items()}
            count = 1 if name == "lm_head" else layers
            step["F.linear"] += count * times["F.linear"]
            step["gemv"] += count * (times[best] if best else times["F.linear"])
            step["bytes"] += count * nbytes
            results.setdefault(shape, {})[name] = dict(n=n, k=k, ms=times, tb_per_s=tbs, best=best)
            shown = f"{1e3 * times[best]:.1f} ({tbs[best]:.2f})" if best else "-"
            print(f"| {name} | {n} x {k} | {nbytes / 1e6:.1f} | {1e3 * times['F.linear']:.1f} ({tbs['F.linear']:.2f}) | "
                  f"{shown} | {best or '-'} | {times[best] / times['F.linear'] if best else float('nan'):.3f} |",
                  flush=True)
        bound = step["bytes"] / copy_bw * 1e3
        print(f"\nper step ({layers} layers and the head): F.linear {step['F.linear']:.3f} ms "
              f"({bound / step['F.linear']:.0%} of copy bandwidth), the best gemv per projection {step['gemv']:.3f} ms "
              f"({bound / step['gemv']:.0%}); the bound {bound:.3f} ms")
        results.setdefault(shape, {})["step"] = dict(step, bound_ms=bound)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(copy_bw=copy_bw, configs=list(configs), results=results), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
