"""The KV pool's size on the CPU: what the configuration can use (max_num_seqs sequences of the
whole context), capped at CPU_KV_CACHE_BYTES, unless a budget or an exact count is given; a budget
that cannot hold one sequence is refused, naming the flag."""

from __future__ import annotations

import pytest
import torch

from pie.engine.config import EngineConfig
from pie.engine.core.engine_core import EngineCore
from pie.engine.errors import StartupError
from pie.engine.runner.kv_sizing import CPU_KV_CACHE_BYTES, num_kv_blocks, usable_blocks
from tests.helpers import make_hf_model_dir

CPU = torch.device("cpu")
MIB = 1 << 20


def _no_runner(n: int):
    raise AssertionError("the CPU never profiles")


@pytest.mark.parametrize(("max_num_seqs", "block_size", "context", "expected"), [
    (64, 16, 512, 64 * 32),  # the bundled model's defaults: 32k tokens, not the 1 GiB cap
    (3, 16, 100, 3 * 7),  # a partial last block counts whole
    (8, 32, 4096, 8 * 128),
])
def test_cpu_pool_is_what_the_configuration_can_use(max_num_seqs, block_size, context, expected):
    cfg = EngineConfig(max_num_seqs=max_num_seqs, block_size=block_size)
    assert usable_blocks(cfg, context) == expected
    assert num_kv_blocks(cfg, CPU, 4096, context, _no_runner) == expected


def test_cpu_pool_is_capped_by_the_default_budget():
    cfg = EngineConfig(max_num_seqs=64, block_size=16)
    block_bytes = 4 * MIB  # 256 blocks fit in 1 GiB; 64 sequences of 2048 tokens would need 8192
    assert num_kv_blocks(cfg, CPU, block_bytes, 2048, _no_runner) == CPU_KV_CACHE_BYTES // block_bytes


def test_an_explicit_budget_or_count_wins_over_the_configuration():
    assert num_kv_blocks(EngineConfig(max_num_seqs=2, kv_cache_memory_bytes=300 * MIB), CPU, MIB, 512,
                         _no_runner) == 300
    assert num_kv_blocks(EngineConfig(max_num_seqs=64, num_kv_blocks=5), CPU, MIB, 512, _no_runner) == 5  # exact


def test_a_budget_below_one_sequence_is_refused_naming_the_flag():
    cfg = EngineConfig(kv_cache_memory_bytes=10 * MIB, block_size=16)
    assert num_kv_blocks(cfg, CPU, MIB, 160, _no_runner) == 10  # exactly one sequence of 160 tokens
    with pytest.raises(StartupError) as err:
        num_kv_blocks(cfg, CPU, MIB, 161, _no_runner)
    assert str(err.value) == ("--kv-cache-memory 0.009766 GiB holds 160 tokens of KV cache, fewer than one sequence "
                              "of 161 tokens (the context; --max-model-len): raise --kv-cache-memory to at least "
                              "0.0107 (GiB) or lower --max-model-len")
    with pytest.raises(StartupError, match=r"^the CPU's default KV pool \(1 GiB at most\) holds 16384 tokens"):
        num_kv_blocks(EngineConfig(block_size=16), CPU, 1 << 20, 20000, _no_runner)


def test_the_engine_sizes_its_pool_from_the_configuration(tmp_path):
    model_dir = make_hf_model_dir(tmp_path, "llama")  # context 512
    engine = EngineCore(EngineConfig(model=str(model_dir), device="cpu", kv_cache_dtype="fp32", max_num_seqs=3,
                                    block_size=16, max_model_len=200))
    assert engine.block_manager.num_total_blocks == 3 * 13
    with pytest.raises(StartupError, match="^--kv-cache-memory"):
        EngineCore(EngineConfig(model=str(model_dir), device="cpu", kv_cache_dtype="fp32", kv_cache_memory_bytes=1024))
