"""What the HTTP door costs against the gRPC door: the same closed-loop work over each, on one
server, alternating round after round.

    python benchmarks/http_overhead.py --rounds 3 --out http_overhead.json
    python benchmarks/http_overhead.py --tiny                 # the smoke run (tests/benchmarks)

One `pie serve` subprocess (the bundled model unless --model; the engine in its own process, as by
default) with both doors on free ports, --port and --http-port. Prefix caching is off
(--server-args' default), so the door that runs second in a round computes its prompts as the
first did instead of finding them cached. Each round runs the work over every door in turn, the
order rotating from round to round (gRPC first in rounds 1, 3, ...), after one check request.

The work: --streams closed-loop streams, each sending its next request when the previous one ends,
--requests-per-stream requests each; prompts of --prompt-len random token ids (serving.py's fixed
workload: the same prompts on every door and round), --max-tokens generated each with ignore_eos
(so exactly that many: checked), temperature 0.8, request i seeded with --seed + i.

The doors' clients:
  gRPC  the bundled asyncio client, pie_client.AsyncClient.stream, one channel for all streams.
  HTTP  streaming POST /v1/completions (server-sent events; ignore_eos and stream_options
        include_usage in the body) read by a minimal client over asyncio streams: HTTP/1.1, one
        keep-alive connection per stream (as a pooled client keeps them), the chunked transfer
        coding and the `data:` lines, one json.loads per event. The load generator shares the
        machine's cores with the server, so a heavy client would be counted against its door;
        this one spends less CPU per token than the gRPC client (the client CPU column).
  HTTP (openai)  (--http-clients raw,openai) the same requests through the openai package's
        AsyncOpenAI (in the test extra; ignore_eos via extra_body): httpx, a pydantic model per
        chunk. What a caller with the SDK sees.

Check: each round starts with one request alone on every door (a text prompt, seeded); the doors
must return the same text, or the script stops with both texts and exit status 1. Under load the
texts usually agree as well (printed, not required: a seeded request's tokens may part where the
batch it runs in differs).

Per door and round: output tokens/s (all tokens over the wall time of the round's work), TTFT
(request sent -> first token, client-measured) p50/p99, ITL p50/p99, tokens per stream message,
and CPU time per 1,000 tokens of the server's front process (gRPC, HTTP, the engine client), of its
engine process, and of this load generator. ITL: a message's gap split over its tokens; the HTTP
chunks do not say how many tokens each holds, so where a request's chunks are fewer than its
tokens (coalesced outputs) its gaps are split by the request's mean tokens per chunk. The table
gives medians over the rounds with their range (min-max), and HTTP / gRPC as the ratio of the
medians with the range of the rounds' own ratios.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import statistics
import sys
import time
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "clients")]  # benchmarks.*, and this checkout's pie
from benchmarks.common import SizedFlags, make_parser  # noqa: E402
from benchmarks.serving import Work, free_port, percentile, start_server, workload  # noqa: E402
from pie_client import AsyncClient  # noqa: E402

TEMPERATURE = 0.8
NAN = float("nan")
CHECK_PROMPT = "Once upon a time, there was a little girl named Lily. She"


@dataclass(slots=True)
class Stream:
    """What the client saw of one request."""

    sent: float  # perf_counter when the request went out
    arrivals: list[float] = field(default_factory=list)  # each stream message that carried tokens
    counts: list[int] | None = field(default_factory=list)  # tokens per message; None where the door does not say
    text: str = ""
    tokens: int = 0  # as the final usage says

    def itl(self) -> list[float]:
        """Inter-token latencies: each gap between messages split over the second's tokens."""
        gaps = [b - a for a, b in zip(self.arrivals, self.arrivals[1:])]
        if self.counts is not None:
            return [g / k for g, k in zip(gaps, self.counts[1:]) for _ in range(k)]
        per_chunk = (self.tokens - 1) / max(1, len(gaps))  # 1 unless outputs were coalesced
        return [g / per_chunk for g in gaps]


Send = Callable[[list[int] | str, int, int], Awaitable[Stream]]  # (prompt, max tokens, seed) -> what came back


class GrpcDoor:
    name = "gRPC"

    def __init__(self, address: str) -> None:
        self.client = AsyncClient(address, timeout=600)

    @contextlib.asynccontextmanager
    async def sender(self) -> AsyncIterator[Send]:
        yield self.send  # every stream shares the channel

    async def send(self, prompt: list[int] | str, max_tokens: int, seed: int) -> Stream:
        s = Stream(time.perf_counter())
        assert s.counts is not None
        async for d in self.client.stream(prompt, max_tokens=max_tokens, ignore_eos=True, temperature=TEMPERATURE,
                                          seed=seed):
            now = time.perf_counter()
            if d.token_ids:
                s.arrivals.append(now)
                s.counts.append(len(d.token_ids))
            s.text += d.text
            if d.usage is not None:
                s.tokens = d.usage.completion_tokens
        return s

    async def close(self) -> None:
        await self.client.close()


class HttpConnection:
    """One HTTP/1.1 keep-alive connection: posts JSON, reads the server-sent events back (the
    chunked transfer coding and `data:` lines; the server's own framing, nothing more general)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, host: str) -> None:
        self.reader, self.writer, self.host = reader, writer, host

    async def events(self, path: str, body: dict) -> AsyncIterator[dict]:
        data = json.dumps(body).encode()
        head = (f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n"
                f"Accept: text/event-stream\r\nContent-Length: {len(data)}\r\n\r\n")
        self.writer.write(head.encode() + data)
        await self.writer.drain()
        status = int((await self.reader.readline()).split()[1])
        headers = {}
        while (line := await self.reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        if status != 200:
            text = await self.reader.readexactly(int(headers.get("content-length", "0")))
            raise RuntimeError(f"HTTP {status}: {text.decode(errors='replace')}")
        if headers.get("transfer-encoding") != "chunked":
            raise RuntimeError(f"expected a chunked event stream, got headers {headers}")
        buffer = b""
        while size := int((await self.reader.readline()).split(b";")[0], 16):
            buffer += (await self.reader.readexactly(size + 2))[:-2]  # the chunk and its CRLF
            while (end := buffer.find(b"\n\n")) >= 0:
                event, buffer = buffer[:end], buffer[end + 2:]
                for line in event.split(b"\n"):
                    if line.startswith(b"data: ") and line != b"data: [DONE]":
                        yield json.loads(line[6:])
        await self.reader.readexactly(2)  # the last chunk's CRLF (no trailers)


class HttpDoor:
    name = "HTTP"

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port

    @contextlib.asynccontextmanager
    async def sender(self) -> AsyncIterator[Send]:
        reader, writer = await asyncio.open_connection(self.host, self.port)
        conn = HttpConnection(reader, writer, f"{self.host}:{self.port}")

        async def send(prompt: list[int] | str, max_tokens: int, seed: int) -> Stream:
            body = dict(prompt=prompt, max_tokens=max_tokens, temperature=TEMPERATURE, seed=seed, ignore_eos=True,
                        stream=True, stream_options={"include_usage": True})
            s = Stream(time.perf_counter(), counts=None)
            async for event in conn.events("/v1/completions", body):
                now = time.perf_counter()
                if "error" in event:
                    raise RuntimeError(f"error event: {event['error']}")
                if event["choices"]:
                    s.arrivals.append(now)
                    s.text += event["choices"][0]["text"]
                if event.get("usage"):
                    s.tokens = event["usage"]["completion_tokens"]
            return s

        try:
            yield send
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()

    async def close(self) -> None:
        pass


class OpenAIDoor:
    name = "HTTP (openai)"

    def __init__(self, base_url: str, model: str) -> None:
        import openai  # the test extra's; only this door needs it

        self.api = openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=600)
        self.model = model

    @contextlib.asynccontextmanager
    async def sender(self) -> AsyncIterator[Send]:
        yield self.send  # the client's connection pool serves every stream

    async def send(self, prompt: list[int] | str, max_tokens: int, seed: int) -> Stream:
        s = Stream(time.perf_counter(), counts=None)
        stream = await self.api.completions.create(
            model=self.model, prompt=prompt, max_tokens=max_tokens, temperature=TEMPERATURE, seed=seed, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.choices:
                s.arrivals.append(now)
                s.text += chunk.choices[0].text
            if chunk.usage is not None:
                s.tokens = chunk.usage.completion_tokens
        return s

    async def close(self) -> None:
        await self.api.close()


Door = GrpcDoor | HttpDoor | OpenAIDoor


class CpuClock:
    """CPU seconds (user + system) of the server's front process, of its descendants (the engine
    process and its helpers), and of this one; from /proc (zeros where there is none)."""

    def __init__(self, server_pid: int) -> None:
        self.server = server_pid
        self.engine = self._descendants(server_pid)

    @staticmethod
    def _stat(pid: int) -> list[str]:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()  # the fields after the command's name

    def _descendants(self, root: int) -> list[int]:
        if not os.path.isdir("/proc"):
            return []
        parents: dict[int, list[int]] = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                with contextlib.suppress(OSError):
                    parents.setdefault(int(self._stat(int(entry))[1]), []).append(int(entry))
        out, todo = [], [root]
        while todo:
            kids = parents.get(todo.pop(), [])
            out += kids
            todo += kids
        return out

    def _cpu(self, pid: int) -> float:
        try:
            fields = self._stat(pid)
        except OSError:
            return 0.0
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime

    def read(self) -> dict[str, float]:
        return {"front": self._cpu(self.server), "engine": sum(self._cpu(p) for p in self.engine),
                "client": time.process_time()}


async def run_work(door: Door, work: Work, streams: int, seed: int, clock: CpuClock) -> tuple[list[Stream], dict]:
    """The closed loop over one door: `streams` streams take the requests in order. Returns each
    request's Stream (by index) and the wall time and CPU seconds of the whole."""
    async with contextlib.AsyncExitStack() as stack:
        senders = [await stack.enter_async_context(door.sender()) for _ in range(streams)]  # connected first
        todo = list(range(len(work.prompts)))[::-1]
        results: list[Stream | None] = [None] * len(todo)

        async def worker(send: Send) -> None:
            while todo:
                i = todo.pop()
                results[i] = await send(work.prompts[i], work.max_tokens[i], seed + i)

        cpu0, t0 = clock.read(), time.perf_counter()
        await asyncio.gather(*(worker(send) for send in senders))
        wall, cpu1 = time.perf_counter() - t0, clock.read()
    done = [r for r in results if r is not None]
    return done, {"wall_s": wall, **{f"{k}_cpu_s": cpu1[k] - cpu0[k] for k in cpu0}}


def summarize(door: str, streams: list[Stream], timing: dict, max_tokens: list[int]) -> dict:
    """One door's row of a round; stops the script where a request did not get its max_tokens."""
    for i, (s, want) in enumerate(zip(streams, max_tokens)):
        got = sum(s.counts) if s.counts is not None else s.tokens
        if s.tokens != want or got != want or not s.arrivals:
            sys.exit(f"{door}: request {i} got {s.tokens} tokens (usage) and {got} in its messages, "
                     f"not the {want} asked with ignore_eos")
    tokens = sum(s.tokens for s in streams)
    messages = sum(len(s.arrivals) for s in streams)
    ttft = [s.arrivals[0] - s.sent for s in streams]
    itl = [x for s in streams for x in s.itl()]
    row: dict[str, Any] = dict(door=door, requests=len(streams), tokens=tokens, wall_s=timing["wall_s"],
                               tok_per_s=tokens / timing["wall_s"], tokens_per_message=tokens / messages)
    for name, values in (("ttft", ttft), ("itl", itl)):
        for p in (50, 99):
            row[f"{name}_p{p}_ms"] = 1e3 * percentile(values, p)
    for part in ("front", "engine", "client"):
        row[f"{part}_cpu_ms_per_1k"] = 1e6 * timing[f"{part}_cpu_s"] / tokens
    return row


# The table's columns: (row key, heading, format).
COLUMNS = (("tok_per_s", "tokens/s", "{:,.0f}"), ("ttft_p50_ms", "TTFT p50 ms", "{:.1f}"),
           ("ttft_p99_ms", "TTFT p99 ms", "{:.1f}"), ("itl_p50_ms", "ITL p50 ms", "{:.2f}"),
           ("itl_p99_ms", "ITL p99 ms", "{:.2f}"), ("front_cpu_ms_per_1k", "front CPU ms / 1k tok", "{:.0f}"),
           ("engine_cpu_ms_per_1k", "engine CPU ms / 1k tok", "{:.0f}"),
           ("client_cpu_ms_per_1k", "client CPU ms / 1k tok", "{:.0f}"), ("tokens_per_message", "tok / msg", "{:.2f}"))


def summary(rounds: list[dict], doors: list[str]) -> dict:
    """Per door and column: the median over the rounds and its range; per HTTP door, the ratio
    of its median to gRPC's and the range of the rounds' own ratios."""
    out: dict[str, Any] = {}
    for door in doors:
        out[door] = {}
        for key, _, _ in COLUMNS:
            values = [r["doors"][door][key] for r in rounds]
            out[door][key] = {"median": statistics.median(values), "min": min(values), "max": max(values)}
    base = doors[0]
    for door in doors[1:]:
        ratios = out[f"{door} / {base}"] = {}
        for key, _, _ in COLUMNS:
            per_round = [x for r in rounds if (x := _ratio(r["doors"][door][key], r["doors"][base][key])) == x]
            ratios[key] = {"median": _ratio(out[door][key]["median"], out[base][key]["median"]),
                           "min": min(per_round, default=NAN), "max": max(per_round, default=NAN)}
    return out


def _ratio(a: float, b: float) -> float:
    return a / b if b else NAN  # a CPU time below the clock's tick (a tiny run)


def table(summ: dict) -> str:
    lines = ["| door | " + " | ".join(h for _, h, _ in COLUMNS) + " |", "|---" * (len(COLUMNS) + 1) + "|"]
    for door, cells in summ.items():
        ratio = " / " in door
        text = []
        for key, _, fmt in COLUMNS:
            c = cells[key]
            f = "{:.3f}" if ratio else fmt
            text.append(f"{f.format(c['median'])} ({f.format(c['min'])}-{f.format(c['max'])})")
        lines.append(f"| {door} | " + " | ".join(text) + " |")
    return "\n".join(lines)


async def check(doors: list[Door], max_tokens: int, seed: int) -> str:
    """One seeded request alone on each door: the same text from all, or the script stops."""
    texts = []
    for door in doors:
        async with door.sender() as send:
            texts.append((await send(CHECK_PROMPT, max_tokens, seed)).text)
    if any(t != texts[0] for t in texts):
        shown = "\n".join(f"  {d.name}: {t!r}" for d, t in zip(doors, texts))
        sys.exit(f"the doors returned different text for the same seeded request (seed {seed}):\n{shown}")
    return texts[0]


def wait_http(url: str, proc, timeout_s: float = 120.0) -> str:
    """Waits for the HTTP door's /health; returns the served model's name."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"server exited with {proc.returncode}")
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(f"{url}/v1/models", timeout=2) as r:
                return json.loads(r.read())["data"][0]["id"]
        time.sleep(0.2)
    sys.exit(f"the HTTP door at {url} did not answer within {timeout_s:.0f} s")


async def measure(args, grpc_address: str, http_port: int, model_name: str, clock: CpuClock) -> list[dict]:
    doors: list[Door] = [GrpcDoor(grpc_address)]
    for kind in args.http_clients.split(","):
        doors.append(HttpDoor("127.0.0.1", http_port) if kind == "raw"
                     else OpenAIDoor(f"http://127.0.0.1:{http_port}/v1", model_name))
    work = workload("fixed", args.streams * args.requests_per_stream, args.vocab, prompt_len=args.prompt_len,
                    max_tokens=args.max_tokens)
    warm = Work(work.prompts[:args.streams], [min(16, args.max_tokens)] * args.streams)
    rounds = []
    try:
        for door in doors:  # first connections, first requests of each size: not counted
            await run_work(door, warm, args.streams, args.seed, clock)
        for r in range(args.rounds):
            order = doors[r % len(doors):] + doors[:r % len(doors)]
            load0 = os.getloadavg()
            text = await check(order, args.max_tokens, args.seed + 10_000 + r)
            rows, texts = {}, {}
            for door in order:
                streams, timing = await run_work(door, work, args.streams, args.seed, clock)
                rows[door.name] = summarize(door.name, streams, timing, work.max_tokens)
                texts[door.name] = [s.text for s in streams]
            same = sum(all(texts[d.name][i] == texts[doors[0].name][i] for d in doors) for i in range(len(work.prompts)))
            load1 = os.getloadavg()
            rounds.append(dict(round=r + 1, order=[d.name for d in order], check_text=text, same_text_under_load=same,
                               load_before=load0, load_after=load1, doors=rows))
            print(f"round {r + 1} ({' then '.join(d.name for d in order)}): check request the same on every door; "
                  f"texts the same under load {same}/{len(work.prompts)}; load average {load0[0]:.2f} -> "
                  f"{load1[0]:.2f}; " + "; ".join(f"{d}: {row['tok_per_s']:,.0f} tok/s, TTFT p50 "
                                                   f"{row['ttft_p50_ms']:.1f} ms" for d, row in rows.items()),
                  flush=True)
    finally:
        for door in doors:
            await door.close()
    return rounds


def main(argv: list[str] | None = None) -> int:
    ap = make_parser(__doc__)
    sized = SizedFlags(ap)
    ap.add_argument("--tiny", action="store_true", help="the smoke run (tests/benchmarks): a couple of short requests per door")
    sized.add("--rounds", 3, 2, "rounds; each runs the work over every door")
    sized.add("--streams", 16, 2, "concurrent streams (closed loop)")
    sized.add("--requests-per-stream", 4, 1, "requests each stream sends, one after another")
    sized.add("--max-tokens", 128, 8, "tokens generated per request (ignore_eos: exactly this many)")
    ap.add_argument("--prompt-len", type=int, default=64, help="prompt tokens per request (random ids)")
    ap.add_argument("--vocab", type=int, default=2000, help="prompt ids are drawn from [3, vocab)")
    ap.add_argument("--seed", type=int, default=1, help="request i's sampling seed is seed + i")
    ap.add_argument("--http-clients", default="raw",
                    help="HTTP doors, comma-separated: raw (a minimal asyncio client) and/or openai (AsyncOpenAI)")
    ap.add_argument("--model", help="model folder for the server (default: the bundled model)")
    ap.add_argument("--device", default="cpu", help="the server's --device")
    ap.add_argument("--server-args", default="--no-enable-prefix-caching",
                    help="further `pie serve` flags, one string")
    ap.add_argument("--out", help="JSON file with every round's figures and the summary (default: none written)")
    args = ap.parse_args(argv)
    sized.fill(args, args.tiny)
    kinds = args.http_clients.split(",")
    if not kinds or any(k not in ("raw", "openai") for k in kinds) or len(set(kinds)) != len(kinds):
        ap.error(f"--http-clients: raw and/or openai, got {args.http_clients!r}")
    http_port = free_port()
    proc, address = start_server(args.model, ["--http-port", str(http_port), "--device", args.device,
                                              *args.server_args.split()])
    try:
        model_name = wait_http(f"http://127.0.0.1:{http_port}", proc)
        clock = CpuClock(proc.pid)
        print(f"# HTTP door against gRPC: {model_name} on {args.device}, {args.streams} streams x "
              f"{args.requests_per_stream} requests x {args.max_tokens} tokens, prompts of {args.prompt_len}, "
              f"{args.rounds} rounds; server pid {proc.pid}, engine process(es) {clock.engine}; "
              f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}", flush=True)
        rounds = asyncio.run(measure(args, address, http_port, model_name, clock))
    finally:
        proc.terminate()
        proc.wait(60)
    doors = list(rounds[0]["doors"])
    summ = summary(rounds, ["gRPC", *[d for d in doors if d != "gRPC"]])
    print(f"\nmedians over {len(rounds)} rounds (min-max); ratios: of the medians (the rounds' own ratios' range)")
    print(table(summ))
    if args.out:
        Path(args.out).write_text(json.dumps(dict(config=vars(args), rounds=rounds, summary=summ), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
