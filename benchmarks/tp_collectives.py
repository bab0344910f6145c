"""The collectives of one tensor-parallel decode step, timed alone (issue 19): what N ranks add to
every step on top of their share of the arithmetic.

    python3 benchmarks/tp_collectives.py --size 2                     # GPUs cuda:0..1, NCCL
    python3 benchmarks/tp_collectives.py --size 2 --device cpu --rows 1,16   # gloo, a smoke run

A decode step of R rows runs, through model/parallel.py's TensorParallel (the calls the model
makes): the embedding's all-reduce and two per layer (after o_proj and after down_proj) of
(R, hidden) in bf16 (fp32 on the CPU), then the gather of each rank's (R, ceil(V/N)) logits. On
CUDA one step's collectives are captured in a CUDA graph, as the engine replays a decode step, and
timed by replaying it between CUDA events; on the CPU they run eagerly. Before timing, each rank
checks one all-reduce and one gather against the sums and concatenation of every rank's inputs
(drawn from per-rank seeds, so each rank can draw the others' too).

Prints per shape and row count: ms per step (median of --repeats timings of --iters steps, with
the spread), µs per all-reduce, and the all-reduce's bus bandwidth (2 (N-1)/N bytes/time, NCCL's
convention). Shapes are the published configs' (benchmarks/tp_vocab.py).
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

_ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(_ROOT), str(_ROOT / "clients")]  # benchmarks.*, and this checkout's pie
from benchmarks.common import DEVICE_HELP, default_device, make_parser  # noqa: E402
from benchmarks.tp_vocab import SHAPES  # noqa: E402
from pie.model.parallel import TensorParallel  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _draw(rank: int, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Rank `rank`'s input: the same on whichever rank draws it."""
    g = torch.Generator().manual_seed(1000 + rank)
    return torch.randn(shape, generator=g).to(dtype=dtype, device=device)


def _check(tp: TensorParallel, rows: int, hidden: int, per_rank: int, dtype: torch.dtype,
           device: torch.device) -> None:
    """One all-reduce and one gather against what they must give, from every rank's inputs."""
    x = _draw(tp.rank, (rows, hidden), dtype, device)
    want = sum(_draw(r, (rows, hidden), torch.float32, device) for r in range(tp.size))
    got = tp.all_reduce(x).float()
    assert torch.allclose(got, want, rtol=2e-2, atol=2e-2 * tp.size), "all-reduce gave a wrong sum"
    part = _draw(tp.rank, (rows, per_rank), dtype, device)
    total = per_rank * tp.size - 1  # a padded last share, as an odd vocabulary gives
    gathered = tp.gather_columns(part, total)
    want_g = torch.cat([_draw(r, (rows, per_rank), dtype, device) for r in range(tp.size)], dim=1)[:, :total]
    assert torch.equal(gathered, want_g), "gather gave wrong columns"


def _time_step(step, device: torch.device, iters: int, repeats: int) -> list[float]:
    """Seconds per step, `repeats` timings of `iters` steps each (a CUDA graph of one step on CUDA)."""
    step()  # warm-up (and NCCL's lazy setup of the buffers it uses)
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        graph.replay()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(repeats):
            dist.barrier(device_ids=[device.index])
            start.record()
            for _ in range(iters):
                graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e-3 / iters)
        del graph
    else:
        for _ in range(repeats):
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                step()
            times.append((time.perf_counter() - t0) / iters)
    return times


def _rank_main(rank: int, size: int, port: int, args, out: str) -> None:
    device = torch.device("cpu") if args.device == "cpu" else torch.device("cuda", rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.set_num_threads(1)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=size, device_id=device if device.type == "cuda" else None)
    tp = TensorParallel(rank, size)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    results = []
    for name in args.shapes.split(","):
        shape = SHAPES[name]
        hidden, layers, vocab = shape["hidden_size"], shape["num_hidden_layers"], shape["vocab_size"]
        per_rank = -(-vocab // size)
        for rows in (int(r) for r in args.rows.split(",")):
            _check(tp, rows, hidden, per_rank, dtype, device)
            x = torch.randn(rows, hidden, dtype=dtype, device=device)
            logits = torch.randn(rows, per_rank, dtype=dtype, device=device)
            n_reduce = 2 * layers + 1

            def step() -> None:
                for _ in range(n_reduce):
                    tp.all_reduce(x)
                    x.mul_(1.0 / size)  # the sum stays of the inputs' size, as a layer's output does
                tp.gather_columns(logits, vocab)

            def reduce_only() -> None:
                tp.all_reduce(x)
                x.mul_(1.0 / size)

            step_s = _time_step(step, device, args.iters, args.repeats)
            one_s = _time_step(reduce_only, device, args.iters * 4, args.repeats)
            bytes_ = rows * hidden * x.element_size()
            one = statistics.median(one_s)
            results.append(dict(shape=name, rows=rows, all_reduces=n_reduce, step_ms=statistics.median(step_s) * 1e3,
                                step_ms_spread=[min(step_s) * 1e3, max(step_s) * 1e3], all_reduce_us=one * 1e6,
                                bus_gb_s=2 * (size - 1) / size * bytes_ / one / 1e9))
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.barrier()
    os._exit(0)  # results are written; not the process group's teardown (gloo's races a peer's exit)


def main(argv: list[str] | None = None) -> int:
    ap = make_parser(__doc__)
    ap.add_argument("--size", type=int, default=2, help="ranks (on CUDA, GPUs cuda:0..size-1)")
    ap.add_argument("--device", default=None, help=DEVICE_HELP)
    ap.add_argument("--shapes", default="Llama-3.2-1B,Qwen3-4B",
                    help=f"model shapes, comma-separated, of {', '.join(SHAPES)}")
    ap.add_argument("--rows", default="1,16,64,256", help="decode rows per step, comma-separated")
    ap.add_argument("--iters", type=int, default=50, help="steps per timing")
    ap.add_argument("--repeats", type=int, default=5, help="timings per case; the median is reported")
    ap.add_argument("--out", default=None, help="JSON file for every figure (default: none written)")
    args = ap.parse_args(argv)
    args.device = args.device or default_device()
    unknown = [s for s in args.shapes.split(",") if s not in SHAPES]
    if unknown:
        ap.error(f"--shapes: unknown {', '.join(unknown)} (known: {', '.join(SHAPES)})")
    if args.size < 1:
        ap.error("--size must be at least 1 (1: a check of this script's path alone; one rank's collectives copy)")
    if args.device == "cuda" and torch.cuda.device_count() < args.size:
        ap.exit(2, f"{ap.prog}: --size {args.size} needs {args.size} GPUs, {torch.cuda.device_count()} visible\n")
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "results.json")
        mp.start_processes(_rank_main, args=(args.size, _free_port(), args, out), nprocs=args.size,
                           start_method="spawn")
        results = json.loads(Path(out).read_text())
    print(f"# {args.size} ranks on {args.device} ({'NCCL, a CUDA graph per step' if args.device == 'cuda' else 'gloo'})")
    print("| shape | rows | all-reduces per step | ms per step (spread) | µs per all-reduce | all-reduce bus GB/s |")
    print("|---|---|---|---|---|---|")
    for r in results:
        lo, hi = r["step_ms_spread"]
        print(f"| {r['shape']} | {r['rows']} | {r['all_reduces']} | {r['step_ms']:.3f} ({lo:.3f}-{hi:.3f}) "
              f"| {r['all_reduce_us']:.1f} | {r['bus_gb_s']:.1f} |")
    if args.out:
        Path(args.out).write_text(json.dumps(dict(size=args.size, device=args.device, results=results), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
