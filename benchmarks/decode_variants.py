"""GPU sweep of the paged decode kernel's launch variants (kernels/triton_decode.py `DecodeConfig`):
each variant is first checked against the fp32 torch reference on fresh random ragged inputs
(output poisoned with NaN; one and seven splits), then timed at the issue's shapes against SDPA on contiguous bf16 K/V
and the copy bandwidth measured in the same run.

    python3 -m benchmarks.decode_variants [--repeats N] [--only NAME,...] [--out DIR]

Times: `triton.testing.do_bench` medians (L2 flushed; with --repeats N the median and the range
of N such medians) and CUDA-graph replays (50 calls per graph, median of 10 replays: how the
engine runs decode). Bytes: K and V once (int8 plus fp16 scales, or bf16), q and out. Writes
variants.md (the tables) and variants.json to --out.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import statistics
import sys

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench

import pie.kernels.triton_decode as td
from benchmarks.common import make_parser, require_cuda
from pie.kernels.reference import paged_attention_decode

NEEDS_GPU = True  # read by `pie bench` (with ast, without importing this file)
C = td.DecodeConfig
# int8 variants: name -> config. "old" is the launch table before issue 26 (2 warps, 255 registers).
VARIANTS = {
    "default": None,  # the launch table (_config)
    "default-s512": None,  # the same, split every 512 keys (split_tokens: the same bits in any batch)
    "old": C(128, 2, 2, k_mode="cast", v_mode="asm"),
    "bias-w2": C(128, 2, 2, k_mode="bias", v_mode="bias"),
    "bias-w2-m": C(128, 2, 2, k_mode="bias", v_mode="bias", tight_m=True),
    "bias-w4": C(64, 4, 2, k_mode="bias", v_mode="bias", tight_m=True, k_t=False),
    "bias-w4-s3": C(64, 4, 3, k_mode="bias", v_mode="bias", tight_m=True, k_t=False),
    "bias-w4-n128": C(128, 4, 2, k_mode="bias", v_mode="bias", tight_m=True),
    "bias-w2-n64": C(64, 2, 2, k_mode="bias", v_mode="bias", tight_m=True, k_t=False),
    "bias-w1-n32": C(32, 1, 3, k_mode="bias", v_mode="bias", tight_m=True, k_t=False),
    "imma-w4": C(64, 4, 2, k_mode="imma", v_mode="bias", tight_m=True, k_t=False),
    "imma-w2": C(128, 2, 2, k_mode="imma", v_mode="bias", tight_m=True),
    "imma1-w4": C(64, 4, 2, k_mode="imma1", v_mode="bias", tight_m=True, k_t=False),
    "old-w4": C(64, 4, 2, k_mode="cast", v_mode="asm"),
    "imma-w4-r96": C(64, 4, 2, maxnreg=96, k_mode="imma", v_mode="bias", tight_m=True, k_t=False, per_sm=5),
    "imma-w4-r72": C(64, 4, 2, maxnreg=72, k_mode="imma", v_mode="bias", tight_m=True, k_t=False, per_sm=7),
    # Issue 46's roofline: int8 tiles carry half a bf16 tile's bytes, so small tiles and many splits
    # (the bare stream's best: 16-32-token tiles, 32-64 splits at ctx 4096) keep more bytes in flight.
    "default-split256": None,
    "imma-n32-w2-split128": C(32, 2, 3, k_mode="imma", v_mode="bias", tight_m=True, k_t=False),
    "imma-n32-w4-split128": C(32, 4, 3, k_mode="imma", v_mode="bias", tight_m=True, k_t=False),
    "imma-n16-w2-split64": C(16, 2, 3, k_mode="imma", v_mode="bias", tight_m=True, k_t=False),
    "imma-n16-w1-split64": C(16, 1, 3, k_mode="imma", v_mode="bias", tight_m=True, k_t=False),
    "bias-n32-w2-split128": C(32, 2, 3, k_mode="bias", v_mode="bias", tight_m=True, k_t=False),
    # Issue 59: the same shapes at the engine's fixed splits (1024 keys, what its graphs run) and
    # at 512; one-warp programs need no cross-warp reduction of the softmax row (sm_90 SASS: 3-5
    # barriers a tile against the shipped table's 14).
    "default-split1024": None,
    "imma-n64-w2-split1024": C(64, 2, 2, k_mode="imma", v_mode="bias", tight_m=True, k_t=False),
    "imma-n32-w2-split1024": C(32, 2, 3, k_mode="imma", v_mode="bias", tight_m=True, k_t=False),
    "imma-n32-w2-split512": C(32, 2, 3, k_mode="imma", v_mode="bias", tight_m=True, k_t=False),
    "imma-n32-w1-split1024": C(32, 1, 3, k_mode="imma", v_mode="bias", tight_m=True, k_t=False),
    "imma-n32-w1-split512": C(32, 1, 3, k_mode="imma", v_mode="bias", tight_m=True, k_t=False),
    "imma-n16-w1-split512": C(16, 1, 4, k_mode="imma", v_mode="bias", tight_m=True, k_t=False),
    "imma-n32-w4-split512": C(32, 4, 3, k_mode="imma", v_mode="bias", tight_m=True, k_t=False),
    "imma-n64-w4-s3-split1024": C(64, 4, 3, k_mode="imma", v_mode="bias", tight_m=True, k_t=False),
    # Sub-tiles (issue 59's redesign): a tile's keys cut into one sub-tile per warp, each with its
    # own softmax state, merged once per split: no cross-warp reduction or exchange of P per tile.
    "sub4-n64": C(64, 4, 2, k_mode="imma", v_mode="bias", tight_m=True, k_t=False, per_sm=4, sub_tiles=4),
    "sub4-n64-split1024": C(64, 4, 2, k_mode="imma", v_mode="bias", tight_m=True, k_t=False, per_sm=4, sub_tiles=4),
    "sub4-n128": C(128, 4, 2, k_mode="imma", v_mode="bias", tight_m=True, k_t=False, per_sm=4, sub_tiles=4),
    "sub4-n128-split1024": C(128, 4, 2, k_mode="imma", v_mode="bias", tight_m=True, k_t=False, per_sm=4,
                             sub_tiles=4),
    "sub4-n64-s3": C(64, 4, 3, k_mode="imma", v_mode="bias", tight_m=True, k_t=False, per_sm=4, sub_tiles=4),
    "sub2-n32-w2": C(32, 2, 3, k_mode="imma", v_mode="bias", tight_m=True, k_t=False, per_sm=8, sub_tiles=2),
    "sub2-n64-w2": C(64, 2, 2, k_mode="imma", v_mode="bias", tight_m=True, k_t=False, per_sm=8, sub_tiles=2),
    "sub4-n64-bias": C(64, 4, 2, k_mode="bias", v_mode="bias", tight_m=True, k_t=False, per_sm=4, sub_tiles=4),
    "sub4-n64-r128": C(64, 4, 2, maxnreg=128, k_mode="imma", v_mode="bias", tight_m=True, k_t=False, per_sm=4,
                       sub_tiles=4),
    "sub4-n64-imma1": C(64, 4, 2, k_mode="imma1", v_mode="bias", tight_m=True, k_t=False, per_sm=4, sub_tiles=4),
    "sub8-n128-w8": C(128, 8, 2, k_mode="imma", v_mode="bias", tight_m=True, k_t=False, per_sm=2, sub_tiles=8),
}
BF16 = {"bf16": None, "bf16-s512": None}


def split_kw(name: str, max_len: int = 0) -> dict:
    """paged_decode's split arguments of a variant name ("-s512" or "-split128": split_tokens of
    that many keys), the split doubled for contexts up to `max_len` that would need more than
    MAX_SPLITS of them."""
    match = re.search(r"-s(?:plit)?(\d+)$", name)
    if match is None or (not name.endswith("-s512") and "-split" not in name):  # "-s3": 3 stages
        return {}
    split = int(match.group(1))
    while td.cdiv(max_len, split) > td.MAX_SPLITS:
        split *= 2
    return {"split_tokens": split}
# (name, batch, ctx, head dim): the rows (Hq 32, Hkv 8, page 16)
SHAPES = [("B64 ctx4096 D128", 64, 4096, 128), ("B256 ctx4096 D128", 256, 4096, 128),
          ("B8 ctx32k D128", 8, 32768, 128), ("B256 ctx512 D128", 256, 512, 128),
          ("B256 ctx400 D64", 256, 400, 64), ("B64 ctx4096 D64", 64, 4096, 64),
          ("B1 ctx32k D128", 1, 32768, 128)]  # (one long stream: issue 59's 75%-of-copy row)
HKV, GROUP, PAGE = 8, 4, 16
LINES: list[str] = []


def log(msg: str) -> None:
    print(msg, flush=True)
    LINES.append(msg)


def make(lens: list[int], d: int, int8: bool, hkv: int = HKV, group: int = GROUP, page: int = PAGE,
         pool_gib: float = 0.0):
    """Random paged inputs (shuffled pages): (kernel args, K/V bytes that must move). pool_gib: the
    batch's pages drawn at random from a pool of that many GiB of K and V (one layer's share of the
    engine's pool, as its LRU free queue spreads a long run's blocks over all of it); 0: just the
    pages the batch needs."""
    b = len(lens)
    nbs = [triton.cdiv(n, page) for n in lens]
    need = sum(nbs)
    page_bytes = 2 * page * hkv * (d + 2 if int8 else 2 * d)
    nb = max(need, int(pool_gib * 2**30 / page_bytes))
    perm = torch.randperm(nb, device="cuda")[:need].int()
    table = torch.zeros(b, max(nbs), dtype=torch.int32, device="cuda")
    used = 0
    for i, n in enumerate(nbs):
        table[i, :n] = perm[used:used + n]
        used += n
    shape = (nb, page, hkv, d)
    if int8:
        k = torch.randint(-127, 128, shape, dtype=torch.int8, device="cuda")
        v = torch.randint(-127, 128, shape, dtype=torch.int8, device="cuda")
        ks = (torch.rand(nb, hkv, page, device="cuda") * 0.02 + 0.001).half()
        vs = (torch.rand(nb, hkv, page, device="cuda") * 0.02 + 0.001).half()
        per_token = 2 * hkv * (d + 2)
    else:
        k = torch.randn(shape, dtype=torch.bfloat16, device="cuda")
        v = torch.randn(shape, dtype=torch.bfloat16, device="cuda")
        ks = vs = None
        per_token = 2 * hkv * d * 2
    q = torch.randn(b, hkv * group, d, dtype=torch.bfloat16, device="cuda")
    lens_t = torch.tensor(lens, dtype=torch.int32, device="cuda")
    return (q, k, v, ks, vs, table, lens_t), per_token * sum(lens) + 2 * q.numel() * 2


def bench_graph(fn, calls: int = 50) -> float:
    """ms per call replayed from one CUDA graph of `calls` calls (median of 10 replays)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(calls):
                fn()
    torch.cuda.current_stream().wait_stream(stream)
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


def timed(fn, repeats: int) -> tuple[float, float, float]:
    """(median, min, max) over `repeats` do_bench medians."""
    t = [do_bench(fn, warmup=25, rep=100, return_mode="median") for _ in range(repeats)]
    return statistics.median(t), min(t), max(t)


def check(name: str, cfg, d: int, int8: bool) -> float:
    """Max error relative to max |ref| on fresh ragged inputs, default and forced split counts;
    inf when an output element is left unwritten (NaN)."""
    worst = 0.0
    for group, page in ((GROUP, PAGE), (8, 32)) if d >= 128 else ((GROUP, PAGE),):
        args, _ = make([1, 17, 1000, 4095, 333], d, int8, group=group, page=page)
        ref = paged_attention_decode(args[0].float(), *args[1:], d ** -0.5)
        for splits in (1, 7) if not split_kw(name) else (None,):
            out = torch.full_like(args[0], float("nan"))
            td.paged_decode(*args, d ** -0.5, num_splits=splits, out=out, config=cfg, **split_kw(name))
            if not bool(torch.isfinite(out).all()):
                return float("inf")
            worst = max(worst, ((out.float() - ref).abs().max() / ref.abs().max()).item())
    return worst


def sdpa_times(b: int, ctx: int, d: int, repeats: int) -> tuple[float, float, float, float]:
    """SDPA decode on contiguous bf16 K/V (B, Hkv, ctx, D) with GQA: timed() and graph ms."""
    q = torch.randn(b, HKV * GROUP, 1, d, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(b, HKV, ctx, d, dtype=torch.bfloat16, device="cuda")
    v = torch.randn_like(k)

    def sdpa():
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    return (*timed(sdpa, repeats), bench_graph(sdpa))


def copy_bandwidth() -> float:
    src = torch.empty(2 << 30, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=25, rep=100, return_mode="median")
    return 2 * src.numel() / (ms * 1e-3)


def main(argv: list[str] | None = None) -> int:
    ap = make_parser(__doc__)
    ap.add_argument("--repeats", type=int, default=1, help="do_bench medians per figure")
    ap.add_argument("--only", default=None, help="comma-separated variant names (default: all)")
    ap.add_argument("--shapes", default=None, help="comma-separated shape indices into SHAPES (default: all)")
    ap.add_argument("--out", default=None, metavar="DIR", help="folder for variants.md/json (default: $OUT, else /tmp)")
    ap.add_argument("--ragged", action="store_true",
                    help="only the engine-like cases: ragged lengths, a large shuffled pool, split policies")
    ap.add_argument("--one-stream", action="store_true",
                    help="only a few streams at short and long contexts in the grid a CUDA graph captures (splits "
                         "for --max-model-len), the launch table against it with DecodeConfig.min_split")
    ap.add_argument("--max-model-len", type=int, default=32768, help="--one-stream: the context the graph's grid is for")
    args = ap.parse_args(argv)
    require_cuda(ap)
    out_dir = args.out or os.environ.get("OUT", "/tmp")
    torch.manual_seed(int.from_bytes(os.urandom(4), "little"))
    variants = {k: v for k, v in VARIANTS.items() if args.only is None or k in args.only.split(",")}
    shapes = SHAPES if args.shapes is None else [SHAPES[int(i)] for i in args.shapes.split(",")]
    bw = copy_bandwidth()
    log(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; "
        f"copy bandwidth {bw / 1e12:.2f} TB/s")
    results: dict = {"copy_tbs": bw / 1e12, "check": {}, "rows": [], "long": [], "ragged": []}
    if args.ragged:
        ragged(bw, args.repeats, results)
        return write(out_dir, results)
    if args.one_stream:
        one_stream(bw, args.repeats, args.max_model_len, results)
        return write(out_dir, results)

    log("\n## correctness: max |err| / max |ref| vs the fp32 reference (ragged lens, splits None/1/7, G 4 p16 and G 8 p32)")
    for d in sorted({s[3] for s in shapes}):
        for name, cfg in [*variants.items(), *BF16.items()]:
            err = check(name, cfg, d, name in variants)
            results["check"][f"{name} D{d}"] = err
            log(f"check D{d} {name:14s} {err:.2e} {'ok' if err < 2.5e-2 else 'FAIL'}")

    log("\n## timings (ms: do_bench median [range]; graph: CUDA-graph replay)")
    log("| shape | variant | ms | range | graph ms | % copy (graph) | x SDPA (graph) |")
    log("|---|---|---|---|---|---|---|")
    for label, b, ctx, d in shapes:
        s_ms, s_lo, s_hi, s_graph = sdpa_times(b, ctx, d, args.repeats)
        log(f"| {label} | SDPA bf16 | {s_ms:.4f} | {s_lo:.4f}-{s_hi:.4f} | {s_graph:.4f} | | 1.00 |")
        for int8, group in ((True, variants), (False, BF16)):
            kargs, nbytes = make([ctx] * b, d, int8)
            out = torch.empty_like(kargs[0])
            for name, cfg in group.items():
                fn = lambda: td.paged_decode(*kargs, d ** -0.5, max_seq_len=ctx, out=out, config=cfg,  # noqa: E731
                                             **split_kw(name))
                try:
                    ms, lo, hi = timed(fn, args.repeats)
                    g = bench_graph(fn)
                except Exception as exc:  # noqa: BLE001 - a variant that does not compile is reported
                    log(f"| {label} | {name} | error: {type(exc).__name__} {str(exc)[:120]} |")
                    continue
                frac = nbytes / (g * 1e-3) / bw
                results["rows"].append(dict(shape=label, variant=name, ms=ms, lo=lo, hi=hi, graph_ms=g,
                                            copy_frac=frac, vs_sdpa=s_graph / g, sdpa_ms=s_ms, sdpa_graph_ms=s_graph))
                log(f"| {label} | {name} | {ms:.4f} | {lo:.4f}-{hi:.4f} | {g:.4f} | {100 * frac:.0f}% | {s_graph / g:.2f} |")
            del kargs, out
            torch.cuda.empty_cache()

    log("\n## one sequence, B1 ctx32k D128, graph replay, by split count")
    log("| variant | splits | graph ms | % copy |")
    log("|---|---|---|---|")
    for int8, group in ((True, variants), (False, BF16)):
        kargs, nbytes = make([32768], 128, int8)
        out = torch.empty_like(kargs[0])
        for name, cfg in group.items():
            per_sm = (cfg or td._config(128, PAGE, torch.int8 if int8 else torch.bfloat16, True)).per_sm
            for splits in (None, 64, 128) if not split_kw(name) else (64,):
                n = splits or td.default_num_splits(1, HKV, 32768, td._sm_count(0), per_sm)
                fn = lambda: td.paged_decode(*kargs, 128 ** -0.5, num_splits=n, out=out, config=cfg,  # noqa: E731
                                             max_seq_len=32768, **split_kw(name, 32768))
                try:
                    g = statistics.median(bench_graph(fn) for _ in range(args.repeats))
                except Exception as exc:  # noqa: BLE001
                    log(f"| {name} | {n} | error: {type(exc).__name__} |")
                    continue
                frac = nbytes / (g * 1e-3) / bw
                results["long"].append(dict(variant=name, splits=n, graph_ms=g, copy_frac=frac))
                log(f"| {name} | {n} | {g:.4f} | {100 * frac:.0f}% |")
    return write(out_dir, results)


def one_stream(bw: float, repeats: int, max_model_len: int, results: dict) -> None:
    """Issue 64's one stream: B rows (1, 4) over a context of 128 to 16k keys, D128, replayed from
    a CUDA graph whose split count was set by max_model_len (what the engine's decode graphs of few
    rows launch: `default_num_splits` of the longest allowed context), for the launch table as
    shipped and with min_split = MIN_SPLIT_TOKENS (a short context then does its work in the
    splits its keys fill); beside them the split count an eager step would pick for the context at
    hand. Each config checked against the reference first."""
    results["one_stream"] = []
    log(f"\n## a few streams in a graph's grid (splits for max_model_len {max_model_len}), D128, graph replay")
    log("| rows | ctx | pages | grid splits | table ms | min_split ms | eager splits | eager ms | min_split / table |")
    log("|---|---|---|---|---|---|---|---|---|")
    sms = td._sm_count(0)
    for b in (1, 4):
        for ctx in (128, 512, 2048, 16384):
            for int8 in (True, False):
                kargs, nbytes = make([ctx] * b, 128, int8)
                out = torch.empty_like(kargs[0])
                table = td._config(128, PAGE, kargs[1].dtype, True)
                cfgs = {"table": table, "min_split": dataclasses.replace(table, min_split=td.MIN_SPLIT_TOKENS)}
                grid = td.default_num_splits(b, HKV, max_model_len, sms, table.per_sm)
                eager = td.default_num_splits(b, HKV, ctx, sms, table.per_sm)
                ref = paged_attention_decode(kargs[0].float(), *kargs[1:], 128 ** -0.5)
                row = dict(rows=b, ctx=ctx, pages="int8" if int8 else "bf16", grid_splits=grid, eager_splits=eager)
                for label, cfg, n in (("table", table, grid), ("min_split", cfgs["min_split"], grid),
                                      ("eager", table, eager)):
                    fn = lambda cfg=cfg, n=n, kargs=kargs, out=out: td.paged_decode(  # noqa: E731
                        *kargs, 128 ** -0.5, num_splits=n, out=out, config=cfg)
                    out.fill_(float("nan"))
                    fn()
                    err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
                    row[f"{label}_err"] = err
                    row[f"{label}_ms"] = statistics.median(bench_graph(fn) for _ in range(max(1, repeats)))
                results["one_stream"].append(row)
                bad = [k for k in ("table", "min_split", "eager") if not row[f"{k}_err"] < 2.5e-2]
                log(f"| {b} | {ctx} | {row['pages']} | {grid} | {row['table_ms']:.4f} | {row['min_split_ms']:.4f} | "
                    f"{eager} | {row['eager_ms']:.4f} | {row['min_split_ms'] / row['table_ms']:.3f} |"
                    + (f" FAIL check: {', '.join(bad)}" if bad else ""))
                del kargs, out
                torch.cuda.empty_cache()


def write(out_dir: str, results: dict) -> int:
    with open(os.path.join(out_dir, "variants.md"), "w") as f:
        f.write("\n".join(LINES) + "\n")
    with open(os.path.join(out_dir, "variants.json"), "w") as f:
        json.dump(results, f, indent=1)
    return 0


def worklist_kwargs(int8: bool, split: int, max_len: int, batch: int, sms: int, cap: bool) -> dict:
    """paged_decode's arguments for fixed splits on a work list: 4 programs per SM over the chip
    (what both head-dim-128 tables keep resident, Nsight Compute), as programs per kv head; the
    registers capped at 128 with `cap` (the work-list loop took the int8 table from 128 to 140
    registers, sm_90 compile: 3 programs per SM instead of 4)."""
    cfg = td._config(128, PAGE, torch.int8 if int8 else torch.bfloat16, True, batch * HKV / sms)
    if cap:
        cfg = dataclasses.replace(cfg, maxnreg=128)
    return dict(max_seq_len=max_len, split_tokens=split, programs=max(1, round(sms * 4 / HKV)), config=cfg)


def ragged(bw: float, repeats: int, results: dict) -> None:
    """The decode call of the engine's graphs on long-context work (benchmarks/mixed.py --workload long):
    ragged contexts (log-normal, median 1,800, up to 7,500) or one or eight 32k contexts, the
    split count from max_model_len (9,216 or 32,768: what the graphs are captured for) or splits at
    fixed key positions (the engine's: td.fixed_split_tokens), pages drawn at random from a pool of
    one layer's share of an ample engine pool (3 GiB) or packed."""
    gen = torch.Generator().manual_seed(0)
    log("\n## engine-like decode: ragged contexts, pool, split policy (graph ms, median of repeats)")
    log("| batch | pages | policy | int8 ms | bf16 ms | int8 % copy | bf16 % copy | bf16 / int8 |")
    log("|---|---|---|---|---|---|---|---|")
    cases = []
    for b in (256, 64, 16):
        draw = torch.exp(torch.randn(b, generator=gen) * 0.8) * 1800
        cases.append((f"B{b} ragged", [int(min(7500, max(16, x))) for x in draw.tolist()], 9216))
    cases += [("B8 ctx32k", [32768] * 8, 32768), ("B1 ctx32k", [32768], 32768)]
    for label, lens, max_len in cases:
        for pool in (3.0,) if "ragged" in label else (0.0,):
            made = {int8: make(lens, 128, int8, pool_gib=pool) for int8 in (True, False)}
            sms = td.sm_count(torch.device("cuda"))
            engine_split = td.fixed_split_tokens(max_len, len(lens), HKV, sms)
            policies = [("splits from max_model_len", lambda int8: dict(max_seq_len=max_len))]
            policies += [(f"split_tokens {n}{' (engine)' if n == engine_split else ''}",
                          lambda int8, n=n: dict(max_seq_len=max_len, split_tokens=n)) for n in (512, 1024, 2048)
                         if triton.cdiv(max_len, n) <= td.MAX_SPLITS]
            policies += [(f"work list of {n}-key splits{', 128 registers' if cap else ''}",
                          lambda int8, n=n, cap=cap: worklist_kwargs(int8, n, max_len, len(lens), sms, cap))
                         for n in (512, 1024) for cap in (False, True)]
            for policy, make_kw in policies:
                row = {}
                for int8, (kargs, nbytes) in made.items():
                    out = torch.empty_like(kargs[0])
                    kw = make_kw(int8)
                    fn = lambda: td.paged_decode(*kargs, 128 ** -0.5, out=out, **kw)  # noqa: E731
                    g = statistics.median(bench_graph(fn) for _ in range(max(1, repeats)))
                    row[int8] = (g, nbytes / (g * 1e-3) / bw)
                where = "packed" if pool == 0 else f"random in {pool:g} GiB"
                results["ragged"].append(dict(case=label, pool_gib=pool, policy=policy, int8_ms=row[True][0],
                                              bf16_ms=row[False][0], int8_frac=row[True][1], bf16_frac=row[False][1]))
                log(f"| {label} | {where} | {policy} | {row[True][0]:.4f} | {row[False][0]:.4f} | "
                    f"{100 * row[True][1]:.0f}% | {100 * row[False][1]:.0f}% | {row[False][0] / row[True][0]:.2f} |")
            del made
            torch.cuda.empty_cache()


if __name__ == "__main__":
    sys.exit(main())
