"""The engine process never outlives its server, in any phase: SIGKILL the server while the engine
process is still importing, while it is starting (model loaded, start stalled), and while it
serves; no process of the server may remain a second later. SIGTERM while loading stops the
server promptly too, with the engine in a process and on a thread."""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import pytest
from grpc_health.v1 import health_pb2

from pie_client import Client
from tests.helpers import make_hf_model_dir, wait_until
from tests.service.processes import ServerProcess, alive, readiness

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc (Linux)")]

STALL_SERVER = Path(__file__).with_name("stall_server.py")
GONE_WITHIN_S = 1.0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_hf_model_dir(tmp_path_factory.mktemp("lifetime"), "llama")


def _args(model_dir, *extra: str) -> list[str]:
    return ["--model", str(model_dir), "--port", "0", "--device", "cpu", "--kv-cache-dtype", "fp32",
            "--num-kv-blocks", "32", *extra]


def _stall_server(model_dir, marker: Path, *extra: str) -> ServerProcess:
    """A server whose engine start stalls for a minute after writing `marker` (its pid)."""
    return ServerProcess(_args(model_dir, *extra), script=STALL_SERVER, script_args=[str(marker)])


def _engine_pid(server: ServerProcess) -> int:
    return wait_until(lambda: (server.event("engine_process_started") or {}).get("pid"), timeout=60,
                      what="the engine process to start")


def _kill_and_check(server: ServerProcess, engine_pid: int) -> None:
    assert alive(engine_pid), "the engine process was not running when its server was killed"
    server.proc.send_signal(signal.SIGKILL)
    server.proc.wait(10)
    killed_at = time.monotonic()
    while alive(engine_pid) and time.monotonic() - killed_at < GONE_WITHIN_S:
        time.sleep(0.01)
    assert not alive(engine_pid), f"engine process {engine_pid} outlived its killed server by {GONE_WITHIN_S} s"


def test_sigkill_while_the_engine_process_imports(model_dir):
    server = ServerProcess(_args(model_dir, "--engine-process"))
    try:
        pid = _engine_pid(server)  # logged right after the spawn: the child is still importing
        _kill_and_check(server, pid)
        assert server.event("engine_process_ready") is None
    finally:
        server.finish()


def test_sigkill_while_the_engine_process_starts(model_dir, tmp_path):
    marker = tmp_path / "stalled"
    server = _stall_server(model_dir, marker, "--engine-process")
    try:
        pid = _engine_pid(server)
        wait_until(marker.exists, timeout=60, what="the engine start to stall")
        assert int(marker.read_text()) == pid
        _kill_and_check(server, pid)
    finally:
        server.finish()


def test_sigkill_while_serving(model_dir):
    server = ServerProcess(_args(model_dir, "--engine-process"))
    try:
        pid = _engine_pid(server)
        port = wait_until(lambda: (server.event("server_listening") or {}).get("port"), timeout=60,
                          what="the server to listen")
        address = f"127.0.0.1:{port}"
        wait_until(lambda: readiness(address) == health_pb2.HealthCheckResponse.SERVING, timeout=60,
                   what="readiness")
        with Client(address, timeout=60) as c:
            stream = c.stream("once upon a time", max_tokens=400, ignore_eos=True)
            next(stream)  # the engine is mid-generation
            _kill_and_check(server, pid)
    finally:
        server.finish()


@pytest.mark.parametrize("engine", ["process", "thread"])
def test_sigterm_while_loading_stops_promptly(model_dir, tmp_path, engine):
    marker = tmp_path / "stalled"
    server = _stall_server(model_dir, marker, "--engine-process" if engine == "process" else "--no-engine-process")
    try:
        wait_until(marker.exists, timeout=60, what="the engine start to stall")
        server.proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        code = server.proc.wait(timeout=10)
        took = time.monotonic() - t0
        assert code == 0, code
        assert took < 5.0, f"the server took {took:.1f} s to stop while loading"
        server.finish()
        assert server.event("server_stopping_while_loading") is not None
        if engine == "process":
            assert not alive(int(marker.read_text())), "the starting engine process was left running"
    finally:
        server.finish()
