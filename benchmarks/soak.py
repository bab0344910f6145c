"""Bounded soak: a pie server on loopback under mixed traffic for --duration seconds, reporting RSS
and KV usage over time. Mixed traffic = unary calls, full streams, streams cancelled part way,
calls cut by short deadlines, and malformed requests. Any status outside the expected set for its
kind, a KV block still held at the end, or a request still in flight at the end is a failure
(exit status 1).

    python -m benchmarks.soak --duration 120 --out soak.json
    python -m benchmarks.soak --model path/to/hf-folder --concurrency 32

The server runs in this process (its own event loop thread) and the clients in another thread, so
the RSS reported is the server's plus the clients' (both steady in a healthy run)."""

from __future__ import annotations

import asyncio
import collections
import json
import os
import random
import sys
import threading
import time
from pathlib import Path

import grpc

from benchmarks.common import make_parser
from pie.engine.config import DEFAULT_MODEL, EngineConfig
from pie.service.logging import configure_logging
from pie.service.server import BackgroundServer, ServerConfig
from pie.v1 import generate_pb2 as pb
from pie.v1 import generate_pb2_grpc as pb_grpc

PROMPTS = ["Once upon a time", "The little dog", "Tom and Lily went to the park", "One day, a bird",
           "The sun was bright and", "She found a box under the bed"]
EXPECTED = {  # kind -> status codes that are a correct answer for it
    "unary": {"OK"}, "stream": {"OK"}, "cancel": {"CANCELLED", "OK"},
    "deadline": {"DEADLINE_EXCEEDED", "OK"}, "bad": {"INVALID_ARGUMENT"},
}
KINDS = (("unary", 0.35), ("stream", 0.25), ("cancel", 0.15), ("deadline", 0.15), ("bad", 0.10))


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _sampling(rng: random.Random) -> pb.SamplingParams:
    return pb.SamplingParams(max_tokens=rng.randrange(8, 64), temperature=rng.choice((0.0, 0.8, 1.0)), top_p=0.95,
                             ignore_eos=rng.random() < 0.5)


def _bad_request(rng: random.Random) -> pb.GenerateStreamRequest:
    return rng.choice([
        pb.GenerateStreamRequest(prompt=""),
        pb.GenerateStreamRequest(prompt="hi", sampling=pb.SamplingParams(temperature=float("nan"))),
        pb.GenerateStreamRequest(prompt="hi", sampling=pb.SamplingParams(top_p=2.0)),
        pb.GenerateStreamRequest(prompt_token_ids=pb.TokenIds(ids=[10**8])),
        pb.GenerateStreamRequest(prompt="hi", sampling=pb.SamplingParams(stop=["x"] * 100)),
    ])


async def _one(stub, rng: random.Random, counts: collections.Counter, failures: list) -> None:
    kind = rng.choices([k for k, _ in KINDS], [w for _, w in KINDS])[0]
    code = "OK"
    try:
        if kind == "bad":
            async for _ in stub.GenerateStream(_bad_request(rng), timeout=30):
                pass
        elif kind == "unary":
            await stub.Generate(pb.GenerateRequest(prompt=rng.choice(PROMPTS), sampling=_sampling(rng)), timeout=60)
        else:
            req = pb.GenerateStreamRequest(prompt=rng.choice(PROMPTS), sampling=_sampling(rng))
            call = stub.GenerateStream(req, timeout=rng.uniform(0.01, 0.3) if kind == "deadline" else 60)
            cut_after = rng.randrange(1, 6)
            n = 0
            async for _ in call:
                n += 1
                if kind == "cancel" and n >= cut_after:
                    call.cancel()
                    code = "CANCELLED"
                    break
    except grpc.aio.AioRpcError as e:
        code = e.code().name
    counts[(kind, code)] += 1
    if code not in EXPECTED[kind]:
        failures.append((kind, code))


async def _traffic(address: str, duration_s: float, concurrency: int, seed: int, counts, failures) -> None:
    rng = random.Random(seed)
    end = time.monotonic() + duration_s
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.GenerateServiceStub(channel)

        async def worker() -> None:
            while time.monotonic() < end:
                await _one(stub, rng, counts, failures)

        await asyncio.gather(*(worker() for _ in range(concurrency)))


def main(argv: list[str] | None = None) -> int:
    p = make_parser(__doc__)
    p.add_argument("--duration", type=float, default=150.0, help="seconds of traffic")
    p.add_argument("--model", default=None, help="Hugging Face-layout model folder (default: the bundled story model)")
    p.add_argument("--device", default="auto", help="the server's device: auto, cpu, cuda or cuda:N")
    p.add_argument("--concurrency", type=int, default=24, help="clients sending at once")
    p.add_argument("--max-num-seqs", type=int, default=16, help="the server's running sequences per step at most")
    p.add_argument("--num-kv-blocks", type=int, default=256, help="the server's KV pool in blocks")
    p.add_argument("--sample-every", type=float, default=10.0, help="seconds between table rows")
    p.add_argument("--seed", type=int, default=0, help="seeds the traffic's choices (kinds, prompts, deadlines)")
    p.add_argument("--out", default=None, help="write the samples and totals as JSON here (default: not written)")
    args = p.parse_args(argv)
    args.model = args.model or DEFAULT_MODEL
    configure_logging(json=True, level="error")  # per-request lines would bury the table

    engine_cfg = EngineConfig(model=args.model, device=args.device, num_kv_blocks=args.num_kv_blocks,
                              max_num_seqs=args.max_num_seqs, max_waiting=4 * args.concurrency)
    server = BackgroundServer(ServerConfig(port=0, grace_s=5), engine_cfg).start()
    counts: collections.Counter = collections.Counter()
    failures: list = []
    samples: list[dict] = []
    total_blocks = server.pie.engine_client.stats().kv_blocks_total
    t0 = time.monotonic()
    traffic = threading.Thread(target=lambda: asyncio.run(
        _traffic(server.address, args.duration, args.concurrency, args.seed, counts, failures)), daemon=True)

    def sample() -> dict:
        stats = server.pie.engine_client.stats()
        row = dict(t_s=round(time.monotonic() - t0, 1), rss_mib=round(rss_mib(), 1),
                   kv_used=stats.kv_blocks_total - stats.kv_blocks_free, kv_total=stats.kv_blocks_total,
                   running=stats.requests_running, waiting=stats.requests_waiting,
                   in_flight=server.pie.engine_client.num_in_flight, requests_done=sum(counts.values()))
        samples.append(row)
        return row

    header = f"{'t_s':>7} {'rss_mib':>8} {'kv_used':>8} {'running':>8} {'waiting':>8} {'done':>8}"
    print(header)
    max_kv_used = 0
    traffic.start()
    next_row = 0.0
    while traffic.is_alive():
        traffic.join(0.25)
        max_kv_used = max(max_kv_used, total_blocks - server.pie.engine_client.stats().kv_blocks_free)
        if time.monotonic() - t0 >= next_row:
            r = sample()
            print(f"{r['t_s']:>7} {r['rss_mib']:>8} {r['kv_used']:>8} {r['running']:>8} {r['waiting']:>8} "
                  f"{r['requests_done']:>8}", flush=True)
            next_row += args.sample_every
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and (server.pie.engine_client.num_in_flight
                                           or server.pie.engine_client.stats().kv_blocks_free != total_blocks):
        time.sleep(0.05)
    end = sample()
    print(f"{'end':>7} {end['rss_mib']:>8} {end['kv_used']:>8} {end['running']:>8} {end['waiting']:>8} "
          f"{end['requests_done']:>8}")
    server.stop()
    leaked = end["kv_used"] != 0 or end["in_flight"] != 0
    by_kind = collections.Counter()
    for (kind, code), n in counts.items():
        by_kind[f"{kind}:{code}"] += n
    summary = dict(duration_s=args.duration, model=args.model, concurrency=args.concurrency,
                   rss_start_mib=samples[0]["rss_mib"], rss_end_mib=end["rss_mib"],
                   rss_max_mib=max(s["rss_mib"] for s in samples), kv_total=total_blocks, kv_max_used=max_kv_used,
                   kv_used_end=end["kv_used"], requests=sum(counts.values()), outcomes=dict(sorted(by_kind.items())),
                   unexpected=len(failures), leaked=leaked)
    print(json.dumps(summary, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(dict(summary=summary, samples=samples), indent=2))
    return 1 if failures or leaked else 0


if __name__ == "__main__":
    sys.exit(main())
