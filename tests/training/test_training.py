"""Training branch on the CPU: data loading, BPE tokenizer, loop, resume, export parity, CLI."""

import io
import json
import math
import os
import re
import stat
import subprocess
import sys
import threading
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from pie.model.attention import DenseCausalAttention
from pie.model.loader import load_model
from pie.model.tokenizer import Tokenizer
from pie.training.data import iter_texts, prepare_tokens
from pie.training.documents import STORY_SEPARATOR, load_documents
from pie.training.export import export_hf
from pie.training.plot import PNG_SIGNATURE
from pie.training.tokenizer import BOS_ID, EOS_ID, PAD_ID, train_bpe_tokenizer
from pie.training.train import TrainConfig, _Progress, build_model, format_duration, train

_WORDS = ("once upon a time there was a little cat named Tom . she liked to play in the big park with "
          "her red ball . one day Lily saw a dog and they were happy friends").split()


def _stories(n: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(_WORDS, size=int(rng.integers(20, 60)))) + "\nThe end." for _ in range(n)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict:
    """Hand-written story files (training.corpus is exercised by its own tests)."""
    root = tmp_path_factory.mktemp("corpus")
    train_file, eval_file = root / "train.txt", root / "eval.txt"
    train_file.write_text(STORY_SEPARATOR.join(_stories(300, 0)))
    eval_file.write_text(STORY_SEPARATOR.join(_stories(30, 1)))
    return {"train": train_file, "eval": eval_file, "root": root}


@pytest.fixture(scope="module")
def tokenized(corpus, tmp_path_factory):
    tok_dir = tmp_path_factory.mktemp("tok")
    train_docs = load_documents(str(corpus["train"]))
    tok = train_bpe_tokenizer(iter_texts(train_docs), 320, tok_dir)
    splits = prepare_tokens(train_docs, tok, eos_id=EOS_ID, eval_docs=load_documents(str(corpus["eval"])))
    return tok, tok_dir / "tokenizer.json", splits


def _tiny(out_dir, **kw) -> TrainConfig:
    base = dict(vocab_size=320, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128,
                max_seq_len=64, batch_size=8, seq_len=32, lr=3e-3, min_lr=3e-4, warmup_steps=5, max_steps=30,
                eval_every=0, eval_steps=4, save_every=0, log_every=5, out_dir=str(out_dir), progress=False)
    base.update(kw)
    return TrainConfig(**base)


def test_tokenizer_round_trip_and_specials(tokenized):
    tok, _, _ = tokenized
    assert [tok.token_to_id(t) for t in ("<pad>", "<s>", "</s>")] == [PAD_ID, BOS_ID, EOS_ID]
    for text in ["  leading and trailing  ", "Tom said: \"héllo, wörld\" 😀 — 日本語\n\tend ", "", " ", "\n\n"]:
        ids = tok.encode(text).ids
        assert ids[0] == BOS_ID
        assert tok.decode(ids) == text


def test_token_stream_has_bos_doc_eos(tokenized):
    tok, _, splits = tokenized
    stream = splits.train
    assert stream.dtype == np.uint16 and stream[0] == BOS_ID and stream[-1] == EOS_ID
    n_docs = 300
    assert (stream == EOS_ID).sum() == n_docs and (stream == BOS_ID).sum() == n_docs
    first_doc = stream[1:int(np.argmax(stream == EOS_ID))]
    assert tok.decode(first_doc.tolist()).endswith("\nThe end.")


def test_training_lowers_eval_loss_and_writes_metrics_and_png(tokenized, tmp_path):
    _, _, splits = tokenized
    result = train(_tiny(tmp_path), splits)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval_loss" in r]
    assert evals[0]["step"] == 0 and evals[-1]["step"] == 30
    assert evals[0]["eval_loss"] > math.log(320) - 0.5  # starts near uniform
    assert evals[-1]["eval_loss"] < evals[0]["eval_loss"] - 1.0
    assert sum("loss" in r for r in rows) == 30 // 5
    assert result["step"] == 30 and result["eval_loss"] == evals[-1]["eval_loss"]
    assert result["plot"].read_bytes().startswith(PNG_SIGNATURE)
    assert (tmp_path / "checkpoint.pt").is_file()


_PROGRESS = re.compile(r"\[([#.]{24})\] (\d+)/(\d+) loss (\d+\.\d{4}) ([\d,]+) tok/s lr (\d\.\d\de-\d\d) "
                       r"eta (\d+s|\d+m\d\ds|\d+h\d\dm)")


def test_progress_lines_show_tokens_per_s_and_time_left(tokenized, tmp_path, capsys):
    _, _, splits = tokenized
    train(_tiny(tmp_path, max_steps=12, log_every=4, eval_every=6, progress=True), splits)
    err = capsys.readouterr().err
    assert "\r" not in err  # not a terminal: whole lines, one per update
    lines = [line for line in err.splitlines() if line.startswith("[")]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in rows if "loss" in r]
    assert len(lines) == len(logged) == 3
    for line, row in zip(lines, logged):
        m = _PROGRESS.fullmatch(line)
        assert m, line
        bar, step, total, loss, tok_s, lr, eta = m.groups()
        assert (int(step), int(total)) == (row["step"], 12) and bar.count("#") == 24 * row["step"] // 12
        assert float(loss) == pytest.approx(row["loss"], abs=1e-4) and float(lr) == pytest.approx(row["lr"], rel=1e-2)
        assert int(tok_s.replace(",", "")) == round(row["tokens_per_s"])
    assert sum("eval loss" in line for line in err.splitlines()) == 3  # steps 0, 6, 12
    # each eval pass and the checkpoint say when they begin (the final eval is minutes on a big model)
    assert [line for line in err.splitlines() if "evaluating" in line] == [
        f"step {s}: evaluating on 4 batches" for s in (0, 6, 12)]
    assert err.splitlines()[-2:] == ["step 12: saving the checkpoint (the last step)",
                                     f"step 12: checkpoint saved to {tmp_path / 'checkpoint.pt'}"]


def test_tokens_per_s_leave_out_evals_and_the_time_left_counts_them(tokenized, tmp_path, monkeypatch, capsys):
    """On a fake clock every batch drawn takes 0.5 s and every eval pass 1000 s more (1002 s with
    its 4 batches). The time left is the steps left at the mean training time per step, plus the
    eval passes left (the final one included) at the mean pass: at 12/12 the final eval is left."""
    import pie.training.train as train_module

    _, _, splits = tokenized
    clock = [0.0]
    real_get_batch, real_evaluate = train_module.get_batch, train_module.evaluate

    def get_batch(*args, **kwargs):
        clock[0] += 0.5
        return real_get_batch(*args, **kwargs)

    def evaluate(*args, **kwargs):
        clock[0] += 1000
        return real_evaluate(*args, **kwargs)

    monkeypatch.setattr(train_module, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    monkeypatch.setattr(train_module, "get_batch", get_batch)
    monkeypatch.setattr(train_module, "evaluate", evaluate)
    train(_tiny(tmp_path, max_steps=12, log_every=4, eval_every=6, eval_steps=4, progress=True), splits)
    logged = [r for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert [r["tokens_per_s"] for r in logged] == [8 * 32 / 0.5] * 3  # the eval at step 6 (1002 s) left out
    assert [r["elapsed_s"] for r in logged] == [2, 2 + 1 + 1002 + 1, 1006 + 2]
    etas = [line.rsplit(" eta ", 1)[1] for line in capsys.readouterr().err.splitlines() if line.startswith("[")]
    # 8 steps x 0.5 s + evals at 6 and 12; 4 x 0.5 s + the eval at 12; the eval at 12
    assert etas == [format_duration(4 + 2 * 1002), format_duration(2 + 1002), format_duration(1002)]
    assert etas == ["33m28s", "16m44s", "16m42s"]


def test_progress_rewrites_one_line_on_a_terminal():
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    term = Terminal()
    progress = _Progress(True, 100, term)
    progress.update(10, 5.0, 123_456.0, 1e-3, 4000.0)
    progress.update(20, 4.0, 9.0, 1e-3, 65.0)
    progress.note("eval")
    progress.update(30, 3.5, 9.0, 1e-3, 5.0)
    progress.close()
    first = "[##......................] 10/100 loss 5.0000 123,456 tok/s lr 1.00e-03 eta 1h06m"
    second = "[####....................] 20/100 loss 4.0000 9 tok/s lr 1.00e-03 eta 1m05s"
    third = "[#######.................] 30/100 loss 3.5000 9 tok/s lr 1.00e-03 eta 5s"
    assert term.getvalue() == (f"\r{first}\r{second.ljust(len(first))}\r{'eval'.ljust(len(second))}\n"
                               f"\r{third}\n")


def test_format_duration():
    assert [format_duration(s) for s in (0, 0.4, 59.4, 60, 3599, 3600, 7322, float("inf"))] == \
        ["0s", "0s", "59s", "1m00s", "59m59s", "1h00m", "2h02m", "?"]


def test_exported_files_all_get_the_mode_a_new_file_gets(tokenized, tmp_path):
    _, tok_file, _ = tokenized
    cfg = _tiny(tmp_path / "run")
    model = build_model(cfg, torch.device("cpu"))
    old = os.umask(0o027)
    try:
        (tmp_path / "plain").write_text("x")
        out = export_hf(model, cfg, tok_file, tmp_path / "model", dtype=torch.float32)
        files = sorted(out.iterdir())
        assert [f.name for f in files] == ["config.json", "generation_config.json", "model.safetensors",
                                           "tokenizer.json", "tokenizer_config.json"]
        plain = stat.S_IMODE((tmp_path / "plain").stat().st_mode)
        assert plain == 0o640
        assert {f.name: stat.S_IMODE(f.stat().st_mode) for f in files} == {f.name: plain for f in files}
        for f in files:  # a re-export writes new files: what an earlier one left does not stick
            f.chmod(0o600)
        export_hf(model, cfg, tok_file, out, dtype=torch.float32)
        assert {f.name: stat.S_IMODE(f.stat().st_mode) for f in out.iterdir()} == {f.name: plain for f in files}
    finally:
        os.umask(old)


def test_resume_matches_uninterrupted_run(tokenized, tmp_path):
    _, _, splits = tokenized
    full = train(_tiny(tmp_path / "full", max_steps=20), splits)["model"]
    half_dir = tmp_path / "half"
    train(_tiny(half_dir, max_steps=10, lr_decay_steps=20), splits)
    saved = torch.load(half_dir / "checkpoint.pt", weights_only=False)
    assert saved["step"] == 10 and saved["optimizer"]["state"]
    resumed = train(_tiny(half_dir, max_steps=20, resume=True), splits)
    assert resumed["step"] == 20
    steps = [json.loads(line)["step"] for line in (half_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(steps) and 0 in steps and 20 in steps  # one log, continued after step 10
    for (name, a), b in zip(full.state_dict().items(), resumed["model"].state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    # The equality above is not vacuous: other seeds (init and batch order) give other weights.
    fresh = train(_tiny(tmp_path / "fresh", max_steps=10, seed=1), splits)["model"]
    assert not torch.allclose(fresh.embed_tokens.weight, full.embed_tokens.weight)


def test_resume_refuses_other_model_shape(tokenized, tmp_path):
    _, _, splits = tokenized
    train(_tiny(tmp_path, max_steps=2), splits)
    with pytest.raises(ValueError, match="hidden_size"):
        train(_tiny(tmp_path, max_steps=4, hidden_size=32, resume=True), splits)


@pytest.fixture(scope="module")
def exported(tokenized, tmp_path_factory):
    _, tok_file, splits = tokenized
    root = tmp_path_factory.mktemp("export")
    cfg = _tiny(root / "run", max_steps=5, tie_embeddings=False)
    model = train(cfg, splits)["model"]
    tied_cfg = _tiny(root / "run_tied", max_steps=5)
    tied = train(tied_cfg, splits)["model"]
    return {
        "untied": (model, export_hf(model, cfg, tok_file, root / "untied", dtype=torch.float32)),
        "tied": (tied, export_hf(tied, tied_cfg, tok_file, root / "tied", dtype=torch.float32)),
    }


def _our_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        hidden = model(torch.tensor(ids), torch.arange(len(ids)), DenseCausalAttention([len(ids)], model.attn_scale))
        return model.compute_logits(hidden)


@pytest.mark.parametrize("kind", ["untied", "tied"])
def test_export_loads_in_transformers_with_our_logits(exported, kind):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, path = exported[kind]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert hf.config.tie_word_embeddings == (kind == "tied")
    text = "once upon a time Tom saw a dog"
    ids = AutoTokenizer.from_pretrained(path)(text)["input_ids"]
    assert ids[0] == BOS_ID and ids.count(BOS_ID) == 1
    ours = _our_logits(model, ids)
    with torch.no_grad():
        theirs = hf(torch.tensor([ids])).logits[0].float()
    rel = (ours - theirs).abs().max() / theirs.abs().max()
    assert rel <= 1e-4, f"relative error {rel:.2e}"


def test_export_loads_in_our_loader_and_tokenizer(exported):
    model, path = exported["untied"]
    loaded, cfg = load_model(path)
    tok = Tokenizer.from_pretrained(path, cfg)
    assert tok.eos_token_ids == (EOS_ID,) and tok.bos_token_id == BOS_ID
    text = " Lily liked the big red ball. "
    ids = tok.encode(text)
    assert ids[0] == BOS_ID and tok.decode(ids) == text
    torch.testing.assert_close(_our_logits(loaded, ids), _our_logits(model, ids), rtol=0, atol=0)
    gen = json.loads((path / "generation_config.json").read_text())
    assert (gen["bos_token_id"], gen["eos_token_id"], gen["pad_token_id"]) == (BOS_ID, EOS_ID, PAD_ID)


def test_batched_training_forward_matches_serving_forward(exported):
    model, _ = exported["untied"]
    ids = torch.randint(3, 320, (3, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        batched = model.forward_train(ids)
    for row in range(3):
        torch.testing.assert_close(batched[row], _our_logits(model, ids[row].tolist()), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_cli_corpus_to_export(corpus, tmp_path):
    out, export = tmp_path / "run", tmp_path / "model"
    cmd = [sys.executable, "-m", "pie.service.cli", "train", "--data", str(corpus["train"]),
           "--eval-data", str(corpus["eval"]), "--out", str(out), "--export", str(export), "--vocab-size", "300",
           "--hidden-size", "32", "--num-layers", "1", "--num-heads", "2", "--num-kv-heads", "1",
           "--intermediate-size", "64", "--max-seq-len", "64", "--seq-len", "32", "--batch-size", "4",
           "--max-steps", "6", "--warmup-steps", "2", "--eval-every", "3", "--eval-steps", "1", "--no-progress"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert {p.name for p in export.iterdir()} >= {"config.json", "model.safetensors", "tokenizer.json",
                                                  "tokenizer_config.json", "generation_config.json"}
    loaded, cfg = load_model(export)
    assert cfg.vocab_size % 64 == 0 and cfg.vocab_size >= Tokenizer.from_pretrained(export).vocab_size
    # the exported folder serves through the gRPC server, end to end
    from pie.engine.config import EngineConfig
    from pie.service.server import BackgroundServer, ServerConfig
    from pie_client import Client

    with BackgroundServer(ServerConfig(port=0, grace_s=1),
                          EngineConfig(model=str(export), device="cpu", num_kv_blocks=16)) as s, \
            Client(s.address, timeout=60) as c:
        assert c.model_info().architecture == "LlamaForCausalLM"
        out = c.generate("Once upon a time", max_tokens=8, temperature=0, ignore_eos=True)
        assert out.completion_tokens == 8 and out.finish_reason == "length"


def test_save_interval_and_evals_left():
    assert TrainConfig(max_steps=60).save_interval == 6 and TrainConfig(max_steps=5).save_interval == 1
    assert TrainConfig(max_steps=60, save_every=0).save_interval == 0
    assert TrainConfig(max_steps=60, save_every=25).save_interval == 25
    with pytest.raises(ValueError, match="save_every must be >= 0"):
        TrainConfig(save_every=-1)
    cfg = TrainConfig(max_steps=60, eval_every=20)
    assert [cfg.evals_left(s) for s in (1, 19, 20, 21, 40, 41, 60)] == [3, 3, 3, 2, 2, 1, 1]
    odd = TrainConfig(max_steps=50, eval_every=20)  # passes at 20, 40 and the last step, 50
    assert [odd.evals_left(s) for s in (1, 20, 21, 41, 50)] == [3, 3, 2, 1, 1]
    assert TrainConfig(max_steps=60, eval_every=0).evals_left(30) == 1


def _stop_after_batches(monkeypatch, n: int) -> threading.Event:
    """An event set while the n-th batch is drawn (eval batches count too)."""
    import pie.training.train as train_module

    event, drawn, real = threading.Event(), [0], train_module.get_batch

    def get_batch(*args, **kwargs):
        drawn[0] += 1
        if drawn[0] == n:
            event.set()
        return real(*args, **kwargs)

    monkeypatch.setattr(train_module, "get_batch", get_batch)
    return event


def test_a_stop_request_finishes_the_step_saves_it_and_resumes_from_it(tokenized, tmp_path, monkeypatch):
    _, _, splits = tokenized
    stop = _stop_after_batches(monkeypatch, 4 + 7)  # the step-0 eval's 4 batches, then 7 steps
    result = train(_tiny(tmp_path, max_steps=30, save_every=0), splits, stop=stop)
    assert result["interrupted"] and result["step"] == 7
    assert torch.load(tmp_path / "checkpoint.pt", weights_only=False)["step"] == 7
    monkeypatch.undo()
    resumed = train(_tiny(tmp_path, max_steps=30, save_every=0, resume=True), splits)
    assert not resumed["interrupted"] and resumed["step"] == 30


def test_a_stop_during_an_eval_pass_drops_the_pass(tokenized, tmp_path, monkeypatch, capsys):
    _, _, splits = tokenized
    stop = _stop_after_batches(monkeypatch, 4 + 6 + 2)  # in the second batch of the eval pass at step 6
    result = train(_tiny(tmp_path, max_steps=30, eval_every=6, save_every=0, progress=True), splits, stop=stop)
    assert result["interrupted"] and result["step"] == 6
    evals = [r["step"] for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines())
             if "eval_loss" in r]
    assert evals == [0]  # the pass at step 6 was dropped
    err = capsys.readouterr().err.splitlines()
    assert "step 6: eval pass dropped (stopping)" in err and err[-1] == f"step 6: checkpoint saved to " \
        f"{tmp_path / 'checkpoint.pt'}"


def test_a_stop_before_the_first_step_saves_nothing(tokenized, tmp_path):
    _, _, splits = tokenized
    stop = threading.Event()
    stop.set()
    result = train(_tiny(tmp_path, max_steps=30), splits, stop=stop)
    assert result["interrupted"] and result["step"] == 0 and not (tmp_path / "checkpoint.pt").exists()
