"""Reliability under cancellation storms, overload and engine faults, against a real loopback server."""

from __future__ import annotations

import asyncio
import collections
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pie.engine.config import EngineConfig
from pie.service.server import EXIT_ENGINE_DEAD, BackgroundServer, ServerConfig
from pie.service.servicer import SERVICE_NAME
from pie.v1 import generate_pb2 as pb
from pie.v1 import generate_pb2_grpc as pb_grpc
from pie_client import Client, InternalError, ResourceExhausted, Unavailable
from pie_client.errors import from_rpc_error
from tests.helpers import make_hf_model_dir, wait_until

# slow: every test starts a BackgroundServer or a `pie serve` subprocess
pytestmark = pytest.mark.slow

NUM_BLOCKS = 128


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_hf_model_dir(tmp_path_factory.mktemp("llama"), "llama")


def engine_config(model_dir, **kw) -> EngineConfig:
    base = dict(model=str(model_dir), device="cpu", kv_cache_dtype="fp32", block_size=16, num_kv_blocks=NUM_BLOCKS,
                max_num_seqs=32, max_num_batched_tokens=512, max_waiting=128)
    return EngineConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def server(model_dir):
    with BackgroundServer(ServerConfig(port=0, grace_s=5), engine_config(model_dir)) as s:
        yield s


def readiness(address: str) -> int:
    with grpc.insecure_channel(address) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME),
                                                    timeout=10).status


def assert_idle(server: BackgroundServer) -> None:
    """Every block back, nothing running or waiting, and the server still answers."""
    with Client(server.address, timeout=30) as c:
        def idle():
            load = c.model_info().load
            return (load.kv_blocks_free == load.kv_blocks_total and load.requests_running == 0
                    and load.requests_waiting == 0 and server.pie.engine_client.num_in_flight == 0)
        wait_until(idle, timeout=30, what="all blocks free and no request in flight")
        assert c.generate("hello", max_tokens=2, ignore_eos=True).completion_tokens == 2
    assert readiness(server.address) == health_pb2.HealthCheckResponse.SERVING


class StepRecorder:
    """Wraps the model runner: records which request ids each engine step scheduled, and can make
    the next step raise or block."""

    def __init__(self, server: BackgroundServer):
        self.aeng = server.pie.engine_client
        self.runner = server.core.runner
        self.original = self.runner.launch
        self.steps: list[tuple[int, set[str]]] = []  # (AsyncEngine.steps at the time, scheduled ids)
        self.raise_once: BaseException | None = None
        self.block: threading.Event | None = None
        self.runner.launch = self._launch

    def _launch(self, out):
        self.steps.append((self.aeng.steps, {s.request.request_id for s in out.scheduled}))
        if self.raise_once is not None:
            err, self.raise_once = self.raise_once, None
            raise err
        if self.block is not None:
            self.block.wait(60)
        return self.original(out)

    def restore(self):
        self.runner.launch = self.original


# ---- cancellation -------------------------------------------------------------------------------

def test_cancel_stops_compute_within_one_step(server):
    rec = StepRecorder(server)
    aborted_at: dict[str, int] = {}  # caller's id -> engine step when the servicer aborted it
    engine_ids: dict[str, str] = {}  # caller's id -> the engine's id for it
    original_abort = server.pie.engine_client.abort

    def abort(stream):
        aborted_at.setdefault(stream.caller_id, server.pie.engine_client.steps)
        engine_ids[stream.caller_id] = stream.engine_id
        original_abort(stream)

    server.pie.engine_client.abort = abort
    try:
        with Client(server.address, timeout=60) as c:
            keep_busy = c.stream("a b c", max_tokens=300, ignore_eos=True)  # keeps the engine stepping
            next(keep_busy)
            victim = c.stream("d e f", max_tokens=300, ignore_eos=True, request_id="victim")
            for _ in range(3):
                next(victim)
            victim.close()
            wait_until(lambda: "victim" in aborted_at, what="the servicer to abort the victim")
            k, vid = aborted_at["victim"], engine_ids["victim"]
            wait_until(lambda: rec.steps and rec.steps[-1][0] >= k + 3, what="three more steps")
            keep_busy.close()
        assert any(vid in ids for _, ids in rec.steps), "the victim was never scheduled"
        # Step k may be in flight when the abort lands, and step k+1 may have drained the inbox just
        # before it: from step k+2 on the victim must be gone.
        late = [i for i, ids in rec.steps if i >= k + 2 and vid in ids]
        assert not late, f"victim scheduled at steps {late} after its abort at step {k}"
    finally:
        server.pie.engine_client.abort = original_abort
        rec.restore()
    assert_idle(server)


async def _storm(address: str, n: int, concurrency: int, seed: int) -> collections.Counter:
    rng = random.Random(seed)
    sem = asyncio.Semaphore(concurrency)
    outcomes: collections.Counter = collections.Counter()
    shared = grpc.aio.insecure_channel(address)
    shared_stub = pb_grpc.GenerateServiceStub(shared)

    async def one(i: int) -> None:
        mode = rng.choice(("cancel", "deadline", "drop", "complete"))
        req = pb.GenerateStreamRequest(
            prompt_token_ids=pb.TokenIds(ids=[rng.randrange(3, 500) for _ in range(rng.randrange(1, 40))]),
            sampling=pb.SamplingParams(max_tokens=rng.randrange(1, 24), ignore_eos=True, temperature=1.0))
        after = rng.randrange(0, 5)  # messages to read before cutting the stream
        async with sem:
            channel = grpc.aio.insecure_channel(address) if mode == "drop" else shared
            stub = pb_grpc.GenerateServiceStub(channel) if mode == "drop" else shared_stub
            timeout = rng.uniform(0.002, 0.2) if mode == "deadline" else 60
            call = stub.GenerateStream(req, timeout=timeout)
            try:
                got = 0
                if after == 0 and mode in ("cancel", "drop"):
                    await asyncio.sleep(0)
                else:
                    async for msg in call:
                        got += 1
                        if got >= after and mode in ("cancel", "drop"):
                            break
                        if msg.finish_reason:
                            outcomes["finished"] += 1
                if mode == "cancel":
                    call.cancel()
                    outcomes["cancelled"] += 1
                elif mode == "drop":
                    await channel.close(grace=None)  # the connection goes away mid-stream
                    outcomes["dropped"] += 1
            except grpc.aio.AioRpcError as e:
                outcomes[e.code().name] += 1
            finally:
                if mode == "drop":
                    await channel.close(grace=None)

    try:
        await asyncio.gather(*(one(i) for i in range(n)))
    finally:
        await shared.close()
    return outcomes


@pytest.mark.parametrize("engine", ["thread", "process"])
def test_cancellation_storm_leaks_nothing(server, model_dir, engine):
    """1,000 streams, 48 at a time, cut by cancel, deadline or a dropped connection at random points,
    with the engine on a thread and in its own process."""
    seed = random.randrange(2**31)
    print(f"storm seed={seed}")
    if engine == "process":
        with BackgroundServer(ServerConfig(port=0, grace_s=5, engine_process=True), engine_config(model_dir)) as s:
            _storm_leaks_nothing(s, seed)
    else:
        _storm_leaks_nothing(server, seed)


def _storm_leaks_nothing(server: BackgroundServer, seed: int) -> None:
    started = time.monotonic()
    outcomes = asyncio.run(_storm(server.address, n=1000, concurrency=48, seed=seed))
    print(f"storm: {dict(outcomes)} in {time.monotonic() - started:.1f} s")
    unexpected = set(outcomes) - {"finished", "cancelled", "dropped", "DEADLINE_EXCEEDED"}
    assert not unexpected, outcomes
    assert outcomes["cancelled"] > 100 and outcomes["dropped"] > 100 and outcomes["DEADLINE_EXCEEDED"] > 10
    assert_idle(server)


# ---- overload -----------------------------------------------------------------------------------

def test_overload_sheds_with_retry_info_and_serves_the_accepted(model_dir):
    """4x what the engine holds (max_num_seqs + max_waiting) at once: the excess gets
    RESOURCE_EXHAUSTED with RetryInfo, in-flight requests stay under the bound, every accepted
    request completes in bounded time."""
    seqs, waiting = 4, 4
    cfg = engine_config(model_dir, max_num_seqs=seqs, max_waiting=waiting)
    with BackgroundServer(ServerConfig(port=0, grace_s=5), cfg) as s:
        aeng = s.pie.engine_client
        peak = [0]
        original_submit = aeng.submit

        def submit(*args, **kwargs):
            stream = original_submit(*args, **kwargs)
            peak[0] = max(peak[0], aeng.num_in_flight)
            return stream

        aeng.submit = submit
        with Client(s.address, timeout=60) as c:
            t0 = time.monotonic()
            c.generate("warm up", max_tokens=12, ignore_eos=True)
            alone_s = time.monotonic() - t0

        async def one(stub, i):
            t = time.monotonic()
            try:
                r = await stub.Generate(pb.GenerateRequest(prompt=f"request {i}", sampling=pb.SamplingParams(
                    max_tokens=12, ignore_eos=True)), timeout=60)
                return "ok", time.monotonic() - t, r
            except grpc.aio.AioRpcError as e:
                return e, time.monotonic() - t, None

        async def flood():
            async with grpc.aio.insecure_channel(s.address) as ch:
                stub = pb_grpc.GenerateServiceStub(ch)
                return await asyncio.gather(*(one(stub, i) for i in range(4 * (seqs + waiting))))

        results = asyncio.run(flood())
        accepted = [(lat, r) for kind, lat, r in results if kind == "ok"]
        shed = [kind for kind, _, _ in results if kind != "ok"]
        assert len(accepted) >= seqs + waiting and shed, (len(accepted), len(shed))
        for err in shed:
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err
            assert from_rpc_error(err).retry_after is not None
        assert all(r.usage.completion_tokens == 12 for _, r in accepted)
        assert peak[0] <= seqs + waiting, f"{peak[0]} requests in flight; the bound is {seqs + waiting}"
        # An accepted request waits for at most the requests ahead of it: two batches' worth here.
        bound = 20 * alone_s + 5.0
        assert max(lat for lat, _ in accepted) < bound, (max(lat for lat, _ in accepted), alone_s)
        assert_idle(s)


# ---- faults -------------------------------------------------------------------------------------

def test_step_exception_fails_only_that_step(server):
    rec = StepRecorder(server)
    try:
        rec.raise_once = RuntimeError("injected step fault")
        with Client(server.address, timeout=60) as c:
            with pytest.raises(InternalError) as err:
                c.generate("hello", max_tokens=4, request_id="faulty-1")
            assert err.value.request_id == "faulty-1" and err.value.reason == "ENGINE_FAULT"
            assert "faulty-1" in str(err.value) and "search the server log" in str(err.value)
            assert c.generate("hello again", max_tokens=3, ignore_eos=True).completion_tokens == 3
    finally:
        rec.restore()
    assert_idle(server)


def test_out_of_memory_in_step_is_resource_exhausted(server):
    assert issubclass(torch.cuda.OutOfMemoryError, RuntimeError)
    rec = StepRecorder(server)
    try:
        rec.raise_once = torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
        with Client(server.address, timeout=60) as c:
            with pytest.raises(ResourceExhausted) as err:
                list(c.stream("hello", max_tokens=4, request_id="oom-1"))
            assert err.value.retry_after == 1.0 and err.value.request_id == "oom-1"
            assert err.value.reason == "OUT_OF_MEMORY"
            assert c.generate("hello again", max_tokens=3, ignore_eos=True).completion_tokens == 3
    finally:
        rec.restore()
    assert_idle(server)


def test_hung_step_trips_watchdog(model_dir):
    """In process: a step past --step-timeout fails the open RPCs with UNAVAILABLE, readiness goes
    NOT_SERVING, and the server's fatal flag (which makes `pie serve` exit non-zero) is set."""
    with BackgroundServer(ServerConfig(port=0, grace_s=1, step_timeout_s=0.5), engine_config(model_dir)) as s:
        rec = StepRecorder(s)
        rec.block = threading.Event()
        try:
            with Client(s.address, timeout=30) as c:
                with pytest.raises(Unavailable) as err:
                    list(c.stream("hello", max_tokens=8, request_id="hung-1"))
                assert err.value.request_id == "hung-1" and err.value.reason == "ENGINE_STOPPED"
                assert s.pie.fatal.is_set()
                wait_until(lambda: readiness(s.address) == health_pb2.HealthCheckResponse.NOT_SERVING,
                           what="readiness off")
                with pytest.raises(Unavailable):
                    c.generate("anyone there?", max_tokens=2)
        finally:
            rec.block.set()  # let the stuck thread finish so the test process stays clean


def test_hung_step_exits_process_nonzero(model_dir, tmp_path):
    """As a real process: the injected hang makes `pie serve` exit with EXIT_ENGINE_DEAD."""
    script = Path(__file__).with_name("hang_server.py")
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen(
        [sys.executable, str(script), "3", "serve", "--model", str(model_dir), "--port", "0", "--device", "cpu", "--no-engine-process",
         "--num-kv-blocks", "32", "--step-timeout", "1", "--log-format", "json"],
        stderr=subprocess.PIPE, text=True, cwd=root,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": f"{root}:{root / 'clients'}"})
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)
    reader.start()
    try:
        def port():
            for line in list(lines):
                if '"server_listening"' in line:
                    import json
                    return json.loads(line)["port"]
            return None

        address = f"127.0.0.1:{wait_until(port, timeout=60, what='server to listen')}"
        wait_until(lambda: readiness(address) == health_pb2.HealthCheckResponse.SERVING, timeout=60,
                   what="readiness")
        with Client(address, timeout=30) as c:
            with pytest.raises(Unavailable):
                c.generate("hello", max_tokens=20, ignore_eos=True)
        assert proc.wait(timeout=30) == EXIT_ENGINE_DEAD
        reader.join(10)
        assert any('"engine_step_hung"' in line for line in lines)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
