"""`pie serve` (or a test script that wraps it) as a real process, for tests of signals, exits and
the engine process's lifetime. Linux only (/proc)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pie.service.servicer import SERVICE_NAME

ROOT = Path(__file__).resolve().parents[2]


class ServerProcess:
    """Runs `python -m service.cli serve ARGS` (or `python SCRIPT SCRIPT_ARGS serve ARGS`) with JSON
    logs, and keeps every log line it writes."""

    def __init__(self, args: list[str], *, script: Path | None = None, script_args: list[str] = ()):
        head = ([sys.executable, str(script), *script_args] if script is not None
                else [sys.executable, "-m", "pie.service.cli"])
        self.proc = subprocess.Popen(
            [*head, "serve", *args, "--log-format", "json"], stderr=subprocess.PIPE, text=True, cwd=ROOT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'clients'}"})
        self.events: list[dict] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            try:
                self.events.append(json.loads(line))
            except json.JSONDecodeError:
                self.events.append({"event": "raw", "line": line})

    def event(self, name: str) -> dict | None:
        return next((e for e in list(self.events) if e.get("event") == name), None)

    def finish(self, timeout: float = 10.0) -> None:
        """Kills the server if it still runs and collects the rest of its log."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout)
        self._reader.join(timeout)


def alive(pid: int) -> bool:
    """The process exists and is not a zombie (a zombie holds no memory and runs nothing)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def engine_children(pid: int, marker: str = "pie.engine.core.child_process") -> list[int]:
    """Ids of pid's engine processes (or of its children whose command line holds `marker`)."""
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
            if parent == pid and marker in cmd:
                out.append(int(entry))
    return out


def readiness(address: str) -> int:
    with grpc.insecure_channel(address) as ch:
        try:
            return health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=5).status
        except grpc.RpcError:
            return -1
