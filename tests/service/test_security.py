"""TLS (server and mutual), bearer tokens, and the caps on concurrent RPCs and message size."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pie.engine.config import EngineConfig
from pie.service.auth import read_token_file
from pie.service.serve_config import server_config_from
from pie.service.serve_flags import add_serve_parser
from pie.service.server import BackgroundServer, ServerConfig, TlsConfig
from pie.v1 import generate_pb2 as pb
from pie.v1 import generate_pb2_grpc as pb_grpc
from pie_client import Client, ResourceExhausted, Unauthenticated, Unavailable, cli
from tests.helpers import make_hf_model_dir, wait_until

# slow: every test starts a BackgroundServer, on certificates openssl makes
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_hf_model_dir(tmp_path_factory.mktemp("llama"), "llama")


def engine_config(model_dir) -> EngineConfig:
    return EngineConfig(model=str(model_dir), device="cpu", kv_cache_dtype="fp32", num_kv_blocks=64, max_num_seqs=8)


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Path:
    """A CA, a server certificate for 127.0.0.1/localhost and a client certificate, via the openssl CLI."""
    assert shutil.which("openssl") is not None, "the TLS tests make their certificates with the openssl CLI"
    d = tmp_path_factory.mktemp("certs")
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
             "-subj", "/CN=pie test CA", cwd=d)
    (d / "server.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    (d / "client.ext").write_text("extendedKeyUsage=clientAuth\n")
    for name in ("server", "client"):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
                 "-subj", f"/CN=pie test {name}", cwd=d)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                 "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext", cwd=d)
    return d


def _tls_client(address: str, certs: Path, *, with_cert: bool) -> Client:
    creds = grpc.ssl_channel_credentials(
        root_certificates=(certs / "ca.pem").read_bytes(),
        private_key=(certs / "client.key").read_bytes() if with_cert else None,
        certificate_chain=(certs / "client.pem").read_bytes() if with_cert else None)
    return Client(address, timeout=10, credentials=creds)


def test_tls_server(model_dir, certs, capsys):
    tls = TlsConfig(str(certs / "server.pem"), str(certs / "server.key"))
    with BackgroundServer(ServerConfig(port=0, tls=tls), engine_config(model_dir)) as s:
        with _tls_client(s.address, certs, with_cert=False) as c:
            assert c.generate("hello", max_tokens=2, ignore_eos=True).completion_tokens == 2
        # pie-client checks the server against a CA bundle; the system roots do not know this CA.
        capsys.readouterr()
        assert cli.main(["--address", s.address, "--timeout", "10", "info", "--tls-ca", str(certs / "ca.pem")]) == 0
        assert '"model_type": "llama"' in capsys.readouterr().out
        assert cli.main(["--address", s.address, "--timeout", "5", "--tls", "info"]) == 1
        assert "UNAVAILABLE" in capsys.readouterr().err
        with Client(s.address, timeout=5) as plain, pytest.raises(Unavailable):
            plain.generate("hello", max_tokens=2)  # a plaintext client cannot complete the handshake


def test_mutual_tls_requires_client_certificate(model_dir, certs):
    tls = TlsConfig(str(certs / "server.pem"), str(certs / "server.key"), client_ca=str(certs / "ca.pem"))
    with BackgroundServer(ServerConfig(port=0, tls=tls), engine_config(model_dir)) as s:
        with _tls_client(s.address, certs, with_cert=True) as c:
            assert c.generate("hello", max_tokens=2, ignore_eos=True).completion_tokens == 2
        with _tls_client(s.address, certs, with_cert=False) as c, pytest.raises(Unavailable):
            c.generate("hello", max_tokens=2)  # the server refuses the handshake without a client certificate


def test_bearer_token(model_dir, tmp_path, capsys):
    token_file = tmp_path / "tokens"
    token_file.write_text("# accepted tokens\nfirst-secret\n\nsecond-secret\n")
    tokens = read_token_file(token_file)
    assert tokens == ("first-secret", "second-secret")
    with BackgroundServer(ServerConfig(port=0, auth_tokens=tokens), engine_config(model_dir)) as s:
        for token in tokens:
            with Client(s.address, timeout=10, token=token) as c:
                assert c.generate("hi", max_tokens=2, ignore_eos=True).completion_tokens == 2
                assert [d.text for d in c.stream("hi", max_tokens=2)]
        for metadata in ([], [("authorization", "Bearer wrong")], [("authorization", "first-secret")],
                         [("authorization", "Bearer first-secret-and-more")]):
            with Client(s.address, timeout=10, metadata=metadata) as c:
                with pytest.raises(Unauthenticated) as err:
                    c.generate("hi", max_tokens=2)
                assert err.value.reason == "UNAUTHENTICATED"
                with pytest.raises(Unauthenticated):
                    list(c.stream("hi", max_tokens=2))
                with pytest.raises(Unauthenticated):
                    c.model_info()
        # pie-client reads the token from a file.
        (tmp_path / "mine").write_text("second-secret\n")
        capsys.readouterr()
        assert cli.main(["info", "--address", s.address, "--token-file", str(tmp_path / "mine")]) == 0
        assert cli.main(["info", "--address", s.address]) == 1
        assert "UNAUTHENTICATED" in capsys.readouterr().err
        # Health and reflection stay open without a token.
        with grpc.insecure_channel(s.address) as ch:
            status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
            assert status.status == health_pb2.HealthCheckResponse.SERVING
            from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
            assert "pie.v1.GenerateService" in set(ProtoReflectionDescriptorDatabase(ch).get_services())


def test_max_concurrent_rpcs(model_dir):
    with BackgroundServer(ServerConfig(port=0, max_concurrent_rpcs=2), engine_config(model_dir)) as s, \
            Client(s.address, timeout=60) as c:
        held = [c.stream("a b c", max_tokens=400, ignore_eos=True) for _ in range(2)]
        for h in held:
            next(h)  # both RPCs in progress
        with pytest.raises(ResourceExhausted):
            c.generate("one too many", max_tokens=2)
        for h in held:
            h.close()
        wait_until(lambda: s.pie.engine_client.num_in_flight == 0, what="held streams to end")
        assert wait_until(lambda: _generate_ok(c), what="a slot to free up")


def _generate_ok(c: Client) -> bool:
    try:
        return c.generate("now there is room", max_tokens=2, ignore_eos=True).completion_tokens == 2
    except ResourceExhausted:
        return False


def test_oversize_message_is_resource_exhausted(model_dir):
    with BackgroundServer(ServerConfig(port=0, max_message_bytes=64 << 10), engine_config(model_dir)) as s:
        with grpc.insecure_channel(s.address) as ch:
            stub = pb_grpc.GenerateServiceStub(ch)
            with pytest.raises(grpc.RpcError) as err:
                stub.Generate(pb.GenerateRequest(prompt="x" * (100 << 10)), timeout=10)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            ok = stub.Generate(pb.GenerateRequest(prompt="hello", sampling=pb.SamplingParams(max_tokens=2)), timeout=30)
            assert ok.usage.completion_tokens >= 1


def test_cli_flags_build_the_server_config(certs, tmp_path):
    import argparse

    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="command"))
    tokens = tmp_path / "tokens"
    tokens.write_text("t1\n")
    args = parser.parse_args(["serve", "--tls-cert", str(certs / "server.pem"), "--tls-key", str(certs / "server.key"),
                              "--tls-client-ca", str(certs / "ca.pem"), "--auth-token-file", str(tokens),
                              "--max-concurrent-rpcs", "7", "--step-timeout", "5", "--max-message-bytes", "1000",
                              "--max-prompt-chars", "99"])
    cfg = server_config_from(args)
    assert cfg.host == "127.0.0.1"
    assert cfg.tls.client_ca.endswith("ca.pem") and cfg.auth_tokens == ("t1",)
    assert (cfg.max_concurrent_rpcs, cfg.step_timeout_s, cfg.max_message_bytes, cfg.limits.max_prompt_chars) == \
        (7, 5.0, 1000, 99)
    assert server_config_from(parser.parse_args(["serve", "--step-timeout", "0"])).step_timeout_s is None
    for bad in (["--tls-cert", "x.pem"], ["--tls-client-ca", "ca.pem"], ["--max-concurrent-rpcs", "0"]):
        with pytest.raises(ValueError):
            server_config_from(parser.parse_args(["serve", *bad]))
