"""LoRA adapters (model/lora.py) against transformers + peft, fp32: one packed batch mixing base
rows and four adapters (ranks 8, 16, 64; different target sets, rsLoRA, an alpha pattern), each
sequence's logits equal to peft's model with that adapter alone; and every adapter peft writes that
the slots cannot serve is refused with its name."""

from __future__ import annotations

import dataclasses
import json
from functools import partial
from pathlib import Path

import pytest
import torch

from pie.kernels.triton_lora import lora_delta_, lora_delta_reference_
from pie.model.loader import load_model
from pie.model.lora import AdapterError, LoraBank, load_peft_adapter
from tests.helpers import save_peft_adapter
from tests.model.oracle import TOLERANCE, hf_logits, packed_logits, prompts, rel_error

peft = pytest.importorskip("peft")

# name -> LoraConfig arguments
ADAPTERS = {
    "qv8": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
    "attn16-rs": dict(r=16, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], use_rslora=True),
    "mlp64": dict(r=64, lora_alpha=32, target_modules=["gate_proj", "up_proj", "down_proj"]),
    "all8-pattern": dict(r=8, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                             "up_proj", "down_proj"],
                         alpha_pattern={"down_proj": 32}),
}
CASES = ["llama", "llama-bias", "mistral", "qwen2", "qwen3"]


def _fresh_hf(folder: Path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def adapters(model_dir, tmp_path_factory):
    """adapters(case) -> {name: folder} of ADAPTERS for that case's base model."""
    built: dict[str, dict[str, Path]] = {}

    def get(case: str) -> dict[str, Path]:
        if case not in built:
            root = tmp_path_factory.mktemp(f"lora-{case}")
            built[case] = {name: save_peft_adapter(model_dir(case), root / name, seed=i, scale=4.0, **conf)
                           for i, (name, conf) in enumerate(ADAPTERS.items())}
        return built[case]

    return get


def _peft_logits(base_dir: Path, adapter_dir: Path, ids: list[torch.Tensor]) -> torch.Tensor:
    model = peft.PeftModel.from_pretrained(_fresh_hf(base_dir), adapter_dir).eval()
    return hf_logits(model, ids)


# every family through the torch twin; the Triton kernels (in the interpreter here: slow) on two;
# the library-GEMM path (shrink="masked", its B banks wide) on two
@pytest.mark.parametrize(("case", "ops"), [(c, "reference") for c in CASES] + [("llama-bias", "triton"),
                                                                              ("qwen3", "triton"),
                                                                              ("llama-bias", "masked"),
                                                                              ("qwen2", "masked")])
def test_mixed_batch_matches_peft(case, ops, model_dir, hf_model, adapters):
    folders = adapters(case)
    model, cfg = load_model(model_dir(case))
    bank = LoraBank(cfg, num_slots=len(folders), max_rank=64, dtype=torch.float32, device="cpu", max_tokens=64,
                    wide_b=ops == "masked")
    names = list(folders)
    for slot, name in enumerate(names):
        bank.write(slot, load_peft_adapter(name, folders[name], cfg, max_rank=64))
    kernels = {"reference": lora_delta_reference_, "triton": lora_delta_,
               "masked": partial(lora_delta_, shrink="masked")}
    bank.attach(model, kernels[ops])
    # sequences: base, each adapter, base, the first adapter again (rows of one slot apart)
    seq_slots = [-1, 0, 1, 2, 3, -1, 0]
    ids = prompts(cfg.vocab_size, lens=(5, 9, 7, 6, 11, 4, 8), seed=3)
    slots = torch.cat([torch.full((len(x),), s, dtype=torch.int32) for x, s in zip(ids, seq_slots, strict=True)])
    bank.step.buffer[:slots.numel()] = slots
    ours = packed_logits(model, ids)
    starts = [0]
    for x in ids:
        starts.append(starts[-1] + len(x))
    base = hf_logits(hf_model(case), ids)
    for i, s in enumerate(seq_slots):
        rows = slice(starts[i], starts[i + 1])
        want = base[rows] if s < 0 else _peft_logits(model_dir(case), folders[names[s]], [ids[i]])
        assert rel_error(ours[rows], want) <= TOLERANCE, (case, i, s)
        if s >= 0:  # the adapter moves the logits: the comparison above can fail
            assert rel_error(base[rows], want) > 100 * TOLERANCE, (case, names[s])


@pytest.mark.parametrize("case", ["llama", "qwen3"])
def test_kv_smoothing_folds_into_adapters(case, model_dir, adapters):
    """K/V smoothing (model/smoothing.py) divides K and V channels in the base weights; an
    adapter written after it is folded alike, so the adapted model still equals peft's."""
    from pie.model import smoothing

    folders = adapters(case)
    model, cfg = load_model(model_dir(case))
    gen = torch.Generator().manual_seed(5)

    def powers(*shape):
        return 2.0 ** torch.randint(-3, 4, shape, generator=gen).float()

    k = [powers(cfg.num_key_value_heads, cfg.head_dim // 2).repeat(1, 2) for _ in range(cfg.num_hidden_layers)]
    if cfg.qk_norm:  # shared by the heads (the norms are)
        k = [t[:1].expand(cfg.num_key_value_heads, -1).clone() for t in k]
    v = [powers(cfg.num_key_value_heads, cfg.head_dim) for _ in range(cfg.num_hidden_layers)]
    smoothing.fold(model, smoothing.KVSmoothing(k, v))
    bank = LoraBank(cfg, num_slots=1, max_rank=64, dtype=torch.float32, device="cpu", max_tokens=64)
    bank.fold_smoothing(k, v)
    bank.write(0, load_peft_adapter("all8-pattern", folders["all8-pattern"], cfg, max_rank=64))
    bank.attach(model, lora_delta_reference_)
    ids = prompts(cfg.vocab_size, lens=(9,), seed=4)
    bank.step.buffer.fill_(0)
    want = _peft_logits(model_dir(case), folders["all8-pattern"], ids)
    assert rel_error(packed_logits(model, ids), want) <= TOLERANCE


def test_no_slots_is_the_base_model(model_dir, hf_model, adapters):
    folders = adapters("llama")
    model, cfg = load_model(model_dir("llama"))
    bank = LoraBank(cfg, num_slots=1, max_rank=64, dtype=torch.float32, device="cpu", max_tokens=64)
    bank.write(0, load_peft_adapter("qv8", folders["qv8"], cfg, max_rank=64))
    bank.attach(model, lora_delta_reference_)
    ids = prompts(cfg.vocab_size)
    assert rel_error(packed_logits(model, ids), hf_logits(hf_model("llama"), ids)) <= TOLERANCE
    bank.clear(0)
    bank.step.buffer.fill_(0)  # every row on the cleared slot: zeros, the base model
    assert rel_error(packed_logits(model, ids), hf_logits(hf_model("llama"), ids)) <= TOLERANCE


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_refusals_name_the_adapter(model_dir, adapters, tmp_path):
    from pie.model.config import ModelConfig

    cfg = ModelConfig.from_hf(model_dir("llama") / "config.json")
    good = adapters("llama")["mlp64"]

    def refused(folder, match, max_rank=64):
        with pytest.raises(AdapterError, match=match) as info:
            load_peft_adapter("bad", folder, cfg, max_rank=max_rank)
        assert info.value.adapter == "bad" and str(info.value).startswith("adapter 'bad': ")

    refused(good, "rank 64 is above the server's --max-lora-rank 16", max_rank=16)
    refused(tmp_path / "missing", "no adapter_config.json")
    corrupt = _copy(good, tmp_path / "corrupt")
    data = (corrupt / "adapter_model.safetensors").read_bytes()
    (corrupt / "adapter_model.safetensors").write_bytes(data[: len(data) // 2])
    refused(corrupt, "adapter_model.safetensors unreadable")
    wider = dataclasses.replace(cfg, intermediate_size=2 * cfg.intermediate_size)  # another base model
    with pytest.raises(AdapterError, match=r"do not fit this model .*another base model\?"):
        load_peft_adapter("bad", good, wider, max_rank=64)
    dora = _copy(good, tmp_path / "dora")
    conf = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**conf, "use_dora": True}))
    refused(dora, "DoRA is not supported")
    embed = _copy(good, tmp_path / "embed")
    conf = json.loads((embed / "adapter_config.json").read_text())
    (embed / "adapter_config.json").write_text(json.dumps({**conf, "modules_to_save": ["lm_head"]}))
    refused(embed, "modules_to_save")


def test_unsupported_target_module(model_dir, tmp_path):
    from safetensors.torch import save_file

    from pie.model.config import ModelConfig

    cfg = ModelConfig.from_hf(model_dir("llama") / "config.json")
    folder = tmp_path / "embed-lora"
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 4}))
    save_file({"base_model.model.model.layers.0.self_attn.rotary.lora_A.weight": torch.zeros(4, 8),
               "base_model.model.model.layers.0.self_attn.rotary.lora_B.weight": torch.zeros(8, 4)},
              str(folder / "adapter_model.safetensors"))
    with pytest.raises(AdapterError, match="target module 'rotary' is not supported"):
        load_peft_adapter("emb", folder, cfg, max_rank=8)


def test_bank_bytes_match_its_tensors(model_dir):
    from pie.model.config import ModelConfig

    cfg = ModelConfig.from_hf(model_dir("qwen2") / "config.json")
    bank = LoraBank(cfg, num_slots=3, max_rank=16, dtype=torch.float16, device="cpu", max_tokens=8)
    held = sum(t.numel() * t.element_size() for layer in bank.banks for pair in layer.values() for t in pair)
    assert LoraBank.nbytes(cfg, 3, 16, torch.float16) == held
