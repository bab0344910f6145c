"""Two ways a hostile but fair load used to take `pie serve` down, tried on real processes:

- bursts of concurrent prompts that are refused for length grew the gRPC process's memory without
  bound (each refusal's exception, kept by grpc.aio with the frames that held the request and
  the tokenizer's Encoding): its RSS must stay flat, and a prompt whose length alone refuses it
  must be refused without being tokenized;
- a frozen engine process (SIGSTOP, a host stall) went unseen, because the step watchdog ran
  inside it: the parent must see the silence, fail the streams with UNAVAILABLE, turn readiness
  off and exit with status 3 within a few seconds of `--step-timeout`.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2

from pie.service.server import EXIT_ENGINE_DEAD
from pie.v1 import generate_pb2 as pb
from pie.v1 import generate_pb2_grpc as pb_grpc
from pie_client import Client, InvalidArgument, Unavailable
from tests.helpers import make_hf_model_dir, wait_until
from tests.service.processes import ServerProcess, engine_children, readiness

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc (Linux)")

# Growth of the gRPC process's RSS allowed from the end of the first burst to the end of the last.
# Before the fix each refused 1M-character prompt kept ~31 MB (its Encoding and the request): 8
# per burst grew the process ~250 MB a burst. The first burst warms the allocator and is not counted.
RSS_GROWTH_BOUND_MB = 64
BURSTS = 3
PER_BURST = 8
PROMPT = ("once upon a time " * 60_000)[:999_999]


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def _address(server: ServerProcess) -> str:
    ready = wait_until(lambda: server.event("server_listening") if server.event("server_ready") else None,
                       timeout=120, what="the server to be ready")
    return f"127.0.0.1:{ready['port']}"


def _burst(address: str, n: int) -> list[tuple[grpc.StatusCode, str]]:
    results: list[tuple[grpc.StatusCode, str]] = []
    with grpc.insecure_channel(address, options=[("grpc.max_send_message_length", 8 << 20)]) as ch:
        stub = pb_grpc.GenerateServiceStub(ch)

        def one() -> None:
            try:
                stub.Generate(pb.GenerateRequest(prompt=PROMPT, sampling=pb.SamplingParams(max_tokens=4)), timeout=120)
                results.append((grpc.StatusCode.OK, ""))
            except grpc.RpcError as e:
                results.append((e.code(), e.details()))

        threads = [threading.Thread(target=one) for _ in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    return results


@pytest.mark.slow
def test_refused_long_prompts_leave_the_grpc_process_flat(tmp_path):
    """A model whose context (256k) admits 1M characters' worth of bytes: the prompts are tokenized
    (the byte-length bound cannot refuse them), found too long (~760k tokens) and refused. Bursts of
    8 at once leave the parent's RSS within RSS_GROWTH_BOUND_MB of where the first burst left it."""
    model = make_hf_model_dir(tmp_path, "llama", seed=0, max_position_embeddings=262_144)
    server = ServerProcess(["--model", str(model), "--port", "0", "--device", "cpu", "--num-kv-blocks", "64"])
    try:
        address = _address(server)
        after = []
        for _ in range(BURSTS):
            results = _burst(address, PER_BURST)
            assert all(code == grpc.StatusCode.INVALID_ARGUMENT and "tokens; the context length is 262144" in d
                       and "prompt has at least" not in d for code, d in results), results[:2]
            after.append(_rss_mb(server.proc.pid))
        print(f"gRPC process RSS after each burst of {PER_BURST}: {[round(m) for m in after]} MB")
        assert after[-1] - after[0] <= RSS_GROWTH_BOUND_MB, after
        with Client(address, timeout=30) as c:  # still serving
            assert c.generate("the cat", max_tokens=2, ignore_eos=True).completion_tokens == 2
    finally:
        server.finish()


@pytest.mark.slow
def test_prompt_refused_by_its_length_costs_no_tokenization():
    """The bundled model (512-token context): 16 concurrent 1M-character prompts are refused from
    their byte length ("at least N tokens"), none tokenized, and the process stays flat."""
    server = ServerProcess(["--port", "0", "--device", "cpu"])
    try:
        address = _address(server)
        sizes = []
        for _ in range(BURSTS):
            results = _burst(address, 16)
            assert all(code == grpc.StatusCode.INVALID_ARGUMENT and "prompt has at least" in d
                       for code, d in results), results[:2]
            sizes.append(_rss_mb(server.proc.pid))
        assert sizes[-1] - sizes[0] <= RSS_GROWTH_BOUND_MB, sizes
        with Client(address, timeout=30) as c, pytest.raises(InvalidArgument) as err:
            c.generate(PROMPT, max_tokens=2)
        assert err.value.reason == "PROMPT_TOO_LONG" and err.value.field_violations[0][0] == "prompt"
    finally:
        server.finish()


@pytest.mark.slow
def test_a_stopped_engine_process_is_caught_from_outside():
    """SIGSTOP the engine process while 8 streams run, with --step-timeout 5: the streams end with
    UNAVAILABLE (ENGINE_STOPPED, "engine stalled") about 5 s later, readiness goes NOT_SERVING, a
    request sent meanwhile gets the same cause, and the server exits with status 3. Before that, an
    engine idle for longer than the timeout is not taken for a stalled one."""
    server = ServerProcess(["--port", "0", "--device", "cpu", "--step-timeout", "5"])
    child = None
    try:
        address = _address(server)
        child = engine_children(server.proc.pid)[0]
        with Client(address, timeout=60) as c:
            time.sleep(6.5)  # idle past the timeout: nothing is awaited, nothing is stalled
            assert c.generate("Once upon a time", max_tokens=4, ignore_eos=True).completion_tokens == 4
            assert server.proc.poll() is None and server.event("engine_stalled") is None

            errors: list[BaseException] = []
            started = threading.Barrier(9)

            def stream() -> None:
                try:
                    for i, _ in enumerate(c.stream("Once upon a time", max_tokens=500, ignore_eos=True)):
                        if i == 0:
                            started.wait()
                    errors.append(AssertionError("the stream finished while the engine was stopped"))
                except BaseException as e:
                    errors.append(e)

            threads = [threading.Thread(target=stream) for _ in range(8)]
            for t in threads:
                t.start()
            started.wait(timeout=60)  # every stream has its first token: the engine is busy
            os.kill(child, signal.SIGSTOP)
            stopped_at = time.monotonic()
            for t in threads:
                t.join(timeout=30)
            ended_s = time.monotonic() - stopped_at
            assert len(errors) == 8 and all(isinstance(e, Unavailable) for e in errors), errors
            assert all(e.reason == "ENGINE_STOPPED" and "engine stalled" in str(e) for e in errors), errors[0]
            assert ended_s < 5 + 5, f"the streams ended {ended_s:.1f} s after the engine stopped"
            assert readiness(address) in (health_pb2.HealthCheckResponse.NOT_SERVING, -1)
            try:
                c.generate("anyone there?", max_tokens=2)
            except Unavailable as e:
                assert "engine stalled" in str(e) or "connect" in str(e), e
        assert server.proc.wait(timeout=15) == EXIT_ENGINE_DEAD
        assert time.monotonic() - stopped_at < 5 + 10
        stalled = server.event("engine_stalled")
        assert stalled is not None and "8 requests in flight" in stalled["error"]
        wait_until(lambda: not os.path.exists(f"/proc/{child}") or _state(child) in ("Z", "X"), timeout=10,
                   what="the stopped engine process to be killed")
        assert not any(e.get("event") == "raw" and "Traceback" in e.get("line", "") for e in server.events)
    finally:
        if child is not None:
            try:
                os.kill(child, signal.SIGCONT)
            except ProcessLookupError:
                pass
        server.finish()


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "X"
