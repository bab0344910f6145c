"""`pie serve` as a real process: readiness, SIGTERM drain with zero lost responses, clean exit."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pie_client import Client, Unavailable
from service.servicer import SERVICE_NAME
from tests.helpers import make_hf_model_dir, wait_until


class ServerProcess:
    def __init__(self, args: list[str]):
        self.proc = subprocess.Popen([sys.executable, "-m", "service.cli", "serve", *args, "--log-format", "json"],
                                     stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.events: list[dict] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for line in self.proc.stderr:
            try:
                self.events.append(json.loads(line))
            except json.JSONDecodeError:
                self.events.append({"event": "raw", "line": line})

    def event(self, name: str) -> dict | None:
        return next((e for e in self.events if e.get("event") == name), None)


def _engine_children(pid: int) -> list[int]:
    """Ids of pid's engine processes (Linux /proc)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent = int(f.read().rsplit(")", 1)[1].split()[1])
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    cmd = f.read().decode(errors="replace")
            except (OSError, ValueError, IndexError):
                continue
            if parent == pid and "engine.engine_child" in cmd:
                out.append(int(entry))
    return out


def readiness(address: str) -> int:
    with grpc.insecure_channel(address) as ch:
        try:
            return health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=5).status
        except grpc.RpcError:
            return -1


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["thread", "process"])
def test_sigterm_drains_in_flight_then_exits(tmp_path, engine):
    """SIGTERM to the server (and, with --engine-process, to its whole process group, as a
    supervisor may send it): in-flight streams finish, new requests are refused, exit 0."""
    model_dir = make_hf_model_dir(tmp_path, "llama")
    server = ServerProcess(["--model", str(model_dir), "--port", "0", "--kv-cache-dtype", "int8", "--grace", "30",
                            "--num-kv-blocks", "64", "--engine-process" if engine == "process" else "--no-engine-process"])
    try:
        port = wait_until(lambda: (server.event("server_listening") or {}).get("port"), what="server to listen", timeout=60)
        address = f"127.0.0.1:{port}"
        wait_until(lambda: readiness(address) == health_pb2.HealthCheckResponse.SERVING, what="readiness", timeout=60)
        with Client(address, timeout=120) as client:
            streams = [client.stream("once upon a time", max_tokens=400, ignore_eos=True, seed=i, temperature=1.0)
                       for i in range(4)]
            for s in streams:
                next(s)  # every stream is in flight
            if engine == "process":
                children = _engine_children(server.proc.pid)
                assert len(children) == 1, children
                os.kill(children[0], signal.SIGTERM)  # the engine process ignores it: the server drains
            server.proc.send_signal(signal.SIGTERM)
            wait_until(lambda: readiness(address) == health_pb2.HealthCheckResponse.NOT_SERVING,
                       what="readiness off after SIGTERM")
            with pytest.raises(Unavailable):
                client.generate("new request", max_tokens=2)
            finals = [list(s)[-1] for s in streams]  # zero lost responses: each stream runs to its end
            assert all(f.finish_reason == "length" and f.usage.completion_tokens == 400 for f in finals)
        assert server.proc.wait(timeout=60) == 0
        server._reader.join(10)
        assert server.event("server_draining")["in_flight"] >= 1, "SIGTERM landed while streams were running"
        assert server.event("server_stopped") is not None
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
            server.proc.wait()
