"""The waiting-queue bound counts samples: a request of n > 1 takes n places."""

from __future__ import annotations

import asyncio

import pytest

from pie.engine.client.thread import ThreadEngineClient
from pie.engine.config import EngineConfig
from pie.engine.core.engine_core import EngineCore
from pie.engine.errors import QueueFullError, RequestError
from pie.engine.sampling_params import SamplingParams
from tests.helpers import make_hf_model_dir, save_peft_adapter


def test_queue_bound_counts_samples(tmp_path):
    engine = EngineCore(EngineConfig(model=str(make_hf_model_dir(tmp_path, "llama")), device="cpu",
                                    kv_cache_dtype="fp32", num_kv_blocks=64, max_num_seqs=1, max_waiting=2))
    with pytest.raises(RequestError) as err:  # more samples than could ever be admitted
        engine.check_request([5, 6, 7], SamplingParams(n=4))
    assert err.value.field == "n"

    async def scenario():
        handle = ThreadEngineClient.around(engine)
        handle.start(asyncio.get_running_loop())
        try:
            # No await in between: what the engine thread takes in reaches these counts only
            # through the event loop, so they are exact here.
            handle.submit([5, 6, 7], SamplingParams(n=2, max_tokens=4), caller_id="a")  # 2 of the 3 places
            with pytest.raises(QueueFullError):
                handle.submit([5, 6, 7], SamplingParams(n=2, max_tokens=4), caller_id="b")  # would need 4
            handle.submit([5, 6, 7], SamplingParams(n=1, max_tokens=4), caller_id="c")  # the last place
            assert handle.num_queued == 3
            assert handle.stats().requests_waiting == 3
        finally:
            handle.stop()

    asyncio.run(scenario())


def test_requests_on_their_way_wait_on_their_adapter(tmp_path):
    """What stats() counts as waiting includes the requests not yet taken in by the engine loop, and
    so does each adapter's waiting count (what the gateway's waiting_lora_adapters label lists)."""
    pytest.importorskip("peft")
    model_dir = make_hf_model_dir(tmp_path, "llama")
    alpha = save_peft_adapter(model_dir, tmp_path / "alpha", seed=0, scale=1.0, r=4, lora_alpha=4,
                              target_modules=["q_proj"])
    engine = EngineCore(EngineConfig(model=str(model_dir), device="cpu", kv_cache_dtype="fp32", num_kv_blocks=64,
                                     max_num_seqs=1, max_loras=1, max_lora_rank=4, loras=(("alpha", str(alpha)),)))

    async def scenario():
        handle = ThreadEngineClient.around(engine)
        handle.start(asyncio.get_running_loop())
        try:
            for i, adapter in enumerate(("alpha", None, "alpha")):  # no await: none is taken in yet
                handle.submit([5, 6, 7], SamplingParams(max_tokens=4), caller_id=str(i), adapter=adapter)
            stats = handle.stats()
            assert stats.requests_waiting == 3
            assert {a.name: a.waiting for a in stats.adapters} == {"alpha": 2}
        finally:
            handle.stop()

    asyncio.run(scenario())
