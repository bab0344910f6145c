"""Request priority through the service: admission by (priority, arrival), what GetModelInfo and
the metrics say about the waiting queue, and refusal of a priority that is not an int32."""

from __future__ import annotations

import asyncio
import time

import pytest

from pie.engine.config import EngineConfig
from pie.service.server import BackgroundServer, ServerConfig
from pie_client import AsyncClient, Client
from tests.helpers import make_hf_model_dir, wait_until

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = make_hf_model_dir(tmp_path_factory.mktemp("prio"), "llama", weight_scale=4.0)
    cfg = EngineConfig(model=str(model), device="cpu", kv_cache_dtype="fp32", num_kv_blocks=256, max_num_seqs=2,
                       max_waiting=64)
    with BackgroundServer(ServerConfig(port=0, grace_s=5), cfg) as s:
        yield s


def test_an_urgent_request_sent_last_starts_before_the_queue(server):
    """--max-num-seqs 2, 30 requests queued at priority 0, then one at priority -1: it starts at
    the first free slot, before every one of the 28 still waiting. (Their own order is the order
    they reached the server, which 30 concurrent calls do not fix: tests/engine/test_scheduler.py
    holds first come, first served within a priority.) The queued requests are long enough (32
    tokens) that the two running ones do not finish, and free their slots for queued ones, while
    the urgent call is on its way: with 12 tokens that happened on a loaded machine (5th)."""
    firsts: dict[str, float] = {}

    async def run() -> None:
        async with AsyncClient(server.address, timeout=120) as client:
            async def one(name: str, priority: int) -> None:
                async for delta in client.stream([5, 6, 7, 8], max_tokens=32, ignore_eos=True, temperature=0,
                                                 priority=priority, request_id=name):
                    if delta.token_ids and name not in firsts:
                        firsts[name] = time.monotonic()

            normal = [asyncio.create_task(one(f"n{i}", 0)) for i in range(30)]
            while (await client.model_info()).load.requests_waiting < 28:
                await asyncio.sleep(0.005)
            load = (await client.model_info()).load
            assert load.requests_waiting_by_priority[0] == load.requests_waiting
            urgent = asyncio.create_task(one("urgent", -1))
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
