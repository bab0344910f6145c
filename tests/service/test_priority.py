"""Request priority through the service: admission by (priority, arrival), what GetModelInfo and
the metrics say about the waiting queue, and refusal of a priority that is not an int32."""

from __future__ import annotations

import asyncio
import time

import pytest

from pie.engine.config import EngineConfig
from pie.service.server import BackgroundServer, ServerConfig
from pie_client import AsyncClient, Client
from tests.helpers import StepGate, make_hf_model_dir, wait_until

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gate() -> StepGate:
    return StepGate()


@pytest.fixture(scope="module")
def server(tmp_path_factory, gate):
    model = make_hf_model_dir(tmp_path_factory.mktemp("prio"), "llama", weight_scale=4.0)
    cfg = EngineConfig(model=str(model), device="cpu", kv_cache_dtype="fp32", num_kv_blocks=256, max_num_seqs=2,
                       max_waiting=64)
    with BackgroundServer(ServerConfig(port=0, grace_s=5, engine_setup=gate), cfg) as s:
        yield s


async def _until(condition, what: str, timeout: float = 30.0) -> None:
    """Polls `condition` without blocking the event loop (the streams run on it), or fails."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.005)


def test_an_urgent_request_sent_last_starts_before_the_queue(server, gate):
    """--max-num-seqs 2, 30 requests queued at priority 0, then one at priority -1: it starts at
    the first free slot, before every one of the 28 still waiting. (Their own order is the order
    they reached the server, which 30 concurrent calls do not fix: tests/engine/scheduling/test_scheduler.py
    holds first come, first served within a priority.) The engine's steps wait for permits while
    the queue is built, so two run and 28 wait when the urgent call arrives and joins them, however
    fast or loaded the machine: polling for that queue while steps ran free once saw it never form
    (the first requests had finished) and waited forever."""
    firsts: dict[str, float] = {}
    in_flight = server.pie.admission.in_flight
    scheduler = server.core.scheduler

    async def run() -> None:
        async with AsyncClient(server.address, timeout=120) as client:
            async def one(name: str, priority: int) -> None:
                async for delta in client.stream([5, 6, 7, 8], max_tokens=32, ignore_eos=True, temperature=0,
                                                 priority=priority, request_id=name):
                    if delta.token_ids and name not in firsts:
                        firsts[name] = time.monotonic()

            gate.hold()
            try:
                # n0's step admits it and waits; the other 29 reach the engine behind it
                normal = [asyncio.create_task(one("n0", 0))]
                await _until(lambda: len(in_flight) == 1, "n0 in the engine")
                normal += [asyncio.create_task(one(f"n{i}", 0)) for i in range(1, 30)]
                await _until(lambda: len(in_flight) == 30, "30 requests in the engine")
                gate.allow(1)  # n0's step runs; the next takes the 29 in: n1 admitted, 28 waiting
                await _until(lambda: scheduler.num_waiting == 28, "28 requests waiting")
                urgent = asyncio.create_task(one("urgent", -1))
                await _until(lambda: len(in_flight) == 31, "the urgent request in the service")
                # One more step takes it into the engine's queue while the two running requests are
                # still decoding: released before that, a loaded machine once let n0 finish its 32
                # tokens before the call reached the engine, and n2 started ahead of it (CI, 2 cores).
                gate.allow(1)
                await _until(lambda: scheduler.num_waiting == 29, "the urgent request queued in the engine")
                load = (await client.model_info()).load  # the queue by priority, the urgent one counted or not yet
                assert sum(load.requests_waiting_by_priority.values()) == load.requests_waiting
                assert load.requests_waiting_by_priority[0] >= 28
            finally:
                gate.release()
            await asyncio.gather(*normal, urgent)

    asyncio.run(run())
    by_start = sorted(firsts, key=firsts.get)
    position = by_start.index("urgent")
    assert position <= 2, f"the urgent request started {position + 1}th: {by_start}"
    assert len(by_start) == 31


def test_waiting_by_priority_in_model_info_and_metrics(server):
    import msgspec
    from prometheus_client import generate_latest

    from pie.service.metrics import ServiceMetrics

    with Client(server.address, timeout=60) as c:
        assert dict(c.model_info().load.requests_waiting_by_priority) == {}  # nothing waits now
    stats = msgspec.structs.replace(server.pie.engine_client.stats(), requests_waiting_by_priority={-1: 2, 3: 5})
    text = generate_latest(ServiceMetrics("m", lambda: stats).registry).decode()
    assert 'pie_requests_waiting_by_priority{model_name="m",priority="-1"} 2.0' in text
    assert 'pie_requests_waiting_by_priority{model_name="m",priority="3"} 5.0' in text


def test_priority_must_be_an_int32(server):
    with Client(server.address, timeout=60) as c, pytest.raises(ValueError, match="priority"):
        c.generate("hello", max_tokens=2, priority=2**31)
    wait_until(lambda: server.pie.engine_client.num_in_flight == 0, what="nothing in flight")
