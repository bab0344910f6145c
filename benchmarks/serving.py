"""Serving benchmark through gRPC: an asyncio load generator (no gRPC load tool installs here), as
vLLM's benchmark_serving measures a server.

    python -m benchmarks.serving --concurrency 1,16,64            # closed loop, N streams each
    python -m benchmarks.serving --rates 2,8,32 --requests 200    # Poisson arrivals, requests/s
    python -m benchmarks.serving --sweep 1 --requests 100         # rates 1, 2, 4, ... up to the knee
    python -m benchmarks.serving --burst --requests 256           # everything sent at t = 0
    python -m benchmarks.serving --workload long --model DIR      # the long-context work
    python -m benchmarks.serving --address 127.0.0.1:50051 ...    # an already running server

Without --address it starts `pie serve` (the bundled model unless --model) as a subprocess on a
free port, so the server and the load generator are separate processes as in production.

Workloads (--workload; lengths in tokens, drawn with a fixed seed, prompts of random ids):
  fixed  every prompt --prompt-len, every output --max-tokens
  chat   prompts log-normal, median --prompt-len (sigma 0.8), outputs uniform in [--max-tokens / 4,
         --max-tokens]: short conversational turns
  mixed  issue 16's work: prompts median 250 (up to 2,000), a quarter after one shared 400-token
         prefix, outputs 32-400
  long   the long-context work: prompts median 800 (up to 6,000), a third after one shared
         1,500-token prefix, outputs 128-1,024
(--scale S multiplies every length of mixed and long, so the bundled model's 512-token context
takes them on the CPU.) Every load level sends the same lengths with its own ids (`for_level`), so
no level finds an earlier level's prompts in the server's prefix cache; the shared prefix is shared
within a level.

Per load level: throughput (generated tokens/s, requests/s), TTFT, TPOT (a request's decode time
over its tokens after the first), inter-token latency and end-to-end latency (p50/p90/p99), and
goodput: requests/s that met the SLO (--slo-ttft-ms and --slo-tpot-ms), with the share that did.
--sweep R doubles the Poisson rate from R until throughput stops growing by 5% or goodput falls
(the knee), or --max-rate. JSON with every figure (--out); latency-vs-rate and throughput PNGs
(--plot PREFIX).

Inter-token latency: the server coalesces tokens made since its last message, so a message may
carry several tokens; each token of a message counts the gap since the previous message divided
by the number of tokens in it.

Where a gap comes from: a server this script starts serves its metrics too, and after each level
the engine steps it ran are printed by kind and duration (pie_step_duration_seconds: decode-only
steps, steps that carry prompt tokens; how many took over 50 ms), so a latency tail can be told
apart from the engine's steps.
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

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from benchmarks.common import make_parser
from pie_client import AsyncClient


@dataclass
class RequestStats:
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    tokens: int = 0
    error: str | None = None

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first: (end - first token) / (tokens - 1)."""
        return (self.e2e_s - self.ttft_s) / (self.tokens - 1) if self.tokens > 1 else None


@dataclass
class Work:
    """What a load level sends: prompts (token ids) and how many tokens each asks for."""

    prompts: list[list[int]]
    max_tokens: list[int]


def workload(kind: str, n: int, vocab: int, *, prompt_len: int, max_tokens: int, scale: float = 1.0,
             seed: int = 1) -> Work:
    """The --workload distributions (module docstring); every length at least 1."""
    import math

    rng = random.Random(seed)

    def ids(k: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(max(1, k))]

    def lognormal(median: float, most: float) -> int:
        return int(min(most, max(1, round(rng.lognormvariate(math.log(median), 0.8)))))

    if kind == "fixed":
        return Work([ids(prompt_len) for _ in range(n)], [max_tokens] * n)
    if kind == "chat":
        return Work([ids(lognormal(prompt_len, 8 * prompt_len)) for _ in range(n)],
                    [rng.randint(max(1, max_tokens // 4), max_tokens) for _ in range(n)])
    median, most, prefix_len, every, outs = {
        "mixed": (250, 2000, 400, 4, (32, 400)),
        "long": (800, 6000, 1500, 3, (128, 1024)),
    }[kind]
    prefix = ids(round(prefix_len * scale))
    prompts, outputs = [], []
    for i in range(n):
        body = ids(lognormal(median * scale, most * scale))
        prompts.append(prefix + body if i % every == 0 else body)
        outputs.append(max(1, round(rng.randint(*outs) * scale)))
    return Work(prompts, outputs)


def for_level(work: Work, level: int, vocab: int) -> Work:
    """The work of the level-th load level: every id shifted by the same amount (mod the id range
    [3, vocab)), so prompts keep their lengths and what they share within the level, and no
    level's prompts repeat another's."""
    if level == 0:
        return work
    shift, span = level * 7919, vocab - 3
    return Work([[3 + (t - 3 + shift) % span for t in p] for p in work.prompts], work.max_tokens)


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


# The SLO goodput counts against (--slo-ttft-ms, --slo-tpot-ms): vLLM's examples use these.
SLO_TTFT_MS = 2000.0
SLO_TPOT_MS = 50.0


def summarize(label: str, load: float, stats: list[RequestStats], wall_s: float, *,
              slo_ttft_ms: float = SLO_TTFT_MS, slo_tpot_ms: float = SLO_TPOT_MS) -> dict:
    ok = [s for s in stats if s.error is None]
    itl = [x for s in ok for x in s.itl_s]
    good = [s for s in ok if 1e3 * s.ttft_s <= slo_ttft_ms and (s.tpot_s is None or 1e3 * s.tpot_s <= slo_tpot_ms)]
    row = dict(mode=label, load=load, requests=len(stats), errors=len(stats) - len(ok), wall_s=wall_s,
               tokens=sum(s.tokens for s in ok), tok_per_s=sum(s.tokens for s in ok) / wall_s,
               req_per_s=len(ok) / wall_s, goodput_req_per_s=len(good) / wall_s,
               slo_met=len(good) / len(stats) if stats else float("nan"), slo_ttft_ms=slo_ttft_ms,
               slo_tpot_ms=slo_tpot_ms)
    tpot = [t for s in ok if (t := s.tpot_s) is not None]
    for name, values in (("ttft", [s.ttft_s for s in ok]), ("tpot", tpot), ("itl", itl),
                         ("e2e", [s.e2e_s for s in ok])):
        for p in (50, 90, 99):
            row[f"{name}_p{p}_ms"] = 1e3 * percentile(values, p)
    return row


async def closed_loop(address, work: Work, concurrency: int, requests: int, **slo) -> dict:
    """`concurrency` streams, each starting its next request when the previous one ends."""
    async with AsyncClient(address, timeout=600) as client:
        queue = list(range(requests))
        stats: list[RequestStats] = []
        n = len(work.prompts)

        async def worker():
            while queue:
                i = queue.pop() % n
                stats.append(await one_request(client, work.prompts[i], work.max_tokens[i]))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return summarize("closed", concurrency, stats, time.perf_counter() - t0, **slo)


async def poisson(address, work: Work, rate: float | None, requests: int, **slo) -> dict:
    """Requests arrive as a Poisson process of `rate` per second, whatever is in flight; with
    rate None all of them at once (a burst)."""
    async with AsyncClient(address, timeout=600) as client:
        rng = random.Random(0)
        tasks = []
        n = len(work.prompts)
        t0 = time.perf_counter()
        for i in range(requests):
            tasks.append(asyncio.create_task(one_request(client, work.prompts[i % n], work.max_tokens[i % n])))
            if rate is not None:
                await asyncio.sleep(rng.expovariate(rate))
        stats = await asyncio.gather(*tasks)
        return summarize("poisson" if rate is not None else "burst", rate or 0.0, list(stats),
                         time.perf_counter() - t0, **slo)


def past_the_knee(rows: list[dict]) -> bool:
    """The sweep stops: throughput grew by less than 5% over the previous rate, or goodput fell."""
    if len(rows) < 2:
        return False
    prev, last = rows[-2], rows[-1]
    return last["tok_per_s"] < 1.05 * prev["tok_per_s"] or last["goodput_req_per_s"] < prev["goodput_req_per_s"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str | None, extra: list[str], metrics_port: int | None = None) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "pie.service.cli", "serve", "--port", str(port), "--log-level", "warning", *extra]
    if metrics_port is not None:
        cmd += ["--metrics-port", str(metrics_port)]
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
                    help="closed-loop levels, e.g. 1,16,64 (default: 1,16 when no other mode is given, else none)")
    ap.add_argument("--rates", default="", help="Poisson arrival rates in requests/s, e.g. 2,8 (default: none)")
    ap.add_argument("--sweep", type=float, default=0.0,
                    help="Poisson rates from this one, doubling, up to the knee or --max-rate (default: 0, no sweep)")
    ap.add_argument("--max-rate", type=float, default=256.0, help="the sweep's highest rate, requests/s")
    ap.add_argument("--burst", action="store_true", help="one level with every request sent at once")
    ap.add_argument("--requests", type=int, default=0,
                    help="requests per level (default: closed loop 4 x the concurrency and at least 16; otherwise 64)")
    ap.add_argument("--workload", choices=("fixed", "chat", "mixed", "long"), default="fixed",
                    help="prompt and output lengths (module docstring)")
    ap.add_argument("--scale", type=float, default=1.0, help="multiplies every length of the mixed and long workloads")
    ap.add_argument("--prompt-len", type=int, default=64, help="prompt tokens (fixed), or their median (chat)")
    ap.add_argument("--max-tokens", type=int, default=128, help="tokens generated (fixed), or the most (chat)")
    ap.add_argument("--vocab", type=int, default=2000, help="prompt ids are drawn from [3, vocab)")
    ap.add_argument("--slo-ttft-ms", type=float, default=SLO_TTFT_MS, help="goodput's bound on the time to first token")
    ap.add_argument("--slo-tpot-ms", type=float, default=SLO_TPOT_MS,
                    help="goodput's bound on the time per output token after the first")
    ap.add_argument("--out", help="JSON file for every figure (default: none written)")
    ap.add_argument("--plot", help="PNG prefix: PREFIX-MODE-throughput.png and PREFIX-MODE-latency.png (TTFT p50 and "
                                   "p99, ITL p50 and p99 against the load) per mode with two or more levels "
                                   "(default: no plots)")
    args = ap.parse_args(argv)
    if not (args.concurrency or args.rates or args.sweep or args.burst):
        args.concurrency = "1,16"
    proc = None
    address = args.address
    metrics_url = None
    if address is None:
        metrics_port = free_port()
        proc, address = start_server(args.model, args.server_args.split(), metrics_port)
        metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
    slo = dict(slo_ttft_ms=args.slo_ttft_ms, slo_tpot_ms=args.slo_tpot_ms)
    levels = max(args.requests, 64, 4 * max([int(x) for x in args.concurrency.split(",") if x] or [0]))
    work = workload(args.workload, levels, args.vocab, prompt_len=args.prompt_len, max_tokens=args.max_tokens,
                    scale=args.scale)
    rows: list[dict] = []

    def level() -> Work:  # the next level's own prompts
        return for_level(work, len(rows) + len(swept), args.vocab)

    def measure(run) -> dict:  # one level's row, with the engine steps it ran where this script started the server
        before = step_histogram(metrics_url) if metrics_url else None
        row = asyncio.run(run)
        print_row(row)
        if metrics_url and before is not None:
            row["server_steps"] = step_summary(before, step_histogram(metrics_url))
            print_steps(row["server_steps"])
        return row

    swept: list[dict] = []
    try:
        if args.burst:  # first, so that it meets a cold server as the rates do
            rows.append(measure(poisson(address, level(), None, args.requests or 64, **slo)))
        for c in [int(x) for x in args.concurrency.split(",") if x]:
            rows.append(measure(closed_loop(address, level(), c, args.requests or max(16, 4 * c), **slo)))
        for r in [float(x) for x in args.rates.split(",") if x]:
            rows.append(measure(poisson(address, level(), r, args.requests or 64, **slo)))
        rate = args.sweep
        while rate and rate <= args.max_rate and not past_the_knee(swept):
            swept.append(measure(poisson(address, level(), rate, args.requests or 64, **slo)))
            rate *= 2
        rows += swept
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2))
    if args.plot:
        from pie.training.plot import plot_curves

        for mode in ("closed", "poisson"):
            pts = [r for r in rows if r["mode"] == mode]
            if len(pts) >= 2:
                plot_curves(f"{args.plot}-{mode}-throughput.png", [[(r["load"], r["tok_per_s"]) for r in pts]])
                plot_curves(f"{args.plot}-{mode}-latency.png",
                            [[(r["load"], r[f"{m}_ms"]) for r in pts]
                             for m in ("ttft_p50", "ttft_p99", "itl_p50", "itl_p99")], log_y=True)
    return 0


STEP_KINDS = {"decode": "decode-only", "prompt": "with prompt tokens"}


def step_histogram(metrics_url: str) -> dict[str, list]:
    """The server's pie_step_duration_seconds now: per kind, (upper bound s, cumulative count);
    under "counters", pie_step_prompt_tokens and pie_steps_unbounded; under "bound", what the
    stall bound has learnt (the pie_stall_bound_* gauges)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(metrics_url, timeout=10) as r:
        text = r.read().decode()
    out: dict[str, list[tuple[float, float]]] = {kind: [] for kind in STEP_KINDS}
    counters: list[tuple[str, float]] = []
    bound: list[tuple[str, float]] = []
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "pie_step_duration_seconds_bucket" and s.labels.get("kind") in out:
                out[s.labels["kind"]].append((float(s.labels["le"]), s.value))
            elif s.name in ("pie_step_prompt_tokens_total", "pie_steps_unbounded_total"):
                counters.append((s.name, s.value))
            elif s.name.startswith("pie_stall_bound_"):
                bound.append((s.name.removeprefix("pie_stall_bound_"), s.value))
    return {**{kind: sorted(v) for kind, v in out.items()}, "counters": sorted(counters), "bound": sorted(bound)}


def step_summary(before: dict, after: dict) -> dict:
    """The steps run between two step_histogram() reads: per kind, their count, the bucket bounds
    their p50 and p99 fall in, and how many took over 50 ms."""
    summary = {}
    for kind in STEP_KINDS:
        b = dict(before.get(kind, []))
        cum = [(le, n - b.get(le, 0.0)) for le, n in after.get(kind, [])]
        total = cum[-1][1] if cum else 0.0

        def bound_ms(q: float, cum=cum, total=total) -> float | None:  # None: past the last finite bound
            le = next((le for le, n in cum if n >= q * total), float("inf"))
            return None if le == float("inf") else 1e3 * le

        over = total - next((n for le, n in cum if le >= 0.05), total)
        summary[kind] = dict(steps=total, p50_le_ms=bound_ms(0.5), p99_le_ms=bound_ms(0.99), over_50ms=over)
    b, a = dict(before.get("counters", [])), dict(after.get("counters", []))
    summary["prompt_tokens"] = a.get("pie_step_prompt_tokens_total", 0.0) - b.get("pie_step_prompt_tokens_total", 0.0)
    summary["unbounded"] = a.get("pie_steps_unbounded_total", 0.0) - b.get("pie_steps_unbounded_total", 0.0)
    summary["bound"] = dict(after.get("bound", []))  # as learnt by the level's end
    return summary


def print_steps(s: dict) -> None:
    def le(ms: float | None) -> str:
        return "over 2.5 s" if ms is None else f"<= {ms:g} ms"

    parts = [f"{label} {s[kind]['steps']:,.0f} (p50 {le(s[kind]['p50_le_ms'])}, p99 {le(s[kind]['p99_le_ms'])}, "
             f"{s[kind]['over_50ms']:,.0f} over 50 ms)"
             for kind, label in STEP_KINDS.items() if s[kind]["steps"]]
    prompt_steps = s["prompt"]["steps"]
    if prompt_steps:  # what the stall bound let through
        parts.append(f"{s.get('prompt_tokens', 0) / prompt_steps:,.0f} prompt tokens per such step; "
                     f"{s.get('unbounded', 0):,.0f} steps beside decodes with no stall bound yet")
    bound = s.get("bound", {})
    if bound.get("prompt_token_seconds"):  # the line it bounds prompt tokens by, at the level's end
        parts.append(f"the bound's line {1e3 * bound.get('fixed_seconds', 0.0):.1f} ms + "
                     f"{1e6 * bound['prompt_token_seconds']:.1f} us a prompt token, decode steps "
                     f"{bound.get('decode_ratio', 1.0):.2f}x its model")
    print("        server steps: " + "; ".join(parts or ["none timed"]), flush=True)


def print_row(r: dict) -> None:
    print(f"{r['mode']:7s} load {r['load']:>6g}: {r['requests']} req ({r['errors']} errors) in {r['wall_s']:.1f} s, "
          f"{r['tok_per_s']:,.0f} tok/s; TTFT p50/p90/p99 {r['ttft_p50_ms']:.0f}/{r['ttft_p90_ms']:.0f}/"
          f"{r['ttft_p99_ms']:.0f} ms; TPOT p50/p99 {r['tpot_p50_ms']:.1f}/{r['tpot_p99_ms']:.1f} ms; "
          f"ITL p50/p90/p99 {r['itl_p50_ms']:.1f}/{r['itl_p90_ms']:.1f}/{r['itl_p99_ms']:.1f} ms "
          f"(p99/p50 {r['itl_p99_ms'] / r['itl_p50_ms']:.1f}); e2e p50/p99 {r['e2e_p50_ms']:.0f}/"
          f"{r['e2e_p99_ms']:.0f} ms; goodput {r['goodput_req_per_s']:.2f} req/s ({100 * r['slo_met']:.0f}% "
          f"within TTFT {r['slo_ttft_ms']:.0f} ms, TPOT {r['slo_tpot_ms']:.0f} ms)", flush=True)


if __name__ == "__main__":
    sys.exit(main())
