"""What a step that carries prompt tokens beside its running decodes costs (issue 29): the line the
stall bound fits (engine/scheduling/stall.py StallBound: t_decode + t_fixed + c x n), where the step's time
goes by kernel class, and prefill's share of the dense bf16 peak.

    python benchmarks/mixed_step.py                          # GPU: Llama-3.1-8B shape, 32 decodes
    python benchmarks/mixed_step.py --shape qwen3-4b --decodes 64
    python benchmarks/mixed_step.py --tiny                   # CPU smoke run (small model)

D requests are admitted and prefilled (contexts of --ctx tokens), then each measured step carries
their D decodes and one new prompt of n random tokens (whole, in that step: the stall bound is off
here, max_num_batched_tokens is n + D), which samples its first token and ends. Steps are timed
synchronously (async scheduling off: the step's own wall time), --repeats per n, the median kept,
as served (piecewise graphs up to --mixed-graph-max-tokens, engine/runner/cuda_graphs.py) and eagerly,
alternating; the decode-only step as served (its graph), from the piecewise graphs, and eagerly. Then, for a few n,
torch.profiler splits one step's device time into GEMMs, attention (the Triton cache-write, decode
and extend kernels), the other Triton kernels (norms, rotary, SiLU), and the rest (elementwise,
sampling, copies); wall time minus device-busy time is what the host left the GPU idle.

FLOPs: 2 x (linear weights) per token, plus causal attention over the new prompt (2 x n^2 x Hq x
head_dim per layer); the decodes' share is counted too. "GEMM TFLOP/s" is the linear FLOPs over the
GEMM kernels' time, against --peak-tflops (H200 dense bf16: 989).
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

_ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(_ROOT), str(_ROOT / "clients")]  # benchmarks.*, and this checkout's pie
from benchmarks.common import DEVICE_HELP, default_device, make_parser  # noqa: E402
from benchmarks.mixed import SHAPES, build_model  # noqa: E402
from pie.engine.config import EngineConfig  # noqa: E402
from pie.engine.core.engine_core import EngineCore  # noqa: E402
from pie.engine.runner.cuda_graphs import CudaGraphs, PiecewiseGraphs  # noqa: E402
from pie.engine.sampling_params import SamplingParams  # noqa: E402

ATTENTION_KERNELS = ("_decode_stage", "_extend_kernel", "_write_kv")
OTHER_TRITON = ("_rms_norm", "_silu_mul", "_rotary", "_apply_token_bitmask")
GEMM_MARKS = ("gemm", "nvjet", "cutlass", "xmma", "cublas", "matmul", "splitk", "sm90_")


def kernel_class(name: str) -> str:
    if any(m in name for m in ATTENTION_KERNELS):
        return "attention"
    if any(m in name for m in OTHER_TRITON):
        return "norms/rotary/silu"
    if any(m in name.lower() for m in GEMM_MARKS):
        return "gemm"
    return "other"


def linear_params(cfg) -> int:
    """Weights of one token's matrix products through every layer (the LM head excluded)."""
    h, d = cfg.hidden_size, cfg.head_dim
    qkv = h * d * (cfg.num_attention_heads + 2 * cfg.num_key_value_heads)
    o = cfg.num_attention_heads * d * h
    mlp = 3 * h * cfg.intermediate_size
    return cfg.num_hidden_layers * (qkv + o + mlp)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed_step(eng: EngineCore, device: str) -> float:
    sync(device)
    t0 = time.perf_counter()
    eng.step()
    sync(device)
    return time.perf_counter() - t0


def fit_line(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least squares y = a + b n over (n, y); returns (a, b)."""
    n = [float(p[0]) for p in points]
    y = [p[1] for p in points]
    mn, my = statistics.fmean(n), statistics.fmean(y)
    var = sum((x - mn) ** 2 for x in n)
    b = sum((x - mn) * (v - my) for x, v in zip(n, y)) / var
    return my - b * mn, b


def profile_step(eng: EngineCore, device: str, add) -> dict[str, float]:
    """Device time (ms) by kernel class over one step that `add()` gives a prompt, and the wall."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    add()
    sync(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        eng.step()
        sync(device)
        wall = time.perf_counter() - t0
    by_class: dict[str, float] = {}
    spans = []
    for e in prof.events():
        if e.device_type != DeviceType.CUDA:
            continue
        us = e.time_range.elapsed_us()
        by_class[kernel_class(e.name)] = by_class.get(kernel_class(e.name), 0.0) + us / 1e3
        spans.append((e.time_range.start, e.time_range.end))
    busy, end = 0.0, float("-inf")  # union of the kernels' intervals (one stream, but be safe)
    for s, t in sorted(spans):
        if t > end:
            busy += t - max(s, end)
            end = t
    by_class["device busy"] = busy / 1e3
    by_class["wall"] = wall * 1e3
    by_class["host-bound (wall - busy)"] = wall * 1e3 - busy / 1e3
    return by_class


def main(argv: list[str] | None = None) -> int:
    ap = make_parser(__doc__)
    ap.add_argument("--shape", default="llama-8b", choices=sorted(SHAPES), help="model shape (benchmarks/mixed.py)")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run: the tiny shape, small chunks")
    ap.add_argument("--device", default=None, help=DEVICE_HELP)
    ap.add_argument("--decodes", type=int, default=32, help="running decodes every measured step carries")
    ap.add_argument("--ctx", type=int, default=1800, help="their context length (tokens)")
    ap.add_argument("--chunks", default="64,256,512,1024,2048,4096,8192", help="prompt tokens per step, comma-separated")
    ap.add_argument("--profile-chunks", default="512,2048,8192", help="chunks profiled by kernel class")
    ap.add_argument("--repeats", type=int, default=5, help="steps timed per chunk size (the median is kept)")
    ap.add_argument("--kv", default="int8", help="KV cache dtype")
    ap.add_argument("--mixed-graph-max-tokens", type=int, default=EngineConfig().mixed_graph_max_tokens,
                    help="piecewise graphs up to this many tokens a step (the engine's default)")
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak of the device (H200: 989)")
    ap.add_argument("--out", default=None, help="write the figures as JSON here (default: print only)")
    args = ap.parse_args(argv)
    device = args.device or default_device()
    on_gpu = device.startswith("cuda")
    if args.tiny:
        args.shape, args.decodes, args.ctx = "tiny", min(args.decodes, 4), min(args.ctx, 64)
        args.chunks, args.profile_chunks, args.repeats = "16,64,128", "64", min(args.repeats, 3)
    chunks = [int(c) for c in args.chunks.split(",")]
    # chunks the step takes whole (on the CPU: no kernels, the wall only)
    profiled = [int(c) for c in args.profile_chunks.split(",") if c and int(c) <= max(chunks)]
    arch, shape = SHAPES[args.shape]
    max_len = args.ctx + 64 + max(chunks) + 16
    dtype = torch.bfloat16 if on_gpu else torch.float32
    with tempfile.TemporaryDirectory() as tmp:
        build_model(Path(tmp), arch, shape, dtype, max_len=max_len)
        eng = EngineCore(EngineConfig(model=tmp, device=device, dtype="bf16" if on_gpu else "fp32",
                                      kv_cache_dtype=args.kv, max_num_seqs=args.decodes + 2,
                                      max_num_batched_tokens=max(chunks) + args.decodes + 2, max_model_len=max_len,
                                      decode_stall_factor=0.0, async_scheduling=False,
                                      mixed_graph_max_tokens=args.mixed_graph_max_tokens,
                                      kv_cache_memory_bytes=None if on_gpu else (256 << 20)))
        cfg = eng.model.config
        vocab = shape["vocab_size"]
        rng = random.Random(0)
        running = SamplingParams(max_tokens=max_len - args.ctx, temperature=0, ignore_eos=True)
        for i in range(args.decodes):
            eng.add_request(f"d{i}", [rng.randrange(3, vocab) for _ in range(args.ctx)], running)
        while eng.scheduler.num_waiting or any(r.num_output_tokens == 0 for r in eng.scheduler.running):
            eng.step()
        for _ in range(3):
            eng.step()
        counter = iter(range(1 << 30))

        def add(n: int) -> None:  # one prompt of n fresh tokens that ends after its first token
            eng.add_request(f"p{next(counter)}", [rng.randrange(3, vocab) for _ in range(n)],
                            SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))

        runner = eng.runner
        graphs, pieces = runner.graphs, runner.pieces

        def use(decode_graphs: bool, piecewise: bool) -> None:  # the runner's graphs, or none of that kind
            runner.graphs = graphs if decode_graphs else CudaGraphs()
            runner.pieces = pieces if piecewise else PiecewiseGraphs()

        def median_ms(n: int) -> float:
            return statistics.median(timed_step(eng, device) for _ in range(n)) * 1e3

        decode_ms = median_ms(max(args.repeats, 5))
        use(decode_graphs=False, piecewise=True)  # a decode step from the pieces of its token bucket
        piece_ms = median_ms(max(args.repeats, 5))
        use(decode_graphs=False, piecewise=False)
        eager_ms = median_ms(max(args.repeats, 5))
        use(decode_graphs=True, piecewise=True)
        print(f"# {args.shape} on {device}, {args.decodes} decodes at context ~{args.ctx}, kv {args.kv}, "
              f"piecewise graphs up to {runner.mixed_graph_max_tokens if pieces else 0} tokens")
        print(f"decode-only step: {decode_ms:.3f} ms as served{' (graph)' if on_gpu else ''}, {piece_ms:.3f} ms "
              f"from the pieces, {eager_ms:.3f} ms eager")
        per_token = 2 * linear_params(cfg)
        attn_per_layer = 2 * cfg.num_attention_heads * cfg.head_dim  # x n^2 for a causal prompt of n
        rows = []
        print("| prompt tokens | step ms (median) | spread | over decode-only ms | TFLOP/s of the step | eager ms | "
              "eager spread |")
        print("|---|---|---|---|---|---|---|")
        for n in chunks:
            times, eager_times = [], []
            for _ in range(args.repeats):
                for piecewise, into in ((True, times), (False, eager_times)):
                    use(decode_graphs=True, piecewise=piecewise)
                    add(n)
                    into.append(timed_step(eng, device) * 1e3)
            use(decode_graphs=True, piecewise=True)
            med, eager_med = statistics.median(times), statistics.median(eager_times)
            flops = per_token * (n + args.decodes) + attn_per_layer * cfg.num_hidden_layers * n * n
            rows.append(dict(tokens=n, step_ms=med, min_ms=min(times), max_ms=max(times), extra_ms=med - decode_ms,
                             tflops=flops / med / 1e9, eager_ms=eager_med, eager_min_ms=min(eager_times),
                             eager_max_ms=max(eager_times)))
            print(f"| {n} | {med:.3f} | {min(times):.3f}-{max(times):.3f} | {med - decode_ms:.3f} | "
                  f"{flops / med / 1e9:.1f} | {eager_med:.3f} | {min(eager_times):.3f}-{max(eager_times):.3f} |")
        fixed, slope = fit_line([(r["tokens"], r["extra_ms"]) for r in rows])
        print(f"fit over the chunks: step = decode-only {decode_ms:.3f} + t_fixed {fixed:.3f} ms + "
              f"{slope * 1e3:.2f} us x prompt tokens")
        for factor in (2.0, 3.0):
            within = ((factor - 1) * decode_ms - fixed) / slope
            print(f"  stall factor {factor:g}: {max(0, int(within))} prompt tokens fit (floor t_fixed / c = "
                  f"{int(max(fixed, 0) / slope)})")
        profiles = {}
        for n in profiled:
            p = profile_step(eng, device, lambda n=n: add(n))
            lin = per_token * (n + args.decodes)
            p["gemm TFLOP/s"] = lin / p["gemm"] / 1e9 if p.get("gemm") else float("nan")
            p["gemm share of peak"] = p["gemm TFLOP/s"] / args.peak_tflops
            profiles[n] = p
        if profiles:
            keys = ["wall", "device busy", "host-bound (wall - busy)", "gemm", "attention", "norms/rotary/silu",
                    "other", "gemm TFLOP/s", "gemm share of peak"]
            print("| per step | " + " | ".join(f"{n} tokens" for n in profiles) + " |")
            print("|---|" + "---|" * len(profiles))
            for k in keys:
                cells = [profiles[n].get(k, 0.0) for n in profiles]
                fmt = "{:.0%}" if "share" in k else "{:.1f}" if "TFLOP" in k else "{:.3f} ms"
                print(f"| {k} | " + " | ".join(fmt.format(c) for c in cells) + " |")
        eng.close()
    if args.out:
        Path(args.out).write_text(json.dumps(dict(shape=args.shape, decodes=args.decodes, ctx=args.ctx, kv=args.kv,
                                                  decode_ms=decode_ms, piece_decode_ms=piece_ms,
                                                  eager_decode_ms=eager_ms, rows=rows,
                                                  t_fixed_ms=fixed, us_per_token=slope * 1e3,
                                                  profiles={str(k): v for k, v in profiles.items()}), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
