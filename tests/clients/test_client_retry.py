"""The client's retry policy: the service config it hands gRPC, and what gRPC then retries against a
live server that fails on purpose (UNAVAILABLE before answering, after its headers, mid-stream)."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest

import pie_client
from pie.v1 import generate_pb2 as pb
from pie.v1 import generate_pb2_grpc as pb_grpc
from pie_client import _channel

EXPECTED_CONFIG = {
    "methodConfig": [{
        "name": [{"service": "pie.v1.GenerateService"}],
        "retryPolicy": {
            "maxAttempts": 4,
            "initialBackoff": "0.1s",
            "maxBackoff": "1s",
            "backoffMultiplier": 2,
            "retryableStatusCodes": ["UNAVAILABLE"],
        },
    }]
}


def _options(opts: list[tuple[str, Any]]) -> dict[str, Any]:
    assert len({key for key, _ in opts}) == len(opts), opts  # no option twice
    return dict(opts)


def test_the_service_config_holds_the_retry_policy() -> None:
    opts = _options(_channel.channel_options(False, None, ()))
    assert json.loads(opts["grpc.service_config"]) == EXPECTED_CONFIG
    assert "grpc.lb_policy_name" not in opts


def test_retry_off_sends_no_service_config() -> None:
    assert _channel.channel_options(False, None, (), retry=False) == []
    assert _options(_channel.channel_options(True, None, (), retry=False)) == {"grpc.lb_policy_name": "round_robin"}


def test_the_callers_own_service_config_and_options_are_kept() -> None:
    mine = json.dumps({"methodConfig": [{"name": [{}], "timeout": "5s"}]})
    opts = _options(_channel.channel_options(True, "pick_first", [("grpc.service_config", mine),
                                                                  ("grpc.max_send_message_length", 10)]))
    assert opts == {"grpc.service_config": mine, "grpc.max_send_message_length": 10,
                    "grpc.lb_policy_name": "pick_first"}


@pytest.mark.parametrize("retry", [True, False])
def test_both_clients_pass_the_service_config_to_their_channel(monkeypatch: pytest.MonkeyPatch, retry: bool) -> None:
    seen: list[dict[str, Any]] = []

    def capture(real):  # type: ignore[no-untyped-def]
        def channel(target, options=None, compression=None):  # type: ignore[no-untyped-def]
            seen.append(_options(list(options or ())))
            return real(target, options=options, compression=compression)
        return channel

    monkeypatch.setattr(grpc, "insecure_channel", capture(grpc.insecure_channel))
    monkeypatch.setattr(grpc.aio, "insecure_channel", capture(grpc.aio.insecure_channel))
    pie_client.Client("127.0.0.1:1", retry=retry).close()

    async def make_async() -> None:
        await pie_client.AsyncClient("127.0.0.1:1", retry=retry).close()

    asyncio.run(make_async())
    assert len(seen) == 2
    for opts in seen:
        if retry:
            assert json.loads(opts["grpc.service_config"]) == EXPECTED_CONFIG
        else:
            assert "grpc.service_config" not in opts


class Flaky(pb_grpc.GenerateServiceServicer):
    """Answers UNAVAILABLE to the first `failures` calls of each method, in the way `mode` says:
    "refuse" before sending anything, "headers" after sending its headers (as pie does once it has
    admitted a request), "midstream" after a first stream message."""

    def __init__(self) -> None:
        self.mode = "refuse"
        self.failures = 0
        self.calls = 0
        self._lock = threading.Lock()

    def _fails(self) -> bool:
        with self._lock:
            self.calls += 1
            return self.calls <= self.failures

    def Generate(self, request: pb.GenerateRequest, context: grpc.ServicerContext) -> pb.GenerateResponse:
        if self._fails():
            if self.mode == "headers":
                context.send_initial_metadata((("x-request-id", "r1"),))
            context.abort(grpc.StatusCode.UNAVAILABLE, "replica going away")
        return pb.GenerateResponse(request_id="r1", text="done", finish_reason=pb.FINISH_REASON_LENGTH)

    def GenerateStream(
        self, request: pb.GenerateStreamRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.GenerateStreamResponse]:
        if self._fails():
            if self.mode == "midstream":
                yield pb.GenerateStreamResponse(request_id="r1", text="par")
            context.abort(grpc.StatusCode.UNAVAILABLE, "replica going away")
        yield pb.GenerateStreamResponse(request_id="r1", text="done", finish_reason=pb.FINISH_REASON_LENGTH)


@pytest.fixture(scope="module")
def flaky() -> Iterator[tuple[Flaky, str]]:
    servicer = Flaky()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_GenerateServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, f"127.0.0.1:{port}"
    server.stop(None)


def _arm(servicer: Flaky, mode: str, failures: int) -> None:
    servicer.mode, servicer.failures, servicer.calls = mode, failures, 0


def test_unavailable_before_an_answer_is_retried(flaky: tuple[Flaky, str]) -> None:
    servicer, address = flaky
    with pie_client.Client(address, timeout=10) as client:
        _arm(servicer, "refuse", 3)  # three refusals, the fourth attempt answers
        assert client.generate("x").text == "done"
        assert servicer.calls == 4
        _arm(servicer, "refuse", 4)  # four refusals use up the attempts
        with pytest.raises(pie_client.Unavailable, match="replica going away"):
            client.generate("x")
        assert servicer.calls == 4
        _arm(servicer, "refuse", 2)
        assert [d.text for d in client.stream("x")] == ["done"]
        assert servicer.calls == 3


def test_the_async_client_retries_too(flaky: tuple[Flaky, str]) -> None:
    servicer, address = flaky

    async def scenario() -> str:
        async with pie_client.AsyncClient(address, timeout=10) as client:
            return (await client.generate("x")).text

    _arm(servicer, "refuse", 2)
    assert asyncio.run(scenario()) == "done"
    assert servicer.calls == 3


def test_retry_off_sends_each_call_once(flaky: tuple[Flaky, str]) -> None:
    servicer, address = flaky
    _arm(servicer, "refuse", 1)
    with pie_client.Client(address, timeout=10, retry=False) as client, pytest.raises(pie_client.Unavailable):
        client.generate("x")
    assert servicer.calls == 1


@pytest.mark.parametrize("mode", ["headers", "midstream"])
def test_a_call_that_began_to_answer_is_never_replayed(flaky: tuple[Flaky, str], mode: str) -> None:
    servicer, address = flaky
    _arm(servicer, mode, 1)
    with pie_client.Client(address, timeout=10) as client, pytest.raises(pie_client.Unavailable):
        if mode == "headers":
            client.generate("x")
        else:
            list(client.stream("x"))
    assert servicer.calls == 1


def test_the_cli_retries_unless_told_not_to(flaky: tuple[Flaky, str], capsys: pytest.CaptureFixture[str]) -> None:
    """`pie-client` builds its Client with the retry policy; `--no-retry` sends each call once."""
    from pie_client.cli import main

    servicer, address = flaky
    _arm(servicer, "refuse", 1)
    assert main(["--address", address, "generate", "--no-stream", "x"]) == 0
    assert servicer.calls == 2 and capsys.readouterr().out.startswith("done")
    _arm(servicer, "refuse", 1)
    assert main(["--address", address, "--no-retry", "generate", "--no-stream", "x"]) != 0
    assert servicer.calls == 1 and "replica going away" in capsys.readouterr().err
