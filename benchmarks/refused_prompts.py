"""What refusing long prompts costs the gRPC process: bursts of concurrent 1M-character prompts that
are refused for length, against a running `pie serve`; prints the server's RSS and CPU time after
each burst and the wall time of the burst.

    pie serve --port 50061 &                                  # the bundled model (512-token context)
    python benchmarks/refused_prompts.py --address 127.0.0.1:50061 --pid $(pgrep -f 'port 50061' | head -1)

Linux only (reads /proc/PID). The figures are in RESULTS.md ("Refused prompts").
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

import grpc

_ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(_ROOT), str(_ROOT / "clients")]  # benchmarks.*, and this checkout's pie
from benchmarks.common import make_parser  # noqa: E402
from pie.v1 import generate_pb2 as pb  # noqa: E402
from pie.v1 import generate_pb2_grpc as pb_grpc  # noqa: E402


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS:"))


def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main(argv: list[str] | None = None) -> None:
    p = make_parser(__doc__)
    p.add_argument("--address", default="127.0.0.1:50051", help="the server to load")
    p.add_argument("--pid", type=int, required=True,
                   help="the server process's id, whose RSS and CPU time are read (default: none, it must be given)")
    p.add_argument("--bursts", type=int, default=4, help="bursts sent one after another")
    p.add_argument("--concurrency", type=int, default=16, help="prompts sent at once in each burst")
    p.add_argument("--chars", type=int, default=999_999, help="characters of each prompt")
    args = p.parse_args(argv)
    prompt = ("once upon a time " * (args.chars // 17 + 1))[:args.chars]
    with grpc.insecure_channel(args.address, options=[("grpc.max_send_message_length", 64 << 20)]) as ch:
        stub = pb_grpc.GenerateServiceStub(ch)
        print(f"before: RSS {rss_mb(args.pid):.0f} MB")
        for burst in range(args.bursts):
            codes: list[str] = []

            def one() -> None:
                try:
                    stub.Generate(pb.GenerateRequest(prompt=prompt, sampling=pb.SamplingParams(max_tokens=4)),
                                  timeout=300)
                    codes.append("OK")
                except grpc.RpcError as e:
                    codes.append(f"{e.code().name}: {e.details()[:60]}")

            cpu0, t0 = cpu_s(args.pid), time.perf_counter()
            threads = [threading.Thread(target=one) for _ in range(args.concurrency)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            wall = time.perf_counter() - t0
            print(f"burst {burst}: {args.concurrency} x {args.chars} chars in {wall:.2f} s, server CPU "
                  f"{cpu_s(args.pid) - cpu0:.2f} s, RSS {rss_mb(args.pid):.0f} MB  ({codes[0]})")


if __name__ == "__main__":
    main()
