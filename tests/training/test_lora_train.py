"""`pie train --lora BASE`: an adapter fine-tuned on local text with the base frozen, exported in
PEFT's format; transformers + peft load it and compute what our model with the trained adapter
computes, and `pie serve` loads it (the round trip train -> serve without other tools)."""

from __future__ import annotations

import json

import pytest
import torch

from pie.model.loader import load_model
from pie.model.lora import LoraBank, load_peft_adapter
from pie.service.cli import main
from pie.training.lora import LoraTraining
from tests.helpers import make_hf_model_dir
from tests.model.oracle import hf_logits, packed_logits, prompts, rel_error

peft = pytest.importorskip("peft")

STORY = ("Tom had a red ball. He threw the ball to Sue. Sue caught the ball and laughed. "
         "They played in the park until the sun went down.\n")


def test_train_export_load_serve(tmp_path, capsys):
    import transformers

    from pie.kernels.triton_lora import lora_delta_reference_

    base = make_hf_model_dir(tmp_path, "llama", seed=3, weight_scale=2.5)
    data = tmp_path / "stories.txt"
    data.write_text(STORY * 40)
    out = tmp_path / "adapter"
    code = main(["train", "--lora", str(base), "--data", str(data), "--out", str(tmp_path / "run"), "--export",
                 str(out), "--lora-rank", "4", "--lora-alpha", "8", "--lora-targets", "q_proj,v_proj,down_proj",
                 "--max-steps", "6", "--warmup-steps", "1", "--batch-size", "4", "--seq-len", "16", "--lr", "0.01",
                 "--eval-steps", "1", "--no-progress", "--device", "cpu", "--txt-mode", "line"])
    assert code == 0, capsys.readouterr().err
    conf = json.loads((out / "adapter_config.json").read_text())
    assert conf["r"] == 4 and conf["lora_alpha"] == 8 and conf["target_modules"] == ["down_proj", "q_proj", "v_proj"]

    model, cfg = load_model(base)
    adapter = load_peft_adapter("trained", out, cfg, max_rank=8)
    assert all(float(b.abs().max()) > 0 for _, b in adapter.weights.values())  # B left zero: nothing trained
    bank = LoraBank(cfg, num_slots=1, max_rank=8, dtype=torch.float32, device="cpu", max_tokens=64)
    bank.write(0, adapter)
    bank.attach(model, lora_delta_reference_)
    bank.step.buffer.fill_(0)
    ids = prompts(cfg.vocab_size, lens=(7, 12), seed=1)
    hf = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                                        out).eval()
    want = hf_logits(hf, ids)
    assert rel_error(packed_logits(model, ids), want) <= 1e-4
    plain = hf_logits(transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval(), ids)
    assert rel_error(plain, want) > 1e-3  # the adapter changed the model


def test_training_changes_only_the_adapter(tmp_path):
    base = make_hf_model_dir(tmp_path, "qwen3", seed=4)
    model, _ = load_model(base)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    lora = LoraTraining(model, ("q_proj", "k_proj", "up_proj"), rank=2, alpha=4.0)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    x = torch.randint(3, 100, (2, 9))
    for _ in range(2):
        loss = model.forward_train(x).float().logsumexp(-1).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    after = dict(model.named_parameters())
    assert all(torch.equal(before[n], after[n]) for n in before)  # the base is frozen
    assert any(float(b.detach().abs().max()) > 0 for b in lora.b.values())
    with pytest.raises(ValueError, match="--lora-targets"):
        LoraTraining(model, ("embed_tokens",), rank=2, alpha=4.0)
