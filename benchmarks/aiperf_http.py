"""The HTTP door under aiperf (NVIDIA's serving benchmark, the load tool users run against
OpenAI-compatible servers): closed-loop levels of concurrency, streaming chat completions (plain
completions for a model without a chat template, --endpoint) with synthetic prompts of --isl
tokens and exactly --osl tokens out (ignore_eos), one aiperf run per level; TTFT and ITL
percentiles, output tokens/s and requests/s as aiperf reports them, and pie's own count of the
tokens it generated over each run (its /metrics, which aiperf scrapes) beside aiperf's. The gRPC
door has its own benchmark (benchmarks/serving.py): aiperf does not speak pie's proto.

    bash benchmarks/aiperf_venv.sh      # aiperf 0.13.0 in .venv-aiperf, once (its pins clash with ours)
    python -m benchmarks.aiperf_http [--concurrency 1,4,16] [--isl 128] [--osl 64] [--model DIR] [--out DIR]
    python -m benchmarks.aiperf_http --url http://HOST:PORT     # a server already running

Without --url it starts `pie serve --http-port` here (--model, --server-args) and stops it at the
end. Each level sends --requests-per-level x the concurrency requests (at least --min-requests)
after as many warm-up requests as the concurrency. aiperf's files (JSON, CSV, its log, the server
metrics it scraped) land in --out/c<N>/.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks.common import make_parser
from benchmarks.serving import free_port, start_server
from pie.model.chat_template import read_templates

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_AIPERF = ROOT / ".venv-aiperf" / "bin" / "aiperf"
BUNDLED = ROOT / "model" / "bundled" / "stories-7m"


@dataclass(slots=True)
class Level:
    """One aiperf run at a fixed concurrency, as its profile_export_aiperf.json reports it."""

    concurrency: int
    requests: int  # completed in the profiling phase (warm-up excluded)
    errors: int  # requests aiperf counted as failed
    output_tokens: int  # aiperf's total over the profiling phase (the servers' usage counts)
    server_tokens: int  # pie's vllm:generation_tokens over the same phase, from the /metrics aiperf scraped
    tok_per_s: float  # output tokens/s
    req_per_s: float
    ttft_ms: tuple[float, float]  # time to first token, p50 and p99
    itl_ms: tuple[float, float]  # inter-token latency, p50 and p99
    duration_s: float  # the profiling phase
    wall_s: float  # the whole aiperf process, its start and its reports included


def aiperf_command(aiperf: Path, url: str, model_name: str, tokenizer: str, concurrency: int, requests: int,
                   isl: int, osl: int, out: Path, *, warmup: int, seed: int = 0, endpoint: str = "chat") -> list[str]:
    return [str(aiperf), "profile", "--model", model_name, "--url", url, "--endpoint-type", endpoint, "--streaming",
            "--tokenizer", tokenizer, "--concurrency", str(concurrency), "--request-count", str(requests),
            *(["--warmup-request-count", str(warmup)] if warmup else []),
            "--isl", str(isl), "--isl-stddev", "0", "--osl", str(osl), "--extra-inputs", "ignore_eos:true",
            "--use-server-token-count", "--random-seed", str(seed), "--ui-type", "none", "--artifact-dir", str(out)]


def profile(aiperf: Path, url: str, model_name: str, tokenizer: str, concurrency: int, requests: int,
            isl: int, osl: int, out: Path, *, warmup: int = 0, timeout_s: float = 600, endpoint: str = "chat") -> Level:
    """One aiperf run; raises RuntimeError with the end of its output where it fails or writes no
    report, and the first request error the server answered (aiperf's own last lines do not say)."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = aiperf_command(aiperf, url, model_name, tokenizer, concurrency, requests, isl, osl, out, warmup=warmup,
                         endpoint=endpoint)
    # aiperf 0.13 in Hugging Face's offline mode looks a tokenizer folder up as a cached hub
    # snapshot and fails; out of it, a folder is read as it is (no hub call).
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    started = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env={**env, "COLUMNS": "160"})
    wall = time.perf_counter() - started
    report = out / "profile_export_aiperf.json"
    if done.returncode != 0 or not report.is_file():
        raise RuntimeError(f"aiperf exited {done.returncode}: {(done.stdout + done.stderr)[-3000:]}"
                           f"{first_error(out / 'profile_export.jsonl')}")
    r = json.loads(report.read_text())
    metrics = json.loads((out / "server_metrics_export.json").read_text())["metrics"]
    generated = sum(s["stats"]["total"] for s in metrics["vllm:generation_tokens"]["series"])

    def avg(key: str) -> float:
        return float(r[key]["avg"]) if key in r else 0.0

    return Level(concurrency=concurrency, requests=int(avg("completed_request_count")),
                 errors=int(sum(e.get("count", 0) for e in r.get("error_summary") or [])),
                 output_tokens=int(avg("total_output_tokens")), server_tokens=int(generated),
                 tok_per_s=avg("output_token_throughput"), req_per_s=avg("request_throughput"),
                 ttft_ms=(r["time_to_first_token"]["p50"], r["time_to_first_token"]["p99"]),
                 itl_ms=(r["inter_token_latency"]["p50"], r["inter_token_latency"]["p99"]),
                 duration_s=avg("benchmark_duration"), wall_s=wall)


def first_error(records: Path) -> str:
    """The first failed request's error in aiperf's per-request records, as a line to append ('' if none)."""
    if not records.is_file():
        return ""
    for line in records.read_text().splitlines():
        error = json.loads(line).get("error") if line.strip() else None
        if error:
            return f"\nthe first failed request: {error.get('code')} {error.get('message')}"
    return ""


def endpoint_for(model: str, server_args: list[str]) -> str:
    """aiperf's endpoint for a model served here: chat where there is a chat template (the folder's,
    or --chat-template among the server's flags), else plain completions (pie refuses chat for a
    base model without one, with 400 no_chat_template)."""
    if "--chat-template" in server_args or read_templates(Path(model)):
        return "chat"
    return "completions"


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status, resp.read()
    except OSError:
        return 0, b""


def served_name(url: str) -> str:
    status, body = _get(f"{url}/v1/models")
    if status != 200:
        raise RuntimeError(f"{url}/v1/models answered {status or 'nothing'}")
    return json.loads(body)["data"][0]["id"]


@contextmanager
def serve(model: str, server_args: list[str]) -> Iterator[str]:
    """`pie serve --http-port` in a child process until the block ends (serving.start_server: ready
    once its gRPC readiness says so, by which time the HTTP door, bound first, serves too); yields
    the HTTP door's URL."""
    port = free_port()
    proc, _ = start_server(model, ["--http-port", str(port), *server_args])
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def table(levels: list[Level]) -> str:
    lines = ["| concurrency | requests | output tok/s | req/s | TTFT p50 / p99 ms | ITL p50 / p99 ms | "
             "tokens aiperf / pie | errors |", "|---|---|---|---|---|---|---|---|"]
    for v in levels:
        lines.append(f"| {v.concurrency} | {v.requests} | {v.tok_per_s:,.1f} | {v.req_per_s:.2f} | "
                     f"{v.ttft_ms[0]:,.1f} / {v.ttft_ms[1]:,.1f} | {v.itl_ms[0]:.1f} / {v.itl_ms[1]:.1f} | "
                     f"{v.output_tokens:,} / {v.server_tokens:,} | {v.errors} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = make_parser(__doc__)
    ap.add_argument("--url", default=None, help="a running server's HTTP door (default: start `pie serve` here)")
    ap.add_argument("--model", default=str(BUNDLED), help="model folder the started server serves")
    ap.add_argument("--tokenizer", default=None, help="tokenizer folder aiperf counts with (default: --model)")
    ap.add_argument("--server-args", default="", help="extra `pie serve` flags, one string (default: none)")
    ap.add_argument("--concurrency", default="1,4,16", help="closed-loop levels, comma-separated")
    ap.add_argument("--requests-per-level", type=int, default=4, help="requests per level, times its concurrency")
    ap.add_argument("--min-requests", type=int, default=16, help="requests per level at least")
    ap.add_argument("--isl", type=int, default=128, help="prompt tokens (synthetic, aiperf's corpus)")
    ap.add_argument("--osl", type=int, default=64, help="output tokens per request (ignore_eos)")
    ap.add_argument("--aiperf", default=str(DEFAULT_AIPERF), help="the aiperf executable")
    ap.add_argument("--out", default=None, help="folder for aiperf's files and levels.json (default: a temporary one)")
    ap.add_argument("--endpoint", choices=("auto", "chat", "completions"), default="auto",
                    help="aiperf's endpoint type (default: auto, chat where the served model has a chat template, "
                         "else completions; chat with --url)")
    args = ap.parse_args(argv)
    aiperf = Path(args.aiperf)
    if not aiperf.is_file():
        ap.exit(2, f"{aiperf} not found: make it with `bash benchmarks/aiperf_venv.sh`\n")
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="aiperf-"))
    tokenizer = str(Path(args.tokenizer or args.model).resolve())
    endpoint = args.endpoint
    if endpoint == "auto":
        endpoint = "chat" if args.url else endpoint_for(args.model, args.server_args.split())
    with serve(args.model, args.server_args.split()) if args.url is None else _given(args.url) as url:
        name = served_name(url)
        levels = []
        for c in (int(x) for x in args.concurrency.split(",")):
            n = max(args.min_requests, args.requests_per_level * c)
            levels.append(profile(aiperf, url, name, tokenizer, c, n, args.isl, args.osl, out / f"c{c}", warmup=c,
                                  endpoint=endpoint))
            sys.stdout.write(table(levels[-1:]).splitlines()[-1] + "\n")
    (out / "levels.json").write_text(json.dumps([asdict(v) for v in levels], indent=1))
    sys.stdout.write(f"{name} via {url} ({endpoint}), isl {args.isl}, osl {args.osl}; aiperf's files in {out}\n{table(levels)}\n")
    return 0


@contextmanager
def _given(url: str) -> Iterator[str]:
    yield url.rstrip("/")


if __name__ == "__main__":
    sys.exit(main())
