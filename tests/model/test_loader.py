"""Weight loading: sharded checkpoints, tying, and errors that name the offending tensor."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from pie.model.loader import load_model, read_generation_config
from tests.helpers import make_hf_model_dir
from tests.model.oracle import TOLERANCE, hf_logits, packed_logits, prompts, rel_error


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _rewrite_weights(path, edit):
    """Applies edit(dict of tensors) to a single-file checkpoint in place."""
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def test_sharded_checkpoint_loads(tmp_path):
    import transformers

    path = make_hf_model_dir(tmp_path, "qwen2", weight_scale=8.0, max_shard_size="40KB")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1 and not (path / "model.safetensors").exists()
    model, cfg = load_model(path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = prompts(cfg.vocab_size, lens=(9, 4))
    assert rel_error(packed_logits(model, ids), hf_logits(hf, ids)) <= TOLERANCE


def test_fused_params_and_tying(model_dir):
    model, cfg = load_model(model_dir("qwen3-tied"))
    assert model.lm_head.weight is model.embed_tokens.weight
    attn = model.layers[0].self_attn
    assert attn.qkv_proj.weight.shape == (cfg.q_size + 2 * cfg.kv_size, cfg.hidden_size)
    assert model.layers[1].mlp.gate_up_proj.weight.shape == (2 * cfg.intermediate_size, cfg.hidden_size)
    assert not any(p.requires_grad or p.is_meta for p in model.parameters())
    assert not model.training


def test_missing_lm_head_ties_embeddings(tmp_path, model_dir):
    path = _copy(model_dir("llama"), tmp_path / "no-head")
    _rewrite_weights(path, lambda t: t.pop("lm_head.weight"))
    model, cfg = load_model(path)
    assert cfg.tie_word_embeddings and model.lm_head.weight is model.embed_tokens.weight


def test_missing_tensor_is_named(tmp_path, model_dir):
    path = _copy(model_dir("qwen3"), tmp_path / "missing")
    _rewrite_weights(path, lambda t: t.pop("model.layers.1.self_attn.k_norm.weight"))
    with pytest.raises(ValueError, match=r"missing tensors: model\.layers\.1\.self_attn\.k_norm\.weight"):
        load_model(path)


def test_unexpected_tensor_is_named(tmp_path, model_dir):
    path = _copy(model_dir("llama"), tmp_path / "extra")
    _rewrite_weights(path, lambda t: t.update({"model.layers.0.mlp.extra.weight": torch.zeros(2)}))
    with pytest.raises(ValueError, match=r"unexpected tensors: model\.layers\.0\.mlp\.extra\.weight"):
        load_model(path)


def test_wrong_shape_is_named(tmp_path, model_dir):
    path = _copy(model_dir("llama"), tmp_path / "shape")
    _rewrite_weights(path, lambda t: t.update({"model.norm.weight": torch.ones(3)}))
    with pytest.raises(ValueError, match=r"model\.norm\.weight has shape \(3,\)"):
        load_model(path)


def test_generation_config(tmp_path):
    path = make_hf_model_dir(tmp_path, "llama", generation_eos=[2, 5])
    assert read_generation_config(path)["eos_token_id"] == [2, 5]
    (path / "generation_config.json").unlink()
    assert read_generation_config(path) == {}


class _CountingFile:
    """A safe_open handle that counts the elements each read returns, by tensor name."""

    def __init__(self, handle, reads: dict[str, int]) -> None:
        self._f, self._reads = handle, reads

    def __enter__(self):
        self._f.__enter__()
        return self

    def __exit__(self, *exc):
        return self._f.__exit__(*exc)

    def keys(self):
        return self._f.keys()

    def get_tensor(self, name):
        t = self._f.get_tensor(name)
        self._reads[name] = self._reads.get(name, 0) + t.numel()
        return t

    def get_slice(self, name):
        part, reads = self._f.get_slice(name), self._reads

        class _Slice:
            def __getitem__(self, index):
                t = part[index]
                reads[name] = reads.get(name, 0) + t.numel()
                return t

        return _Slice()


@pytest.mark.parametrize("size, overrides", [(2, {}), (4, {}), (2, {"num_key_value_heads": 1}),
                                             (2, {"tie_word_embeddings": True})],
                         ids=["tp2", "tp4-kv-replicated", "tp2-kv1", "tp2-tied"])
def test_each_rank_reads_only_its_slices(tmp_path, monkeypatch, size, overrides):
    """Under tensor parallelism a rank reads 1/N of every split tensor from the safetensors file
    (a KV head shared by N/Hkv ranks: that head) and the norms whole, nothing more: counted from
    what the reads return, against the checkpoint's own tensor sizes."""
    import pie.model.loader as loader
    from pie.model.parallel import TensorParallel

    path = make_hf_model_dir(tmp_path, "llama", vocab_size=512, **overrides)  # N divides the vocabulary
    checkpoint = load_file(path / "model.safetensors")
    cfg = json.loads((path / "config.json").read_text())
    kv_share = 1 / min(size, cfg["num_key_value_heads"])  # its 1/N of the KV heads, or the one head it shares

    def expected_share(name: str) -> float:
        if "norm" in name:
            return 1.0
        if "k_proj" in name or "v_proj" in name:
            return kv_share
        return 1 / size  # q/o by heads, gate/up/down by width, embedding and LM head by vocabulary

    opened = loader.safe_open
    for rank in range(size):
        reads: dict[str, int] = {}
        monkeypatch.setattr(loader, "safe_open", lambda *a, reads=reads, **kw: _CountingFile(opened(*a, **kw), reads))
        load_model(path, tp=TensorParallel(rank, size))
        read_names = set(reads)
        want_names = set(checkpoint) - ({"lm_head.weight"} if cfg.get("tie_word_embeddings") else set())
        assert read_names == want_names, f"rank {rank}: read {read_names ^ want_names} unexpectedly"
        for name, n in reads.items():
            assert n == checkpoint[name].numel() * expected_share(name), (rank, name, n, checkpoint[name].shape)
