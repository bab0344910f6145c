"""Tensor parallelism of the model alone (model/parallel.py, the sharded loader): N processes on
the CPU with gloo, each loading only its slices, produce the full model's logits, for the four
families with grouped-query attention, including more ranks than KV heads (replicated KV heads)."""

from __future__ import annotations

import os
import socket
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pie.model.attention import DenseCausalAttention
from pie.model.loader import load_model
from pie.model.parallel import TensorParallel, check_shardable, kv_heads, local_config, q_heads
from tests.helpers import make_hf_model_dir


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, size: int, port: int, model_dir: str, ids: list[int], lens: list[int], out: str,
               device: str) -> None:
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
        model, _ = load_model(model_dir, device=torch.device(device), tp=TensorParallel(rank, size))
        if device == "cuda":  # the Triton RMSNorm, SiLU-and-mul and rotary kernels on each rank's shapes
            from pie.kernels import triton_fused

            model.use_fused_ops(triton_fused)
        positions = torch.cat([torch.arange(n) for n in lens]).to(device)
        with torch.inference_mode():
            hidden = model(torch.tensor(ids, device=device), positions, DenseCausalAttention(lens, model.attn_scale))
            logits = model.compute_logits(hidden)
        torch.save(logits.cpu(), f"{out}.{rank}")
        dist.barrier()  # every rank's logits are saved
    except BaseException:
        Path(f"{out}.{rank}.error").write_text(traceback.format_exc())
        raise
    # Not destroy_process_group: gloo's teardown racing a peer's exit aborted a rank now and then
    # ("terminate called without an active exception"); the results are on disk, so leave at once.
    os._exit(0)


def sharded_logits(model_dir: Path, size: int, ids: list[int], lens: list[int], tmp: Path,
                   device: str = "cpu") -> list[torch.Tensor]:
    out = str(tmp / "logits")
    try:
        mp.start_processes(_rank_main, args=(size, _free_port(), str(model_dir), ids, lens, out, device),
                           nprocs=size, start_method="spawn")
    except mp.ProcessRaisedException as e:
        errors = [p.read_text() for p in tmp.glob("logits.*.error")]
        raise AssertionError("\n".join(errors) or str(e)) from e
    return [torch.load(f"{out}.{r}") for r in range(size)]


def full_logits(model_dir: Path, rng) -> tuple[list[int], list[int], torch.Tensor]:
    """Three random packed sequences and the whole (unsharded) model's fp32 logits for them."""
    full, cfg = load_model(model_dir)
    lens = [rng.randint(1, 12) for _ in range(3)]
    ids = [rng.randrange(3, cfg.vocab_size) for _ in range(sum(lens))]
    positions = torch.cat([torch.arange(n) for n in lens])
    with torch.inference_mode():
        want = full.compute_logits(full(torch.tensor(ids), positions, DenseCausalAttention(lens, full.attn_scale)))
    return ids, lens, want


CASES = [  # (arch, overrides, size): GQA everywhere; size 4 > 2 KV heads replicates them (Llama's
    # with a prime vocabulary, which pads the last rank's embedding and LM head rows, tied or not)
    ("llama", {}, 2), ("mistral", {}, 2), ("qwen2", {}, 2), ("qwen2", {}, 4),
    ("qwen3", {}, 2), ("llama", {"num_key_value_heads": 1}, 2),
    ("llama", {"vocab_size": 509}, 4), ("qwen2", {"vocab_size": 509, "tie_word_embeddings": True}, 2),
]


@pytest.mark.slow
@pytest.mark.parametrize("arch, overrides, size", CASES, ids=[f"{a}-{o or ''}-tp{n}" for a, o, n in CASES])
def test_sharded_model_gives_the_full_logits(rng, tmp_path, arch, overrides, size) -> None:
    model_dir = make_hf_model_dir(tmp_path, arch, weight_scale=2.0, **overrides)
    ids, lens, want = full_logits(model_dir, rng)
    for rank, got in enumerate(sharded_logits(model_dir, size, ids, lens, tmp_path)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=f"rank {rank}")


@pytest.mark.slow
@pytest.mark.gpu
@pytest.mark.parametrize("overrides", [{}, {"num_key_value_heads": 1}], ids=["gqa", "kv1"])
def test_sharded_model_on_one_gpu(rng, tmp_path, overrides) -> None:
    """Two ranks on one GPU (gloo all-reduces CUDA tensors; NCCL would need a GPU per rank): the
    sharded layers with the Triton fused kernels give the full model's fp32 logits."""
    model_dir = make_hf_model_dir(tmp_path, "llama", weight_scale=2.0, head_dim=64, **overrides)
    ids, lens, want = full_logits(model_dir, rng)
    for rank, got in enumerate(sharded_logits(model_dir, 2, ids, lens, tmp_path, device="cuda")):
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3, msg=f"rank {rank}")


def test_head_assignment() -> None:
    from pie.model.config import ModelConfig

    cfg = ModelConfig.from_hf({"model_type": "llama", "architectures": ["X"], "vocab_size": 8, "hidden_size": 64,
                               "intermediate_size": 96, "num_hidden_layers": 1, "num_attention_heads": 8,
                               "num_key_value_heads": 2, "max_position_embeddings": 16})
    # 4 ranks, 2 KV heads: ranks 0, 1 share KV head 0 (query heads 0-3), ranks 2, 3 head 1
    assert [list(q_heads(cfg, TensorParallel(r, 4))) for r in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert [list(kv_heads(cfg, TensorParallel(r, 4))) for r in range(4)] == [[0], [0], [1], [1]]
    assert [list(kv_heads(cfg, TensorParallel(r, 2))) for r in range(2)] == [[0], [1]]
    local = local_config(cfg, TensorParallel(1, 4))
    assert (local.num_attention_heads, local.num_key_value_heads, local.intermediate_size) == (2, 1, 24)
    with pytest.raises(ValueError, match="num_attention_heads 8 is not a multiple of 3"):
        check_shardable(cfg, 3)
    with pytest.raises(ValueError, match="intermediate_size 96 is not a multiple of 64"):
        check_shardable(cfg, 64)
