"""`pie serve` as a real process: readiness, SIGTERM drain with zero lost responses, clean exit;
and a stream the shutdown cuts after its grace, which is the server's doing, not the caller's."""

from __future__ import annotations

import io
import json
import os
import signal
import time

import pytest
import structlog
from grpc_health.v1 import health_pb2

from pie.engine.config import EngineConfig
from pie.service.logging import configure_logging
from pie.service.server import BackgroundServer, ServerConfig
from pie_client import Client, Unavailable
from tests.helpers import make_hf_model_dir, wait_until
from tests.service.processes import ServerProcess, engine_children, readiness

# slow: every test starts a BackgroundServer or a `pie serve` subprocess
pytestmark = pytest.mark.slow


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
                children = engine_children(server.proc.pid)
                assert len(children) == 1, children
                os.kill(children[0], signal.SIGTERM)  # the engine process ignores it: the server drains
            server.proc.send_signal(signal.SIGTERM)
            wait_until(lambda: readiness(address) == health_pb2.HealthCheckResponse.NOT_SERVING,
                       what="readiness off after SIGTERM")
            with pytest.raises(Unavailable) as err:
                client.generate("new request", max_tokens=2)
            assert err.value.reason == "DRAINING"
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


def _slow_steps(engine) -> None:
    """Each engine step takes 20 ms more, so a 400-token stream outlasts a short grace."""
    launch = engine.runner.launch

    def slowed(out):
        time.sleep(0.02)
        return launch(out)

    engine.runner.launch = slowed


def test_a_stream_cut_after_the_grace_is_the_servers_doing(tmp_path):
    """Past --grace, gRPC cancels what still runs: the caller gets UNAVAILABLE, and the server's
    request_done line and pie_requests_finished say UNAVAILABLE (the shutdown), not CANCELLED."""
    saved = structlog.get_config()
    buf = io.StringIO()
    configure_logging(json=True, stream=buf)
    try:
        cfg = EngineConfig(model=str(make_hf_model_dir(tmp_path, "llama")), device="cpu", kv_cache_dtype="fp32",
                           num_kv_blocks=64, max_num_seqs=4)
        server = BackgroundServer(ServerConfig(port=0, engine_setup=_slow_steps), cfg).start()
        with Client(server.address, timeout=60) as client:
            stream = client.stream("the cat", max_tokens=400, ignore_eos=True, request_id="cut-by-shutdown")
            next(stream)  # in flight
            server.stop(grace_s=0.3)
            with pytest.raises(Unavailable):
                list(stream)
        metrics = server.pie.metrics.registry
        finished = {code: metrics.get_sample_value("pie_requests_finished_total", {
            "model_name": server.pie.servicer.model_name, "rpc": "GenerateStream", "code": code})
            for code in ("UNAVAILABLE", "CANCELLED")}
    finally:
        structlog.configure(**saved)
    lines = [json.loads(line) for line in buf.getvalue().splitlines()]
    done = [e for e in lines if e.get("event") == "request_done" and e.get("request_id") == "cut-by-shutdown"]
    assert len(done) == 1, done
    assert done[0]["status"] == "UNAVAILABLE" and done[0]["level"] == "warning"
    assert done[0]["error"].startswith("server shutting down (DRAINING)")
    assert 0 < done[0]["generated_tokens"] < 400
    assert finished == {"UNAVAILABLE": 1.0, "CANCELLED": None}
    assert any(e.get("event") == "drain_timeout" for e in lines)
