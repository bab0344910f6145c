"""The waiting-queue bound counts samples: a request of n > 1 takes n places."""

from __future__ import annotations

import asyncio

import pytest

from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.engine_thread import AsyncEngine, QueueFullError
from engine.sampling_params import SamplingParams, SamplingParamsError
from tests.helpers import make_hf_model_dir


def test_queue_bound_counts_samples(tmp_path):
    engine = LLMEngine(EngineConfig(model=str(make_hf_model_dir(tmp_path, "llama")), device="cpu",
                                    kv_cache_dtype="fp32", num_kv_blocks=64, max_num_seqs=1, max_waiting=2))
    with pytest.raises(SamplingParamsError) as err:  # more samples than could ever be admitted
        engine.check_request([5, 6, 7], SamplingParams(n=4))
    assert err.value.field == "n"

    async def scenario():
        async_engine = AsyncEngine(engine)  # not started: submissions stay queued, so counts are exact
        async_engine._loop = asyncio.get_running_loop()
        async_engine._idle = asyncio.Event()
        async_engine.submit("a", [5, 6, 7], SamplingParams(n=2, max_tokens=4))  # 2 of the 3 places
        with pytest.raises(QueueFullError):
            async_engine.submit("b", [5, 6, 7], SamplingParams(n=2, max_tokens=4))  # would need 4
        async_engine.submit("c", [5, 6, 7], SamplingParams(n=1, max_tokens=4))  # the last place
        assert async_engine.num_queued == 3

    asyncio.run(scenario())
