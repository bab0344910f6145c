"""`pie serve` as a real process: readiness, SIGTERM drain with zero lost responses, clean exit."""

from __future__ import annotations

import os
import signal

import pytest
from grpc_health.v1 import health_pb2

from pie_client import Client, Unavailable
from tests.helpers import make_hf_model_dir, wait_until
from tests.service.processes import ServerProcess, engine_children, readiness


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
