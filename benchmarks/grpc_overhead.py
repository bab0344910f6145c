"""What the serving path costs by itself: the gRPC server with the model's forward pass replaced by
an instant (or fixed-time) sampler, loaded by `benchmarks/serving.py` from another process.

    python benchmarks/grpc_overhead.py --concurrency 16,64,256 --step-ms 4

Everything else is the real server: the engine thread (scheduler, block manager, detokenizer,
stop checks), the hand-off to asyncio, the servicer, metrics, protobuf and grpc.aio. `--step-ms`
sleeps that long in each step with the GIL released, as a step waiting for a GPU would. The
engine's step rate is printed next to what the clients received. `--engine-process` runs the
engine in its own process (`pie serve --engine-process`).
"""

from __future__ import annotations

import functools
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "clients")]  # benchmarks.*, and this checkout's pie
from benchmarks.common import make_parser  # noqa: E402
from pie.engine.config import EngineConfig  # noqa: E402
from pie.engine.messages import SampledToken  # noqa: E402
from pie.engine.scheduling.step import StepOutput  # noqa: E402
from pie.service.server import BackgroundServer, ServerConfig  # noqa: E402


def instant_forward(engine, step_s: float = 0.0) -> None:
    """Replaces the engine's forward pass and sampling: every sampling row gets the token " the"
    after `step_s` seconds with the GIL released (module-level, so an engine process can unpickle
    it through functools.partial)."""
    token = engine.tokenizer.encode(" the")[-1]

    class Sampled:
        def __init__(self, requests) -> None:
            self.requests = requests

        done = None  # no device event: the host's clock times the step
        speculative = False

        def result(self) -> StepOutput:
            return StepOutput(self.requests, [[SampledToken(token, 0.0, [])] for _ in self.requests])

    def launch(out):
        if step_s:
            time.sleep(step_s)
        return Sampled(out.sampling_requests)

    engine.runner.launch = launch


def main(argv: list[str] | None = None) -> int:
    ap = make_parser(__doc__)
    ap.add_argument("--concurrency", default="16,64,256", help="closed-loop levels (streams), comma-separated")
    ap.add_argument("--step-ms", type=float, default=0.0, help="time each step waits with the GIL released")
    ap.add_argument("--max-tokens", type=int, default=128, help="tokens generated per request")
    ap.add_argument("--requests", type=int, default=0,
                    help="requests per level (default: serving.py's, 4 x the concurrency and at least 16)")
    ap.add_argument("--engine-process", action="store_true", help="the engine in its own process")
    ap.add_argument("--stream-interval", type=int, default=1, help="tokens per stream message after the first")
    args = ap.parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",")]
    server = BackgroundServer(
        ServerConfig(port=0, engine_process=args.engine_process, stream_interval=args.stream_interval,
                     engine_setup=functools.partial(instant_forward, step_s=args.step_ms / 1e3)),
        EngineConfig(device="cpu", max_num_seqs=max(levels), max_waiting=4 * max(levels),
                     num_kv_blocks=max(levels) * 16))
    server.start()
    aeng = server.pie.engine_client
    mode = ("engine process" if args.engine_process else "engine thread") + f", stream interval {args.stream_interval}"
    print(f"# serving path alone ({mode}): bundled model's tokenizer, forward replaced, {args.step_ms} ms per step")
    try:
        for c in levels:
            s0, w0 = aeng.steps, time.perf_counter()
            cmd = [sys.executable, str(ROOT / "benchmarks" / "serving.py"), "--address", server.address,
                   "--concurrency", str(c), "--max-tokens", str(args.max_tokens), "--vocab", "2000"]
            if args.requests:
                cmd += ["--requests", str(args.requests)]
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
            wall = time.perf_counter() - w0
            line = next((ln for ln in res.stdout.splitlines() if ln.startswith("closed")), res.stderr[-500:])
            print(line)
            print(f"    engine: {(aeng.steps - s0) / wall:,.0f} steps/s over the level (client start-up included)")
    finally:
        server.stop(1.0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
