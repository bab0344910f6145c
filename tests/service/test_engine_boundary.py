"""The seam between the service and the engine, with the engine on a thread and in a process:
request ids the engine owns (a caller's id may be reused at once, or shared by two callers), an
event loop that nothing blocks, and deadlines reported as such."""

from __future__ import annotations

import asyncio
import functools
import threading
import time

import grpc
import pytest
import structlog
import structlog.testing
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pie.engine.config import EngineConfig
from pie.service.server import BackgroundServer, ServerConfig
from pie.service.servicer import SERVICE_NAME
from pie.v1 import generate_pb2 as pb
from pie.v1 import generate_pb2_grpc as pb_grpc
from pie_client import Client, InvalidArgument, PieError
from tests.helpers import make_hf_model_dir, slow_steps, wait_until

# slow: every test starts a BackgroundServer (engine thread and process)
pytestmark = pytest.mark.slow

NUM_BLOCKS = 96


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_hf_model_dir(tmp_path_factory.mktemp("boundary"), "llama", weight_scale=4.0)


def _config(model_dir, **kw) -> EngineConfig:
    base = dict(model=str(model_dir), device="cpu", kv_cache_dtype="fp32", num_kv_blocks=NUM_BLOCKS,
                max_num_seqs=16, max_num_batched_tokens=256, max_waiting=64)
    return EngineConfig(**{**base, **kw})


@pytest.fixture(scope="module", params=["thread", "process"])
def server(request, model_dir):
    cfg = ServerConfig(port=0, grace_s=5, engine_process=request.param == "process")
    with BackgroundServer(cfg, _config(model_dir)) as s:
        yield s


def _idle(server) -> None:
    with Client(server.address, timeout=30) as c:
        def idle():
            load = c.model_info().load
            return (load.kv_blocks_free == load.kv_blocks_total and load.requests_running == 0
                    and server.pie.engine_client.num_in_flight == 0)
        wait_until(idle, timeout=30, what="every block free and nothing in flight")


def _greedy(**kw) -> pb.SamplingParams:
    return pb.SamplingParams(temperature=0, ignore_eos=True, **kw)


def test_a_reused_id_after_cancel_gets_only_its_own_output(rng, server):
    """Cancel a stream with id "x" mid-generation and at once send another request as "x": the
    second one's answer holds exactly its own tokens (the old request's tokens, still on their
    way from the engine, go nowhere). Driven many times, to hit the race."""
    words = ["the", "cat", "sat", "on", "a", "mat", "dog", "ran", "far"]
    n_tokens = 6

    async def scenario():
        async with grpc.aio.insecure_channel(server.address) as ch:
            stub = pb_grpc.GenerateServiceStub(ch)
            prompts = [" ".join(rng.choice(words) for _ in range(rng.randrange(2, 10))) for _ in range(6)]
            want = {}
            for p in prompts:  # each prompt's own answer, alone
                r = await stub.Generate(pb.GenerateRequest(prompt=p, sampling=_greedy(max_tokens=n_tokens)))
                want[p] = list(r.token_ids)
            for i in range(40):
                old, new = rng.choice(prompts), rng.choice(prompts)
                rid = f"x{i % 3}"
                call = stub.GenerateStream(pb.GenerateStreamRequest(
                    prompt=old, request_id=rid, sampling=_greedy(max_tokens=200)))
                for _ in range(rng.randrange(1, 4)):  # a message or a few, then cancel mid-generation
                    await call.read()
                call.cancel()
                retry = stub.GenerateStream(pb.GenerateStreamRequest(
                    prompt=new, request_id=rid, sampling=_greedy(max_tokens=n_tokens)))
                got, last = [], None
                async for msg in retry:
                    assert msg.request_id == rid
                    got += msg.token_ids
                    last = msg
                assert got == want[new], f"round {i}: reused id {rid!r} got {got}, its own answer is {want[new]}"
                assert last.usage.completion_tokens == n_tokens

    asyncio.run(scenario())
    _idle(server)


def test_two_callers_with_the_same_id_are_both_served(server):
    """Ids like "1" are common: callers who pick the same one at the same time each get their own
    answer, under their own id."""
    prompts = ["the cat sat", "a dog ran far", "on the mat", "the mat sat on a cat"]
    with Client(server.address, timeout=60) as c:
        want = [c.generate(p, max_tokens=8, temperature=0, ignore_eos=True).token_ids for p in prompts]

    async def scenario():
        async with grpc.aio.insecure_channel(server.address) as ch:
            stub = pb_grpc.GenerateServiceStub(ch)

            async def unary(p):
                call = stub.Generate(pb.GenerateRequest(prompt=p, request_id="1", sampling=_greedy(max_tokens=8)))
                r = await call
                assert dict(await call.initial_metadata())["x-request-id"] == "1"
                return r.request_id, list(r.token_ids)

            async def stream(p):
                ids = []
                async for m in stub.GenerateStream(pb.GenerateStreamRequest(
                        prompt=p, sampling=_greedy(max_tokens=8)), metadata=(("x-request-id", "1"),)):
                    assert m.request_id == "1"
                    ids += m.token_ids
                return "1", ids

            return await asyncio.gather(*(f(p) for p in prompts for f in (unary, stream)))

    results = asyncio.run(scenario())
    for i, (rid, ids) in enumerate(results):
        assert rid == "1"
        assert ids == want[i // 2], f"caller {i} got another request's tokens"
    _idle(server)


def test_sample_ids_never_meet_a_callers_id(server):
    """A request of n samples and callers whose ids look like the engine's own names for samples
    ("a#1") or requests ("r0"), all at once: each answer is whole and its own."""
    with Client(server.address, timeout=60) as c:
        want_single = c.generate("the cat", max_tokens=6, temperature=0, ignore_eos=True).token_ids

    async def scenario():
        async with grpc.aio.insecure_channel(server.address) as ch:
            stub = pb_grpc.GenerateServiceStub(ch)
            multi = stub.Generate(pb.GenerateRequest(prompt="a dog", request_id="a", sampling=pb.SamplingParams(
                max_tokens=6, temperature=1.0, seed=7, n=3, ignore_eos=True)))
            singles = [stub.Generate(pb.GenerateRequest(prompt="the cat", request_id=rid,
                                                        sampling=_greedy(max_tokens=6)))
                       for rid in ("a#1", "a#2", "r0", "r1#0")]
            return await multi, await asyncio.gather(*singles)

    multi, singles = asyncio.run(scenario())
    assert multi.request_id == "a" and [c.index for c in multi.choices] == [0, 1, 2]
    assert all(len(c.token_ids) == 6 for c in multi.choices)
    assert multi.usage.completion_tokens == 18
    for r, rid in zip(singles, ("a#1", "a#2", "r0", "r1#0")):
        assert r.request_id == rid and list(r.token_ids) == want_single
    _idle(server)


def test_an_id_held_by_an_open_stream_can_be_used_again(server):
    """A stream holding "dup" open does not stop another request named "dup" from being served
    (it used to be refused as "already in flight")."""
    with Client(server.address, timeout=60) as c:
        held = c.stream("the cat", max_tokens=100, ignore_eos=True, request_id="dup")
        next(held)
        try:
            r = c.generate("a dog", max_tokens=3, request_id="dup", ignore_eos=True)
            assert r.request_id == "dup" and r.completion_tokens == 3
        finally:
            held.close()
    _idle(server)


# ---- the event loop stays free ------------------------------------------------------------------

def _health_latencies(address: str, stop: threading.Event, out: list[float]) -> None:
    with grpc.insecure_channel(address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        req = health_pb2.HealthCheckRequest(service=SERVICE_NAME)
        stub.Check(req, timeout=10)
        while not stop.is_set():
            t = time.perf_counter()
            stub.Check(req, timeout=10)
            out.append(time.perf_counter() - t)
            stop.wait(0.01)


def test_health_stays_fast_while_near_limit_prompts_arrive(rng, server, monkeypatch):
    """Prompts near the character limit (1M characters here) take ~0.5 s each to tokenize: on the
    event loop that would stall every RPC. They are tokenized off it, so health checks stay fast.
    (Refusing them by their byte length alone is turned off here, as for a model whose context
    admits 1M characters' worth of tokens: they are tokenized to be counted.)"""
    monkeypatch.setattr(server.pie.engine_client.tokenizer, "max_token_bytes", None)
    words = ["once", "upon", "a", "time", "there", "was", "little", "girl", "café", "日本"]
    limit = server.pie.admission.limits.max_prompt_chars
    texts = []
    for _ in range(3):
        t = " ".join(rng.choice(words) for _ in range(limit // 4))[:limit - rng.randrange(100)]
        texts.append(t)
    latencies: list[float] = []
    stop = threading.Event()
    checker = threading.Thread(target=_health_latencies, args=(server.address, stop, latencies))
    checker.start()
    try:
        wait_until(lambda: len(latencies) >= 5, what="health checks to start")

        async def flood():
            async with grpc.aio.insecure_channel(server.address, options=[
                    ("grpc.max_send_message_length", 8 << 20)]) as ch:
                stub = pb_grpc.GenerateServiceStub(ch)

                async def one(i):
                    try:
                        await stub.Generate(pb.GenerateRequest(prompt=texts[i % len(texts)],
                                                               sampling=pb.SamplingParams(max_tokens=2)), timeout=120)
                    except grpc.aio.AioRpcError as e:
                        return e.code(), e.details()
                    return grpc.StatusCode.OK, ""

                return await asyncio.gather(*(one(i) for i in range(12)))

        t0 = time.perf_counter()
        results = asyncio.run(flood())
        elapsed = time.perf_counter() - t0
    finally:
        stop.set()
        checker.join()
    # Far more tokens than the context: refused once tokenized, naming the field.
    assert all(code == grpc.StatusCode.INVALID_ARGUMENT and "prompt" in details for code, details in results)
    latencies.sort()
    p99 = latencies[int(0.99 * (len(latencies) - 1))]
    print(f"{len(latencies)} health checks over {elapsed:.1f} s of near-limit prompts: "
          f"p50 {1e3 * latencies[len(latencies) // 2]:.1f} ms, p99 {1e3 * p99:.1f} ms, max {1e3 * latencies[-1]:.1f} ms")
    assert elapsed > 1.0, "the prompts were too cheap to test anything"
    assert p99 < 0.05, f"health check p99 {1e3 * p99:.1f} ms while long prompts were tokenized"


def test_long_prompt_is_tokenized_like_a_short_one(server):
    """The off-loop path (long text) and the inline path give the same ids as the tokenizer."""
    tok = server.pie.engine_client.tokenizer
    text = "the cat sat on the mat. " * 200  # past the inline limit
    with Client(server.address, timeout=60) as c:
        assert c.tokenize(text).token_ids == tok.encode(text)
        with pytest.raises(InvalidArgument, match="prompt"):
            c.generate(text * 10, max_tokens=2)  # ~12k tokens: longer than the context


# ---- deadlines ----------------------------------------------------------------------------------

@pytest.fixture(scope="module", params=["thread", "process"])
def slow_server(request, model_dir):
    cfg = ServerConfig(port=0, grace_s=5, engine_process=request.param == "process",
                       engine_setup=functools.partial(slow_steps, seconds=0.02))
    with BackgroundServer(cfg, _config(model_dir)) as s:
        yield s


def _finished_counts(server) -> dict[tuple[str, str], float]:
    out = {}
    for metric in server.pie.metrics.registry.collect():
        if metric.name == "pie_requests_finished":
            for sample in metric.samples:
                if sample.name.endswith("_total"):
                    out[(sample.labels["rpc"], sample.labels["code"])] = sample.value
    return out


def test_an_expired_deadline_is_deadline_exceeded_in_log_and_metrics(slow_server):
    before = _finished_counts(slow_server)
    with structlog.testing.capture_logs() as logs:
        with Client(slow_server.address, timeout=0.5) as c:
            with pytest.raises(PieError) as err:
                c.generate("the cat", max_tokens=200, ignore_eos=True, request_id="late-unary")
            assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
            with pytest.raises(PieError) as err:
                list(c.stream("the cat", max_tokens=200, ignore_eos=True, request_id="late-stream"))
            assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        with Client(slow_server.address, timeout=30) as c:
            s = c.stream("the cat", max_tokens=200, ignore_eos=True, request_id="cancelled-stream")
            next(s)
            s.close()

        def counted():
            after = _finished_counts(slow_server)
            return all(after.get(k, 0) - before.get(k, 0) == 1 for k in (
                ("Generate", "DEADLINE_EXCEEDED"), ("GenerateStream", "DEADLINE_EXCEEDED"),
                ("GenerateStream", "CANCELLED")))
        wait_until(counted, what="the three endings to be counted")
    done = {e["request_id"]: e for e in logs if e.get("event") == "request_done"}
    assert done["late-unary"]["status"] == "DEADLINE_EXCEEDED"
    assert done["late-stream"]["status"] == "DEADLINE_EXCEEDED"
    assert done["cancelled-stream"]["status"] == "CANCELLED"
    assert done["late-unary"]["engine_request_id"] != done["late-stream"]["engine_request_id"]
    _idle(slow_server)
