"""The gathered LoRA kernels on the GPU (issue 61): their time per projection and per step, beside
the base projections they add to.

    python -m benchmarks.lora_kernels                      # qwen2-7b shape, 256 and 8,192 rows, 1 and 8 slots
    python -m benchmarks.lora_kernels --whole-k            # also the shrink without its K chunks (before them)
    python -m benchmarks.lora_kernels --shape llama-1b --tokens 64,256 --rank 64

For each projection of the shape (qkv, o, gate_up, down: the fused ones' banks hold a rank's rows
per part, as LoraBank does) and each step of T rows spread round-robin over S slots: the base GEMM
(x W^T, cuBLAS) and `lora_delta_` (shrink, reduce, expand), each captured in a CUDA graph and timed
by replaying it (median of 5 runs of 20 replays), the deltas first checked against the torch twin.
The table gives the microseconds of each and, per step, the layers' sum: the LoRA kernels' time as
a share of the base projections' (the ≤ 5% that issue 61's throughput target leaves them).
"""

from __future__ import annotations

import statistics
import sys

import torch

from benchmarks.common import make_parser, require_cuda

NEEDS_GPU = True  # read by `pie bench` (with ast, without importing this file)
# name: (hidden, intermediate, q heads, kv heads, head dim, layers)
SHAPES = {"qwen2-7b": (3584, 18944, 28, 4, 128, 28), "llama-1b": (2048, 8192, 32, 8, 64, 16)}


def projections(shape: str, rank: int) -> dict[str, tuple[int, int, int]]:
    """name: (K, N, rank rows of the bank)."""
    hidden, inter, hq, hkv, d, _ = SHAPES[shape]
    return {"qkv": (hidden, (hq + 2 * hkv) * d, 3 * rank), "o": (hq * d, hidden, rank),
            "gate_up": (hidden, 2 * inter, 2 * rank), "down": (inter, hidden, rank)}


def graph_time(fn, replays: int = 20, runs: int = 5) -> float:
    """Microseconds per call of `fn`, captured in a CUDA graph and replayed."""
    fn()  # compile and warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / replays)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    ap = make_parser(__doc__)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen2-7b", help="model shape")
    ap.add_argument("--tokens", default="256,8192", help="rows per step (a decode batch, a prefill chunk)")
    ap.add_argument("--slots", default="1,8", help="adapters the rows are spread over")
    ap.add_argument("--rank", type=int, default=16, help="LoRA rank")
    ap.add_argument("--whole-k", action="store_true", help="also time the shrink with the whole K in one program")
    args = ap.parse_args(argv)
    require_cuda(ap)
    from pie.kernels import triton_lora as tlo

    layers = SHAPES[args.shape][-1]
    gen = torch.Generator(device="cuda").manual_seed(0)
    chunkings = [("chunks", tlo.K_CHUNK)] + ([("whole K", 1 << 20)] if args.whole_k else [])
    print(f"# {torch.cuda.get_device_name()}, {args.shape}, rank {args.rank}, bf16; microseconds per call "
          f"(CUDA graph replay), K_CHUNK {tlo.K_CHUNK}")
    print("| T | slots | shrink | qkv base / LoRA | o base / LoRA | gate_up base / LoRA | down base / LoRA "
          "| per step: base / LoRA (LoRA / base) |")
    print("|---|---|---|---|---|---|---|---|")
    for t in (int(v) for v in args.tokens.split(",")):
        for s in (int(v) for v in args.slots.split(",")):
            slots = (torch.arange(t, device="cuda", dtype=torch.int32) % s).contiguous()
            for label, chunk in chunkings:
                tlo.K_CHUNK = chunk
                cells, base_sum, lora_sum = [], 0.0, 0.0
                for k, n, rows in projections(args.shape, args.rank).values():
                    x = torch.randn(t, k, device="cuda", generator=gen, dtype=torch.bfloat16)
                    w = torch.randn(n, k, device="cuda", generator=gen, dtype=torch.bfloat16) / k ** 0.5
                    a = torch.randn(s, rows, k, device="cuda", generator=gen, dtype=torch.bfloat16) / k ** 0.5
                    b = torch.randn(s, n, rows, device="cuda", generator=gen, dtype=torch.bfloat16) * 0.01
                    y = x @ w.T
                    want = tlo.lora_delta_reference_(y.clone(), x, a, b, slots)
                    got = tlo.lora_delta_(y.clone(), x, a, b, slots)
                    err = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
                    assert err < 2e-2, f"{k}x{n}, T {t}, {s} slots: relative error {err:.2e} against the twin"
                    order = tlo.slot_order(slots)
                    base_us = graph_time(lambda x=x, w=w, y=y: torch.matmul(x, w.T, out=y))
                    lora_us = graph_time(lambda y=y, x=x, a=a, b=b: tlo.lora_delta_(y, x, a, b, slots, order))
                    cells.append(f"{base_us:.1f} / {lora_us:.1f}")
                    base_sum += base_us
                    lora_sum += lora_us
                print(f"| {t} | {s} | {label} | {' | '.join(cells)} | {layers * base_sum / 1e3:.2f} / "
                      f"{layers * lora_sum / 1e3:.2f} ms ({100 * lora_sum / base_sum:.1f}%) |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
