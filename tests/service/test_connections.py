"""Connection settings of `pie serve` (keepalive, max connection age, compression), observed on
the wire: every test talks to the server through a TCP proxy that counts connections and bytes."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import grpc
import pytest

from pie.engine.config import EngineConfig
from pie.service.cli import build_parser
from pie.service.serve_config import server_config_from
from pie.service.server import BackgroundServer, ConnectionConfig, ServerConfig
from pie.v1 import generate_pb2 as pb
from pie.v1 import generate_pb2_grpc as pb_grpc
from pie_client import Client, cli
from tests.helpers import StepGate, make_hf_model_dir

# slow: every test starts a BackgroundServer
pytestmark = pytest.mark.slow


class CountingProxy:
    """Forwards 127.0.0.1:<port> to a server; counts accepted connections and bytes each way."""

    def __init__(self, target: str) -> None:
        host, port = target.rsplit(":", 1)
        self.target = (host, int(port))
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.connections = 0
        self.upstream = 0  # bytes client -> server
        self.downstream = 0  # bytes server -> client
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.target)
            with self._lock:
                self.connections += 1
            threading.Thread(target=self._pipe, args=(client, server, "upstream"), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client, "downstream"), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, direction: str) -> None:
        try:
            while data := src.recv(65536):
                with self._lock:
                    setattr(self, direction, getattr(self, direction) + len(data))
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.listener.close()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_hf_model_dir(tmp_path_factory.mktemp("llama"), "llama")


def _engine(model_dir) -> EngineConfig:
    return EngineConfig(model=str(model_dir), device="cpu", kv_cache_dtype="fp32", num_kv_blocks=64, max_num_seqs=8)


@contextlib.contextmanager
def _serve(model_dir, connection: ConnectionConfig, **kw) -> Iterator[CountingProxy]:
    """A server with these settings, and the proxy in front of it."""
    with BackgroundServer(ServerConfig(port=0, grace_s=1, connection=connection, **kw), _engine(model_dir)) as s:
        proxy = CountingProxy(s.address)
        try:
            yield proxy
        finally:
            proxy.close()


def test_flags_reach_the_grpc_options() -> None:
    args = build_parser().parse_args(
        ["serve", "--keepalive-time", "30", "--keepalive-timeout", "5", "--no-keepalive-permit-without-calls",
         "--keepalive-min-client-interval", "2", "--max-connection-age", "600", "--max-connection-age-grace", "120",
         "--compression", "gzip"])
    config = server_config_from(args).connection
    assert dict(config.options()) == {
        "grpc.keepalive_time_ms": 30000, "grpc.keepalive_timeout_ms": 5000, "grpc.keepalive_permit_without_calls": 0,
        "grpc.http2.min_ping_interval_without_data_ms": 2000, "grpc.http2.max_pings_without_data": 0,
        "grpc.max_connection_age_ms": 600000, "grpc.max_connection_age_grace_ms": 120000}
    assert config.compression_algorithm() == grpc.Compression.Gzip
    defaults = server_config_from(build_parser().parse_args(["serve"])).connection
    assert defaults == ConnectionConfig()
    assert "grpc.max_connection_age_grace_ms" not in dict(defaults.options())  # calls in flight are never cut
    never = server_config_from(build_parser().parse_args(["serve", "--max-connection-age", "0"])).connection
    assert "grpc.max_connection_age_ms" not in dict(never.options())
    with pytest.raises(ValueError, match="--keepalive-time"):
        server_config_from(build_parser().parse_args(["serve", "--keepalive-time", "0"]))


def test_max_connection_age_moves_new_calls_to_a_new_connection_and_lets_streams_finish(model_dir) -> None:
    gate = StepGate()
    with _serve(model_dir, ConnectionConfig(max_connection_age_s=1.0), engine_setup=gate) as proxy:
        with Client(proxy.address, timeout=60) as c:
            c.tokenize("hello")
            assert proxy.connections == 1
            gate.hold()
            gate.allow(2)
            stream = c.stream("the cat", max_tokens=8, ignore_eos=True, temperature=0)
            first = next(stream)
            time.sleep(1.5)  # the connection passes its age while the stream is open
            c.tokenize("hello")  # a new call: on a new connection
            assert proxy.connections == 2
            gate.release()
            rest = list(stream)  # the stream that was in flight finishes on the old one
            assert rest[-1].finish_reason == "length"
            assert sum(len(d.token_ids) for d in [first, *rest]) == 8


@pytest.mark.parametrize("server_accepts_every_s, connections", [(0.5, 1), (60.0, 2)])
def test_client_keepalive_pings_are_accepted_down_to_the_set_interval(model_dir, server_accepts_every_s,
                                                                       connections) -> None:
    """A client pinging every second while idle keeps its connection when the server accepts pings
    that often; with a longer minimum the server answers GOAWAY (too_many_pings) and the next call
    needs a new connection (the control, which shows the test can fail)."""
    config = ConnectionConfig(min_client_ping_interval_s=server_accepts_every_s)
    with _serve(model_dir, config) as proxy:
        options = [("grpc.keepalive_time_ms", 1000), ("grpc.keepalive_permit_without_calls", 1),
                   ("grpc.http2.max_pings_without_data", 0)]
        with Client(proxy.address, timeout=30, options=options) as c:
            c.tokenize("hello")
            time.sleep(4.5)  # four idle pings
            c.tokenize("hello")
            assert proxy.connections == connections


def test_gzip_requests_accepted_and_responses_compressed_when_asked(model_dir) -> None:
    text = "once upon a time " * 2000  # compresses ~50x
    sizes = {}
    for compression in ("none", "gzip"):
        with _serve(model_dir, ConnectionConfig(compression=compression)) as proxy:
            for client_gzip in (False, True):
                before = proxy.upstream, proxy.downstream
                with grpc.insecure_channel(proxy.address, compression=grpc.Compression.Gzip if client_gzip
                                           else grpc.Compression.NoCompression) as ch:
                    out = pb_grpc.GenerateServiceStub(ch).Tokenize(pb.TokenizeRequest(text=text), timeout=30)
                assert out.count > 4000
                sizes[compression, client_gzip] = (proxy.upstream - before[0], proxy.downstream - before[1])
    # requests: the client's gzip shrinks them, whatever the server answers with
    assert sizes["none", True][0] * 5 < sizes["none", False][0]
    # responses: compressed only by a server started with --compression gzip
    assert sizes["gzip", False][1] * 5 < sizes["none", False][1]
    # the bundled client's compression="gzip" works end to end
    with _serve(model_dir, ConnectionConfig()) as proxy:
        with Client(proxy.address, timeout=30, compression="gzip") as c:
            assert len(c.tokenize(text).token_ids) > 4000
            assert c.generate("hello", max_tokens=2, ignore_eos=True).completion_tokens == 2
        assert proxy.upstream < len(text) / 5
        sent = proxy.upstream
        assert cli.main(["--address", proxy.address, "--gzip", "tokenize", text]) == 0  # pie-client --gzip
        assert proxy.upstream - sent < len(text) / 5
