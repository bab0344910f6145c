"""`pie train` as its user meets it: --help, a plain install (no `datasets`), messages on stderr."""

import argparse
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pie.model.loader import load_model
from pie.service.cli import HelpFormatter, main
from pie.training.cli import add_train_parser, schedule_warning
from pie.training.train import TrainConfig
from tests.helpers import help_problems, wait_until

ROOT = Path(__file__).resolve().parents[2]

# A model that trains in well under a second on the CPU (its vocabulary: a 300-token BPE, rounded up).
TINY = ["--vocab-size", "300", "--hidden-size", "32", "--num-layers", "1", "--num-heads", "2", "--num-kv-heads", "1",
        "--intermediate-size", "64", "--max-seq-len", "32", "--seq-len", "16", "--batch-size", "4",
        "--eval-steps", "1", "--no-progress"]


def _train_parser(formatter_class: type[argparse.HelpFormatter]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pie")
    add_train_parser(parser.add_subparsers(dest="command"), formatter_class=formatter_class)
    return parser


def test_every_flag_has_a_description_and_its_default_once():
    parser = _train_parser(HelpFormatter)
    assert help_problems(parser) == []
    train = parser._subparsers._group_actions[0].choices["train"]  # type: ignore[union-attr]
    assert train.formatter_class is HelpFormatter
    text = " ".join(train.format_help().split())
    for shown in ("--eval-fraction EVAL_FRACTION share of the documents held out for eval when there is no other "
                  "eval data (default: 0.01)", "(default: --max-steps)", "(default: all of them)",
                  "--progress, --no-progress progress lines on stderr", "(default: on)", "(default: off)"):
        assert shown in text
    # The check can fail: argparse's plain formatter shows no defaults at all.
    assert any("default shown 0 times" in p for p in help_problems(_train_parser(argparse.HelpFormatter)))


@pytest.mark.slow
def test_plain_install_trains_on_a_generated_corpus_and_exports(tmp_path):
    """`pip install -e .` brings neither `datasets` nor pyarrow (nor transformers or pandas): importing
    them fails in this child, as it would there."""
    block = ("import runpy, sys; sys.modules.update(dict.fromkeys(['datasets', 'pyarrow', 'transformers', 'pandas']));"
             " runpy.run_module('pie.service.cli', run_name='__main__')")
    cmd = [sys.executable, "-c", block, "train", "--generate-corpus", "60", "--out", str(tmp_path / "run"),
           "--export", str(tmp_path / "model"), *TINY, "--max-steps", "4", "--warmup-steps", "1"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "exported to" in proc.stderr and (tmp_path / "model" / "model.safetensors").is_file()
    assert sorted(p.name for p in (tmp_path / "run" / "corpus").iterdir()) == ["eval.txt", "train-00000.txt"]


def test_hub_data_without_datasets_says_what_to_install(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "datasets", None)
    code = main(["train", "--data", "roneneldan/TinyStories", "--out", str(tmp_path / "run"), *TINY])
    err = capsys.readouterr().err
    assert code == 2
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert err.startswith("pie train: loading the hub dataset 'roneneldan/TinyStories' needs the `datasets` package, "
                          "which a plain install leaves out (")
    assert err.endswith("): pip install -e '.[train]' in a checkout, or pip install 'pie[train]'\n")


def test_hub_data_offline_says_how_to_train_offline(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code = main(["train", "--data", "roneneldan/TinyStories", "--out", str(tmp_path / "run"), *TINY])
    err = capsys.readouterr().err
    assert code == 2 and len(err.splitlines()) == 1
    assert err.startswith("pie train: cannot load hub dataset 'roneneldan/TinyStories': HF_HUB_OFFLINE is set; ")
    assert "--data PATH" in err and "--generate-corpus N" in err


def test_warmup_not_below_max_steps_warns_before_any_work(tmp_path, capsys):
    code = main(["train", "--generate-corpus", "40", "--out", str(tmp_path / "run"), *TINY,
                 "--max-steps", "3", "--warmup-steps", "4", "--lr", "0.002"])
    err = capsys.readouterr().err.splitlines()
    assert code == 0
    warning = ("pie train: warning: --warmup-steps 4 >= --max-steps 3: the learning rate warms up for the whole run "
               "(it ends at 0.0015, --lr is 0.002) and never decays; lower --warmup-steps (e.g. to 1) or raise "
               "--max-steps")
    assert err[0] == warning and err.count(warning) == 1


@pytest.mark.parametrize(("warmup", "max_steps", "ends_at"), [(99, 100, None), (100, 100, "0.001"),
                                                               (500, 100, "0.0002")])
def test_schedule_warning_names_the_numbers_and_the_fix(warmup, max_steps, ends_at):
    warning = schedule_warning(TrainConfig(warmup_steps=warmup, max_steps=max_steps, lr=1e-3))
    if ends_at is None:
        assert warning is None
    else:
        assert warning == (f"--warmup-steps {warmup} >= --max-steps {max_steps}: the learning rate warms up for the "
                           f"whole run (it ends at {ends_at}, --lr is 0.001) and never decays; lower --warmup-steps "
                           "(e.g. to 10) or raise --max-steps")


@pytest.mark.slow
@pytest.mark.parametrize(("sig", "code"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_saves_a_checkpoint_and_exports_what_the_run_has(tmp_path, sig, code):
    """A run of 100k steps, stopped by SIGTERM (a supervisor) or SIGINT (Ctrl-C) once it trains:
    the step under way ends, the checkpoint holds it, the export serves it, and --resume continues."""
    run_dir, export = tmp_path / "run", tmp_path / "model"
    cmd = [sys.executable, "-m", "pie.service.cli", "train", "--generate-corpus", "60", "--out", str(run_dir),
           "--export", str(export), *TINY, "--max-steps", "100000", "--warmup-steps", "1", "--log-every", "1"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'clients'}"}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
    try:
        metrics = run_dir / "metrics.jsonl"
        wait_until(lambda: metrics.is_file() and '"loss"' in metrics.read_text(), timeout=120,
                   what="the run to log a training step")
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == code, err
    assert "Traceback" not in err
    step = torch.load(run_dir / "checkpoint.pt", weights_only=False)["step"]
    assert 0 < step < 100000
    lines = err.splitlines()
    assert f"pie train: {sig.name}: stopping after this step, then saving a checkpoint (and the export); send it " \
           "again to quit at once" in lines
    assert lines[-3:] == [f"exporting step {step} to {export} (bf16)", f"exported to {export}",
                          f"pie train: stopped by {sig.name} at step {step} of 100000; the run continues with: "
                          f"pie train ... --out {run_dir} --resume"]
    model, config = load_model(export)
    assert config.vocab_size % 64 == 0 and sum(p.numel() for p in model.parameters()) > 0
    resumed = main(["train", "--generate-corpus", "60", "--out", str(run_dir), *TINY,
                    "--max-steps", str(step + 2), "--warmup-steps", "1", "--resume"])
    assert resumed == 0
    assert torch.load(run_dir / "checkpoint.pt", weights_only=False)["step"] == step + 2
