"""Paged attention kernel benchmark (GPU): our int8 and bf16 paged decode against torch SDPA on
contiguous bf16 K/V, the extend kernel against SDPA causal, a device-to-device copy as the
bandwidth ceiling, and int8 fidelity, all measured in one run.

    python -m benchmarks.attention [--quick] [--out results.json]

Bytes counted per decode call are the ones that must move: K and V once (int8 + fp32 scales, or
bf16), q and out. Times are medians of triton.testing.do_bench (L2 flushed between runs).
"""

from __future__ import annotations

import json
import math
import sys

import torch
import triton

from benchmarks.common import make_parser, require_cuda
from pie.kernels import reference
from pie.kernels.flash_prefill import paged_prefill
from pie.kernels.triton_cache_write import write_kv_cache
from pie.kernels.triton_decode import paged_decode
from pie.kernels.triton_extend import paged_extend
from pie.model.smoothing import factors_from_rms

NEEDS_GPU = True  # read by `pie bench` (with ast, without importing this file)
HQ, HKV, D, BLOCK = 32, 8, 128, 16


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def timed(fn, repeats: int) -> tuple[float, list[float]]:
    """The median of `repeats` do_bench medians, and [min, max] of them."""
    times = sorted(bench(fn) for _ in range(repeats))
    return times[len(times) // 2], [times[0], times[-1]]


def bench_graph(fn, calls: int = 50) -> float:
    """ms per call when `calls` back-to-back calls replay from one CUDA graph, as the engine runs
    its decode steps: no launch overhead, and no L2 flush between calls (contexts of 4k tokens and
    more do not fit in L2 anyway). Median of 10 replays."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # allocations and compiles happen outside the capture
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
    return sorted(times)[len(times) // 2]


def copy_bandwidth() -> float:
    """Bytes read + written per second by a large device-to-device copy."""
    src = torch.empty(2 << 30, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src))
    return 2 * src.numel() / (ms * 1e-3)


def make_paged(batch: int, ctx: int, kv_dtype: str, k: torch.Tensor, v: torch.Tensor):
    """Scatter contiguous K/V (B, ctx, Hkv, D) into shuffled pages of a fresh cache."""
    blocks_per_seq = math.ceil(ctx / BLOCK)
    num_blocks = batch * blocks_per_seq
    dtype = torch.int8 if kv_dtype == "int8" else torch.bfloat16
    k_cache = torch.empty(num_blocks, BLOCK, HKV, D, dtype=dtype, device="cuda")
    v_cache = torch.empty_like(k_cache)
    ks = vs = None
    if kv_dtype == "int8":
        ks = torch.empty(num_blocks, HKV, BLOCK, dtype=reference.SCALE_DTYPE, device="cuda")
        vs = torch.empty_like(ks)
    tables = torch.randperm(num_blocks, device="cuda", dtype=torch.int32).view(batch, blocks_per_seq)
    pos = torch.arange(ctx, device="cuda")
    for b in range(batch):
        slots = tables[b, pos // BLOCK].long() * BLOCK + pos % BLOCK
        write_kv_cache(k[b], v[b], k_cache, v_cache, ks, vs, slots)
    return k_cache, v_cache, ks, vs, tables


def sdpa_decode(q, k, v, scale: float, graphs: bool) -> tuple[float, float | None, torch.Tensor]:
    """SDPA on contiguous bf16 K/V (B, H, L, D) with GQA: (ms, ms replayed from a graph, output).
    Its contiguous copies of K and V are gone when this returns (the paged ones need the room)."""
    kt, vt = k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()

    def sdpa():
        return torch.nn.functional.scaled_dot_product_attention(q[:, :, None], kt, vt, scale=scale, enable_gqa=True)

    return bench(sdpa), bench_graph(sdpa) if graphs else None, sdpa()[:, :, 0].float()


def decode_rows(quick: bool, copy_bw: float, graphs: bool = False) -> list[dict]:
    rows = []
    batches = (1, 64) if quick else (1, 8, 64, 256)
    contexts = (4096, 32768) if quick else (512, 4096, 32768)
    scale = D ** -0.5
    for batch in batches:
        for ctx in contexts:
            if batch * ctx > 64 * 32768:
                continue  # K/V of every variant would not fit beside each other
            k = torch.randn(batch, ctx, HKV, D, device="cuda", dtype=torch.bfloat16)
            v = torch.randn_like(k)
            q = torch.randn(batch, HQ, D, device="cuda", dtype=torch.bfloat16)
            seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
            t_sdpa, t_sdpa_graph, ref_out = sdpa_decode(q, k, v, scale, graphs)
            qo_bytes = 2 * q.numel() * q.element_size()
            row = dict(batch=batch, ctx=ctx, sdpa_ms=t_sdpa,
                       sdpa_tbs=(2 * k.numel() * 2 + qo_bytes) / t_sdpa / 1e9)
            if graphs:
                row["sdpa_graph_ms"] = t_sdpa_graph
            for kv_dtype in ("int8", "bf16"):
                kc, vc, ks, vs, tables = make_paged(batch, ctx, kv_dtype, k, v)
                fn = lambda: paged_decode(q, kc, vc, ks, vs, tables, seq_lens, scale, max_seq_len=ctx)  # noqa: E731
                out = fn().float()
                err = ((out - ref_out).norm() / ref_out.norm()).item()
                t = bench(fn)
                kv_bytes = 2 * kc.numel() * kc.element_size() + (2 * ks.numel() * ks.element_size() if ks is not None else 0)
                tbs = (kv_bytes + qo_bytes) / t / 1e9
                row |= {f"{kv_dtype}_ms": t, f"{kv_dtype}_tbs": tbs, f"{kv_dtype}_copy_frac": tbs * 1e12 / copy_bw,
                        f"{kv_dtype}_vs_sdpa": t_sdpa / t, f"{kv_dtype}_rel_err_vs_sdpa": err}
                if graphs:
                    tg = bench_graph(fn)
                    row |= {f"{kv_dtype}_graph_ms": tg,
                            f"{kv_dtype}_graph_copy_frac": (kv_bytes + qo_bytes) / tg / 1e9 * 1e12 / copy_bw,
                            f"{kv_dtype}_graph_vs_sdpa": row["sdpa_graph_ms"] / tg}
                del fn  # the paged copies go with it
            rows.append(row)
            del k, v
            torch.cuda.empty_cache()
    return rows


def extend_rows(quick: bool, repeats: int = 1) -> list[dict]:
    """Prompts of n new tokens over `prefix` cached ones, per sequence: the Triton extend kernel
    and the FlashAttention path (the engine's on CUDA: gather the pages, then varlen attention)
    against SDPA causal (aligned to the bottom right) on contiguous bf16 K/V. Each time is the
    median of `repeats` do_bench medians, with their range."""
    from torch.nn.attention.bias import causal_lower_right

    rows = []
    scale = D ** -0.5
    shapes = ((1, 0, 4096), (4, 0, 4096), (1, 4096, 512), (4, 6144, 2048)) if not quick else ((1, 0, 4096),)
    for batch, prefix, n in shapes:
        ctx = prefix + n
        k = torch.randn(batch, ctx, HKV, D, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        q = torch.randn(batch, n, HQ, D, device="cuda", dtype=torch.bfloat16)
        qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))
        mask = causal_lower_right(n, ctx) if prefix else None
        sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(  # noqa: E731
            qt, kt, vt, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True)
        t_sdpa, spread = timed(sdpa, repeats)
        ref_out = sdpa().transpose(1, 2).reshape(batch * n, HQ, D).float()
        seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
        qsl = torch.arange(0, (batch + 1) * n, n, dtype=torch.int32, device="cuda")
        row = dict(batch=batch, prefix=prefix, prompt=n, sdpa_causal_ms=t_sdpa, sdpa_causal_range=spread)
        for kv_dtype in ("int8", "bf16"):
            kc, vc, ks, vs, tables = make_paged(batch, ctx, kv_dtype, k, v)
            qf = q.reshape(batch * n, HQ, D)
            paths = {"": lambda: paged_extend(qf, kc, vc, ks, vs, tables, seq_lens, qsl, scale, max_query_len=n),
                     "flash_": lambda: paged_prefill(qf, kc, vc, ks, vs, tables, seq_lens, qsl, scale, max_query_len=n,
                                                     max_seq_len=ctx, kv_tokens=batch * ctx)}
            for name, fn in paths.items():
                out = fn().float()
                t, spread = timed(fn, repeats)
                row |= {f"{name}{kv_dtype}_ms": t, f"{name}{kv_dtype}_range": spread, f"{name}{kv_dtype}_over_sdpa": t / t_sdpa,
                        f"{name}{kv_dtype}_rel_err_vs_sdpa": ((out - ref_out).norm() / ref_out.norm()).item()}
        rows.append(row)
    return rows


def smoothing_factors(x: torch.Tensor, pairs: bool) -> torch.Tensor:
    """The engine's K/V smoothing (model/smoothing.py) for x (B, ctx, Hkv, D): per-channel RMS
    over a calibration sample (the first 256 tokens of the first sequence) -> (Hkv, D) factors."""
    rms = x[0, :256].float().pow(2).mean(0).sqrt()  # (Hkv, D)
    return factors_from_rms(rms.cpu(), pairs=pairs).to(x.device)


def fidelity_rows() -> list[dict]:
    """Attention output error of int8 and bf16 pages against an fp64 reference (fp32 q, K, V),
    on Gaussian inputs and with 4 K and V channels x20; int8 also with the engine's smoothing:
    K / s (q * s) and V / t (output * t), exact for attention in exact arithmetic."""
    rows = []
    batch, ctx, scale = 8, 2048, D ** -0.5
    group = HQ // HKV
    for case in ("gaussian", "outlier channels x20"):
        k = torch.randn(batch, ctx, HKV, D, device="cuda")
        v = torch.randn_like(k)
        if case != "gaussian":
            ch = torch.randperm(D, device="cuda")[:4]
            k[..., ch] *= 20
            v[..., ch] *= 20
        q = torch.randn(batch, HQ, D, device="cuda")
        kt, vt = k.transpose(1, 2), v.transpose(1, 2)
        ref = torch.nn.functional.scaled_dot_product_attention(
            q[:, :, None].double(), kt.double(), vt.double(), scale=scale, enable_gqa=True)[:, :, 0]
        seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
        s_k, s_v = smoothing_factors(k, pairs=True), smoothing_factors(v, pairs=False)
        q_s = (q.view(batch, HKV, group, D) * s_k[None, :, None]).view(batch, HQ, D)
        row = dict(case=case)
        for name, kv_dtype, kk, vv, qq in (("int8", "int8", k, v, q), ("bf16", "bf16", k, v, q),
                                           ("int8_smoothed", "int8", k / s_k, v / s_v, q_s)):
            kc, vc, ks, vs, tables = make_paged(batch, ctx, kv_dtype, kk, vv)
            out = paged_decode(qq.bfloat16(), kc, vc, ks, vs, tables, seq_lens, scale, max_seq_len=ctx).double()
            if name == "int8_smoothed":
                out = (out.view(batch, HKV, group, D) * s_v[None, :, None].double()).view(batch, HQ, D)
            row[f"{name}_rel_err"] = ((out - ref).norm() / ref.norm()).item()
            row[f"{name}_max_abs_err"] = (out - ref).abs().max().item()
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = make_parser(__doc__)
    ap.add_argument("--quick", action="store_true", help="fewer shapes")
    ap.add_argument("--out", default=None, help="write all figures as JSON here (default: none written)")
    ap.add_argument("--graphs", action="store_true",
                    help="also time decode calls replayed from a CUDA graph (how the engine runs them)")
    ap.add_argument("--extend-only", action="store_true", help="only the extend rows")
    ap.add_argument("--repeats", type=int, default=1, help="extend: do_bench medians per time (their median is shown)")
    args = ap.parse_args(argv)
    require_cuda(ap)
    torch.manual_seed(0)
    dev = torch.cuda.get_device_name()
    copy_bw = copy_bandwidth()
    print(f"# {dev}, torch {torch.__version__}, triton {triton.__version__}")
    print(f"copy bandwidth (read + write): {copy_bw / 1e12:.2f} TB/s")
    dec = [] if args.extend_only else decode_rows(args.quick, copy_bw, args.graphs)
    print("\n## paged decode (Hq 32, Hkv 8, D 128, block 16)")
    print("| batch | ctx | SDPA bf16 ms | int8 ms | int8 TB/s | int8 % copy | int8 x SDPA | bf16 ms | bf16 TB/s | bf16 % copy | bf16 x SDPA |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in dec:
        print(f"| {r['batch']} | {r['ctx']} | {r['sdpa_ms']:.4f} | {r['int8_ms']:.4f} | {r['int8_tbs']:.2f} | "
              f"{100 * r['int8_copy_frac']:.0f}% | {r['int8_vs_sdpa']:.2f} | {r['bf16_ms']:.4f} | {r['bf16_tbs']:.2f} | "
              f"{100 * r['bf16_copy_frac']:.0f}% | {r['bf16_vs_sdpa']:.2f} |")
    ext = extend_rows(args.quick, args.repeats)
    if args.graphs:
        print("\n## paged decode replayed from a CUDA graph (50 calls per graph, no L2 flush)")
        print("| batch | ctx | SDPA bf16 ms | int8 ms | int8 % copy | int8 x SDPA | bf16 ms | bf16 % copy | bf16 x SDPA |")
        print("|---|---|---|---|---|---|---|---|---|")
        for r in dec:
            print(f"| {r['batch']} | {r['ctx']} | {r['sdpa_graph_ms']:.4f} | {r['int8_graph_ms']:.4f} | "
                  f"{100 * r['int8_graph_copy_frac']:.0f}% | {r['int8_graph_vs_sdpa']:.2f} | {r['bf16_graph_ms']:.4f} | "
                  f"{100 * r['bf16_graph_copy_frac']:.0f}% | {r['bf16_graph_vs_sdpa']:.2f} |")
    print("\n## paged extend vs SDPA causal (contiguous bf16): the Triton kernel, and gather + FlashAttention")
    print("| batch | prefix | prompt | SDPA causal ms | int8 ms | int8 / SDPA | bf16 ms | bf16 / SDPA | "
          "flash int8 ms | flash int8 / SDPA | flash bf16 ms | flash bf16 / SDPA | flash int8 rel err |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in ext:
        print(f"| {r['batch']} | {r['prefix']} | {r['prompt']} | {r['sdpa_causal_ms']:.3f} | {r['int8_ms']:.3f} | "
              f"{r['int8_over_sdpa']:.2f} | {r['bf16_ms']:.3f} | {r['bf16_over_sdpa']:.2f} | {r['flash_int8_ms']:.3f} | "
              f"{r['flash_int8_over_sdpa']:.2f} | {r['flash_bf16_ms']:.3f} | {r['flash_bf16_over_sdpa']:.2f} | "
              f"{r['flash_int8_rel_err_vs_sdpa']:.1e} |")
    if args.repeats > 1:
        print(f"\nranges over {args.repeats} do_bench medians (ms): " + "; ".join(
            f"B{r['batch']} prefix {r['prefix']} n {r['prompt']}: SDPA {r['sdpa_causal_range'][0]:.3f}-"
            f"{r['sdpa_causal_range'][1]:.3f}, flash int8 {r['flash_int8_range'][0]:.3f}-{r['flash_int8_range'][1]:.3f}, "
            f"int8 {r['int8_range'][0]:.3f}-{r['int8_range'][1]:.3f}" for r in ext))
    fid = [] if args.extend_only else fidelity_rows()
    print("\n## fidelity: decode output vs fp64 reference (B 8, ctx 2048)")
    print("| inputs | int8 rel err | int8 smoothed rel err | bf16 rel err | smoothed int8 / bf16 |")
    print("|---|---|---|---|---|")
    for r in fid:
        print(f"| {r['case']} | {r['int8_rel_err']:.2e} | {r['int8_smoothed_rel_err']:.2e} | "
              f"{r['bf16_rel_err']:.2e} | {r['int8_smoothed_rel_err'] / r['bf16_rel_err']:.2f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=dev, copy_tbs=copy_bw / 1e12, decode=dec, extend=ext, fidelity=fid), f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
