"""The batch-invariant linear kernel (kernels/triton_matmul.py, issue 49) against torch's F.linear
(cuBLAS) at the projections of a 7B-class model (hidden 3584, FFN 18944, 28 q / 4 kv heads of
128, vocabulary 152064) and of a 1B Llama (hidden 2048, FFN 8192, 32 q / 8 kv heads of 64,
vocabulary 128256), bf16: time per call at each M, the ratio, and whether each one's rows keep
their bits when the same rows run in a batch of another size.

    python3 -m benchmarks.matmul_invariance [--shape 7b,1b] [--ms 1,8,64,256,2048,8192] [--out FILE]
    python3 -m benchmarks.matmul_invariance --sweep [--shape 7b.qkv,1b.o]   # tuning config_for
    python -m benchmarks.matmul_invariance --tiny                            # CPU smoke run

Times (µs per call, the median of --repeats medians and their range): "graph" replays back-to-back
calls from one CUDA graph, as the engine runs decode steps, cycling over enough copies of the
weight that none stays in L2 (a model's layers each read their own); "do_bench" is
triton.testing.do_bench (L2 flushed between calls, launch overhead included: the eager prefill
path). Rows: "same" when x[:M]'s output equals the first M rows of the largest M's output bit for
bit, else how many rows differ. The model lines sum the layers' four projections (x layers) per M
(the LM head apart: it runs on the sampled rows only).

--sweep times candidate launch tables (tile, warps, stages, K chunks) at each shape and M, checks
each one's invariance, and marks the fastest: what `config_for` should return, in one command.
Without CUDA it prints a note and exits 0, unless --tiny (the interpreter, tiny shapes).
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.common import make_parser

NEEDS_GPU = False  # read by `pie bench`: without CUDA it prints a note (or runs --tiny in the interpreter)
# model -> (layers, {projection: (N, K)})
MODELS = {
    "7b": (28, {"qkv": (4608, 3584), "o": (3584, 3584), "gate_up": (37888, 3584), "down": (3584, 18944),
                "lm_head": (152064, 3584)}),
    "1b": (16, {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048), "down": (2048, 8192),
                "lm_head": (128256, 2048)}),
    "tiny": (2, {"qkv": (96, 64), "o": (64, 64), "gate_up": (256, 64), "down": (64, 136), "lm_head": (200, 64)}),
}
LAYER = ("qkv", "o", "gate_up", "down")
L2_SPAN = 256 << 20  # bytes of distinct weights a graph cycles through (several times the L2)
GRAPH_MS = 100.0  # GPU time one graph timing aims at


def shapes_of(spec: str) -> list[tuple[str, str, int, int]]:
    """"7b,1b.o" -> [(model, projection, N, K), ...]."""
    out = []
    for item in spec.split(","):
        model, _, proj = item.strip().partition(".")
        if model not in MODELS:
            raise SystemExit(f"unknown model {model!r}: one of {sorted(MODELS)}")
        projections = MODELS[model][1]
        for name in [proj] if proj else list(projections):
            if name not in projections:
                raise SystemExit(f"unknown projection {name!r} of {model}: one of {sorted(projections)}")
            out.append((model, name, *projections[name]))
    return out


def spread(times: list[float]) -> dict:
    return {"median": statistics.median(times), "min": min(times), "max": max(times)}


def graph_us(fns: list, repeats: int) -> dict:
    """µs per call: the calls `fns` captured back to back in one CUDA graph and replayed."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in fns:
            fn()  # compiles and cuBLAS's workspace outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for fn in fns:
                fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    replays = max(1, min(50, int(GRAPH_MS / max(start.elapsed_time(end), 1e-3))))
    times = []
    for _ in range(repeats):
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / (replays * len(fns)))
    del graph
    return spread(times)


def do_bench_us(fn, repeats: int) -> dict:
    from triton.testing import do_bench

    return spread([do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3 for _ in range(repeats)])


def wall_us(fn, repeats: int) -> dict:
    """The interpreter (--tiny on the CPU): wall time of one call."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e6)
    return spread(times)


def rows_differing(got: torch.Tensor, want: torch.Tensor) -> int:
    return int((got != want).any(dim=1).sum())


def measure(fn_of, weights: list[torch.Tensor], x: torch.Tensor, ms: list[int], repeats: int, cuda: bool,
            timings: list[str]) -> list[dict]:
    """fn_of(x, w) -> out, at each M of `ms`: times and rows that differ from the largest M's."""
    full = fn_of(x, weights[0])
    rows = []
    for m in ms:
        xm = x[:m]
        row = {"m": m, "rows_differing": rows_differing(fn_of(xm, weights[0]), full[:m])}
        if not cuda:
            row["wall"] = wall_us(lambda: fn_of(xm, weights[0]), repeats)
        if cuda and "graph" in timings:
            cycle = [weights[i % len(weights)] for i in range(max(len(weights), 4))]
            row["graph"] = graph_us([lambda w=w: fn_of(xm, w) for w in cycle], repeats)
        if cuda and "do_bench" in timings:
            row["do_bench"] = do_bench_us(lambda: fn_of(xm, weights[0]), repeats)
        rows.append(row)
    del full
    return rows


def fmt(t: dict | None) -> str:
    if t is None:
        return "-"
    return f"{t['median']:.1f} ({t['min']:.1f}-{t['max']:.1f})"


def same(n: int) -> str:
    return "same" if n == 0 else f"{n} differ"


def compare(args, tm, shapes, device: str) -> dict:
    cuda = device == "cuda"
    timings = ["wall"] if not cuda else [t for t in ("graph", "do_bench") if args.timing in (t, "both")]
    gen = torch.Generator().manual_seed(0)
    ms = sorted(args.ms)
    results = []
    print(f"| shape | N | K | M | {' | '.join(f'ours {t} µs | torch {t} µs | ratio' for t in timings)} "
          "| ours rows | torch rows |")
    print("|---|---|---|---|" + "---|---|---|" * len(timings) + "---|---|")
    for model, proj, n, k in shapes:
        dtype = torch.bfloat16 if cuda else torch.float32
        copies = max(1, min(16, -(-L2_SPAN // (n * k * 2)))) if cuda else 1
        w = (torch.randn(n, k, generator=gen) * k ** -0.5).to(device, dtype)
        weights = [w] + [w.clone() for _ in range(copies - 1)]
        x = torch.randn(ms[-1], k, generator=gen).to(device, dtype)
        ours = measure(lambda a, b: tm.linear(a, b), weights, x, ms, args.repeats, cuda, timings)
        theirs = measure(lambda a, b: F.linear(a, b), weights, x, ms, args.repeats, cuda, timings)
        for o, t in zip(ours, theirs):
            cells = []
            for name in timings:
                ratio = o[name]["median"] / t[name]["median"]
                cells += [fmt(o[name]), fmt(t[name]), f"{ratio:.2f}"]
            print(f"| {model}.{proj} | {n} | {k} | {o['m']} | {' | '.join(cells)} | {same(o['rows_differing'])} "
                  f"| {same(t['rows_differing'])} |", flush=True)
            results.append({"model": model, "projection": proj, "n": n, "k": k, "m": o["m"], "ours": o, "torch": t,
                            "config": dataclasses.asdict(tm.config_for(n, k, dtype, tm.capability_of(x.device)))})
        del weights, w, x
        if cuda:
            torch.cuda.empty_cache()
    totals = model_totals(results, timings)
    return {"results": results, "totals": totals}


def model_totals(results: list[dict], timings: list[str]) -> list[dict]:
    """Per model and M: layers x (qkv + o + gate_up + down), ours against torch, where all four ran."""
    totals = []
    lines = []
    for model, (layers, _) in MODELS.items():
        for m in sorted({r["m"] for r in results if r["model"] == model}):
            got = {r["projection"]: r for r in results if r["model"] == model and r["m"] == m}
            if not set(LAYER) <= got.keys():
                continue
            row = {"model": model, "m": m, "layers": layers}
            for name in timings:
                ours = layers * sum(got[p]["ours"][name]["median"] for p in LAYER)
                theirs = layers * sum(got[p]["torch"][name]["median"] for p in LAYER)
                row[name] = {"ours_us": ours, "torch_us": theirs, "ratio": ours / theirs}
            totals.append(row)
            lines.append(f"| {model} | {m} | " + " | ".join(
                f"{row[t]['ours_us']:.0f} | {row[t]['torch_us']:.0f} | {row[t]['ratio']:.2f}" for t in timings) + " |")
    if lines:
        print(f"\n| model (layers' projections) | M | {' | '.join(f'ours {t} µs | torch {t} µs | ratio' for t in timings)} |")
        print("|---|---|" + "---|---|---|" * len(timings))
        print("\n".join(lines))
    return totals


def candidates(tm, n: int, k: int, dtype: torch.dtype, capability) -> dict[str, object]:
    """Launch tables to try at (n, k): the rule's, and tiles around it, each with the rule's K chunks
    for its column count; the rule's tile with half and twice the chunks, and with other
    `split_below` thresholds."""
    rule = tm.config_for(n, k, dtype, capability)
    found = {"rule": rule}
    tiles = [(64, 128, 64, 4, 3), (64, 128, 64, 4, 5), (64, 128, 128, 4, 3), (64, 64, 64, 4, 4),
             (64, 256, 64, 8, 3), (64, 128, 64, 8, 4), (128, 128, 64, 8, 3), (128, 128, 64, 4, 4),
             (128, 256, 64, 8, 3)]
    for bm, bn, bk, warps, stages in tiles:
        cfg = dataclasses.replace(rule, block_m=bm, block_n=bn, block_k=bk, num_warps=warps, num_stages=stages,
                                  splits=tm.splits_for(n, k, bn, bk))
        found.setdefault(f"{bm}x{bn}x{bk} w{warps} s{stages} c{cfg.chunks(k)[1]}", cfg)
    for splits in (max(1, rule.splits // 2), rule.splits * 2):
        cfg = dataclasses.replace(rule, splits=splits)
        if cfg.chunks(k) != rule.chunks(k):
            found.setdefault(f"rule c{cfg.chunks(k)[1]}", cfg)
    if rule.chunks(k)[1] > 1:  # where the chunks stop getting programs of their own (same bits)
        for below in (rule.split_below // 4, rule.split_below // 2, rule.split_below * 2):
            found[f"rule split_below {below}"] = dataclasses.replace(rule, split_below=below)
    return found


def sweep(args, tm, shapes, device: str) -> dict:
    """Each candidate's graph time per shape and M; the fastest per M and by the sum over M."""
    gen = torch.Generator().manual_seed(0)
    ms = sorted(args.ms)
    out = []
    cap = tm.capability_of(torch.device(device))
    for model, proj, n, k in shapes:
        w = (torch.randn(n, k, generator=gen) * k ** -0.5).to(device, torch.bfloat16)
        copies = max(1, min(16, -(-L2_SPAN // (n * k * 2))))
        weights = [w] + [w.clone() for _ in range(copies - 1)]
        x = torch.randn(ms[-1], k, generator=gen).to(device, torch.bfloat16)
        print(f"\n### {model}.{proj} (N {n}, K {k})\n")
        print(f"| config | {' | '.join(f'M={m} µs' for m in ms)} | sum | rows |")
        print("|---|" + "---|" * len(ms) + "---|---|")
        torch_row = measure(lambda a, b: F.linear(a, b), weights, x, ms, args.repeats, True, ["graph"])
        print(f"| torch F.linear | {' | '.join(fmt(r['graph']) for r in torch_row)} "
              f"| {sum(r['graph']['median'] for r in torch_row):.1f} | - |", flush=True)
        found = []
        for name, cfg in candidates(tm, n, k, torch.bfloat16, cap).items():
            try:
                rows = measure(lambda a, b, c=cfg: tm.linear(a, b, config=c), weights, x, ms, args.repeats, True,
                               ["graph"])
            except Exception as exc:  # a tile this GPU cannot compile (shared memory): say so, go on
                print(f"| {name} | failed: {type(exc).__name__}: {str(exc)[:80]} |")
                continue
            total = sum(r["graph"]["median"] for r in rows)
            differ = sum(r["rows_differing"] for r in rows)
            found.append({"name": name, "config": dataclasses.asdict(cfg), "rows": rows, "sum_us": total,
                          "rows_differing": differ})
            print(f"| {name} | {' | '.join(fmt(r['graph']) for r in rows)} | {total:.1f} | {same(differ)} |", flush=True)
        best = {f"M={m}": min(found, key=lambda f: f["rows"][i]["graph"]["median"])["name"] for i, m in enumerate(ms)}
        best["sum"] = min(found, key=lambda f: f["sum_us"])["name"]
        print(f"\nfastest: {', '.join(f'{key} {name}' for key, name in best.items())}")
        out.append({"model": model, "projection": proj, "n": n, "k": k, "torch": torch_row, "candidates": found,
                    "fastest": best})
        del weights, w, x
        torch.cuda.empty_cache()
    return {"sweep": out}


def main(argv: list[str] | None = None) -> int:
    ap = make_parser(__doc__)
    ap.add_argument("--shape", default=None,
                    help="models or model.projection, comma-separated, of: "
                         + ", ".join(f"{m} ({', '.join(p)})" for m, (_, p) in MODELS.items())
                         + " (default: 7b,1b; tiny with --tiny)")
    ap.add_argument("--ms", default=None,
                    help="row counts M, comma-separated (default: 1,8,64,256,2048,8192; 1,64,8192 with --sweep; "
                         "1,8,64 with --tiny)")
    ap.add_argument("--repeats", type=int, default=3, help="timings per figure (median and range)")
    ap.add_argument("--timing", choices=["both", "graph", "do_bench"], default="both",
                    help="CUDA-graph replay, do_bench, or both")
    ap.add_argument("--sweep", action="store_true", help="time candidate launch tables instead (tuning config_for)")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes in Triton's CPU interpreter where no GPU is visible")
    ap.add_argument("--out", default=None, help="write the results as JSON to this file (default: no file)")
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    if not cuda and not args.tiny:
        print(f"{ap.prog}: no CUDA GPU visible, nothing measured (--tiny runs tiny shapes in the CPU interpreter)")
        return 0
    if args.sweep and not cuda:
        ap.error("--sweep needs a CUDA GPU")
    if not cuda:
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are defined
    import pie.kernels.triton_matmul as tm  # after TRITON_INTERPRET

    args.shape = args.shape or ("tiny" if args.tiny else "7b,1b")
    default_ms = "1,8,64" if args.tiny else "1,64,8192" if args.sweep else "1,8,64,256,2048,8192"
    args.ms = [int(m) for m in (args.ms or default_ms).split(",") if m]
    shapes = shapes_of(args.shape)
    device = "cuda" if cuda else "cpu"
    header = {"device": torch.cuda.get_device_name() if cuda else "cpu (Triton interpreter)",
              "torch": torch.__version__, "triton": __import__("triton").__version__, "argv": sys.argv[1:]}
    print(f"{header['device']}, torch {header['torch']}, triton {header['triton']}\n")
    result = (sweep if args.sweep else compare)(args, tm, shapes, device)
    if args.out:
        Path(args.out).write_text(json.dumps({**header, **result}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
