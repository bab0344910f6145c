"""Serving benchmark through gRPC: an asyncio load generator (no gRPC load tool installs here).

    python benchmarks/serving.py --concurrency 1,16,64            # closed loop, N streams each
    python benchmarks/serving.py --rates 2,8,32 --requests 200    # Poisson arrivals, requests/s
    python benchmarks/serving.py --address 127.0.0.1:50051 ...    # an already running server

Without --address it starts `pie serve` (the bundled model unless --model) as a subprocess on a
free port, so the server and the load generator are separate processes as in production. Per
load level it reports throughput (generated tokens/s), TTFT, inter-token latency and end-to-end
latency (p50/p90/p99), writes every figure as JSON (--out) and plots throughput and latency
against load as PNGs (--plot PREFIX).

Inter-token latency: the server coalesces tokens made since its last message, so a message may
carry several tokens; each token of a message counts the gap since the previous message divided
by the number of tokens in it.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "clients"))
import grpc  # noqa: E402
from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402

from benchmarks.common import make_parser  # noqa: E402
from pie_client import AsyncClient  # noqa: E402


@dataclass
class RequestStats:
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    tokens: int = 0
    error: str | None = None


def percentile(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    k = min(len(s) - 1, max(0, round(p / 100 * (len(s) - 1))))
    return s[k]


async def one_request(client: AsyncClient, prompt: list[int], max_tokens: int,
                      temperature: float = 0.8) -> RequestStats:
    st = RequestStats()
    t0 = last = time.perf_counter()
    try:
        async for delta in client.stream(prompt, max_tokens=max_tokens, ignore_eos=True, temperature=temperature,
                                         seed=random.randrange(2**31)):
            now = time.perf_counter()
            n = len(delta.token_ids)
            if n:
                if st.tokens == 0:
                    st.ttft_s = now - t0
                else:
                    st.itl_s.extend([(now - last) / n] * n)
                st.tokens += n
                last = now
    except Exception as e:  # noqa: BLE001 - a benchmark reports failures instead of stopping
        st.error = f"{type(e).__name__}: {e}"
    st.e2e_s = time.perf_counter() - t0
    return st


def summarize(label: str, load: float, stats: list[RequestStats], wall_s: float) -> dict:
    ok = [s for s in stats if s.error is None]
    itl = [x for s in ok for x in s.itl_s]
    row = dict(mode=label, load=load, requests=len(stats), errors=len(stats) - len(ok), wall_s=wall_s,
               tokens=sum(s.tokens for s in ok), tok_per_s=sum(s.tokens for s in ok) / wall_s,
               req_per_s=len(ok) / wall_s)
    for name, values in (("ttft", [s.ttft_s for s in ok]), ("itl", itl), ("e2e", [s.e2e_s for s in ok])):
        for p in (50, 90, 99):
            row[f"{name}_p{p}_ms"] = 1e3 * percentile(values, p)
    return row


async def closed_loop(address, prompts, concurrency: int, requests: int, max_tokens: int) -> dict:
    """`concurrency` streams, each starting its next request when the previous one ends."""
    async with AsyncClient(address, timeout=600) as client:
        queue = list(range(requests))
        stats: list[RequestStats] = []

        async def worker():
            while queue:
                i = queue.pop()
                stats.append(await one_request(client, prompts[i % len(prompts)], max_tokens))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return summarize("closed", concurrency, stats, time.perf_counter() - t0)


async def poisson(address, prompts, rate: float, requests: int, max_tokens: int) -> dict:
    """Requests arrive as a Poisson process of `rate` per second, whatever is in flight."""
    async with AsyncClient(address, timeout=600) as client:
        rng = random.Random(0)
        tasks = []
        t0 = time.perf_counter()
        for i in range(requests):
            tasks.append(asyncio.create_task(one_request(client, prompts[i % len(prompts)], max_tokens)))
            await asyncio.sleep(rng.expovariate(rate))
        stats = await asyncio.gather(*tasks)
        return summarize("poisson", rate, list(stats), time.perf_counter() - t0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str | None, extra: list[str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "service.cli", "serve", "--port", str(port), "--log-level", "warning", *extra]
    if model:
        cmd += ["--model", model]
    proc = subprocess.Popen(cmd, cwd=Path(__file__).resolve().parents[1], env={**os.environ, "PYTHONUNBUFFERED": "1"})
    address = f"127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    with grpc.insecure_channel(address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                sys.exit(f"server exited with {proc.returncode}")
            try:
                r = stub.Check(health_pb2.HealthCheckRequest(service="pie.v1.GenerateService"), timeout=2)
                if r.status == health_pb2.HealthCheckResponse.SERVING:
                    return proc, address
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    proc.kill()
    sys.exit("server did not become ready")


def main(argv: list[str] | None = None) -> int:
    ap = make_parser(__doc__)
    ap.add_argument("--address", help="a running server, host:port (default: start `pie serve` here)")
    ap.add_argument("--model", help="model folder for the started server (default: the bundled model)")
    ap.add_argument("--server-args", default="", help="extra `pie serve` flags, one string (default: none)")
    ap.add_argument("--concurrency", default="",
                    help="closed-loop levels, e.g. 1,16,64 (default: 1,16 where --rates is not given, else none)")
    ap.add_argument("--rates", default="", help="Poisson arrival rates in requests/s, e.g. 2,8 (default: none)")
    ap.add_argument("--requests", type=int, default=0,
                    help="requests per level (default: closed loop 4 x the concurrency and at least 16; Poisson 64)")
    ap.add_argument("--prompt-len", type=int, default=64, help="random prompt ids per request")
    ap.add_argument("--max-tokens", type=int, default=128, help="tokens generated per request")
    ap.add_argument("--vocab", type=int, default=2000, help="prompt ids are drawn from [3, vocab)")
    ap.add_argument("--out", help="JSON file for every figure (default: none written)")
    ap.add_argument("--plot", help="PNG prefix: PREFIX-MODE-throughput.png and PREFIX-MODE-latency.png per "
                                   "mode with two or more levels (default: no plots)")
    args = ap.parse_args(argv)
    if not args.concurrency and not args.rates:
        args.concurrency = "1,16"
    proc = None
    address = args.address
    if address is None:
        proc, address = start_server(args.model, args.server_args.split())
    rng = random.Random(1)
    prompts = [[rng.randrange(3, args.vocab) for _ in range(args.prompt_len)] for _ in range(64)]
    rows = []
    try:
        for c in [int(x) for x in args.concurrency.split(",") if x]:
            n = args.requests or max(16, 4 * c)
            rows.append(asyncio.run(closed_loop(address, prompts, c, n, args.max_tokens)))
            print_row(rows[-1])
        for r in [float(x) for x in args.rates.split(",") if x]:
            n = args.requests or 64
            rows.append(asyncio.run(poisson(address, prompts, r, n, args.max_tokens)))
            print_row(rows[-1])
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2))
    if args.plot:
        from training.plot import plot_curves

        for mode in ("closed", "poisson"):
            pts = [r for r in rows if r["mode"] == mode]
            if len(pts) >= 2:
                plot_curves(f"{args.plot}-{mode}-throughput.png", [[(r["load"], r["tok_per_s"]) for r in pts]])
                plot_curves(f"{args.plot}-{mode}-latency.png",
                            [[(r["load"], r["ttft_p50_ms"]) for r in pts], [(r["load"], r["itl_p50_ms"]) for r in pts]])
    return 0


def print_row(r: dict) -> None:
    print(f"{r['mode']:7s} load {r['load']:>6g}: {r['requests']} req ({r['errors']} errors) in {r['wall_s']:.1f} s, "
          f"{r['tok_per_s']:,.0f} tok/s; TTFT p50/p90/p99 {r['ttft_p50_ms']:.0f}/{r['ttft_p90_ms']:.0f}/"
          f"{r['ttft_p99_ms']:.0f} ms; ITL p50/p90/p99 {r['itl_p50_ms']:.1f}/{r['itl_p90_ms']:.1f}/"
          f"{r['itl_p99_ms']:.1f} ms; e2e p50/p99 {r['e2e_p50_ms']:.0f}/{r['e2e_p99_ms']:.0f} ms", flush=True)


if __name__ == "__main__":
    sys.exit(main())
