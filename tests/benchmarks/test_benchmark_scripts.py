"""The command lines of benchmarks/: every flag of every script described with its default shown
once, `--help` working on a CPU-only machine without transformers, the GPU-only scripts
(`NEEDS_GPU = True`) refusing at once with one line and status 2 where no CUDA GPU is visible,
and the README's CPU throughput run working without transformers (a plain `pip install -e .`
has none: it is only in the test extra).

Scripts are what `pie bench` lists: the files of benchmarks/ with a `__main__` block, each run as
`python -m benchmarks.NAME` from the checkout's root. Their subprocesses run side by side (a few at
a time), each loading torch once.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import json
import os
import shutil
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from tests.helpers import help_problems

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"
# What needs a CUDA GPU: the kernel benchmarks. The rest run on the CPU (some with --tiny).
GPU_ONLY = {"attention", "decode_variants", "extend_check", "gemv", "lora_kernels"}
NO_GPU_MESSAGE = "this benchmark needs a CUDA GPU and none is visible"


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), str(path))


def _is_script(tree: ast.Module) -> bool:
    return any(isinstance(node, ast.If) and "__main__" in ast.unparse(node.test) for node in tree.body)


def _needs_gpu(tree: ast.Module) -> bool | None:
    """The module-level `NEEDS_GPU = <literal>` (None where absent), read as the launcher reads it."""
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "NEEDS_GPU" for t in node.targets):
            assert isinstance(node.value, ast.Constant) and isinstance(node.value.value, bool), \
                f"NEEDS_GPU must be a literal True or False (read statically): {ast.unparse(node)}"
            return node.value.value
    return None


SCRIPTS = {p.stem: p for p in sorted(BENCHMARKS.glob("*.py")) if _is_script(_tree(p))}
MARKED_GPU = sorted(name for name, path in SCRIPTS.items() if _needs_gpu(_tree(path)))


def test_scripts_found() -> None:
    assert {"throughput", "mixed", "attention", "decode_variants", "extend_check"} <= SCRIPTS.keys()
    assert "common" not in SCRIPTS  # the shared helpers are no script


def test_benchmarks_no_larger_than_the_engine() -> None:
    """The lab notebook stays smaller than what it measures (issue 60): lines of .py and .sh in
    benchmarks/ at most those of .py in engine/; a one-issue study leaves once no open issue uses
    it (benchmarks/README.md, "Retired studies")."""
    def lines(folder: str, *patterns: str) -> int:
        return sum(len(p.read_text().splitlines()) for pattern in patterns for p in (ROOT / folder).rglob(pattern))
    assert lines("benchmarks", "*.py", "*.sh") <= lines("engine", "*.py")


def test_gpu_only_scripts_are_marked() -> None:
    assert set(MARKED_GPU) == GPU_ONLY


class _Parsed(Exception):
    """Raised in place of parsing: carries the script's finished parser out of its main()."""

    def __init__(self, parser: argparse.ArgumentParser) -> None:
        super().__init__(parser.prog)
        self.parser = parser


def _load(path: Path):
    """The script as the module `benchmarks.NAME`, without running its __main__ block."""
    return importlib.import_module(f"benchmarks.{path.stem}")


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_every_flag_described_with_its_default_once(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    def parse_args(self, args=None, namespace=None):
        raise _Parsed(self)

    def parse_known_args(self, args=None, namespace=None):
        raise AssertionError(f"{name}.py parses its flags in stages (parse_known_args): the flags added "
                             "after the first stage are missing from --help; build one parser")

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_args)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", parse_known_args)
    module = _load(SCRIPTS[name])
    with pytest.raises(_Parsed) as parsed:
        module.main([])
    parser = parsed.value.parser
    options = [a for a in parser._actions if a.option_strings and not isinstance(a, argparse._HelpAction)]
    assert options, f"{name}.py: a parser without flags"
    assert help_problems(parser) == []


@pytest.fixture(scope="module")
def no_transformers_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A subprocess environment where `import transformers` fails, as without the test extra (a
    package of that name that raises, first on the path), and no CUDA GPU is visible."""
    site = tmp_path_factory.mktemp("no_transformers")
    (site / "transformers").mkdir()
    (site / "transformers" / "__init__.py").write_text(
        'raise ModuleNotFoundError("transformers is not installed (tests/benchmarks hides it)")\n')
    path = [str(site), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path), "CUDA_VISIBLE_DEVICES": ""}
    probe = subprocess.run([sys.executable, "-c", "import transformers"], env=env, capture_output=True, text=True)
    assert probe.returncode != 0 and "transformers is not installed" in probe.stderr, "transformers not hidden"
    return env


def _run(args: list[str], env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def script_runs(no_transformers_env: dict[str, str]) -> dict[tuple[str, str], subprocess.CompletedProcess]:
    """(name, flags) -> the finished `python -m benchmarks.NAME FLAGS`: --help of every script,
    and every script marked NEEDS_GPU without flags."""
    commands = [(name, "--help") for name in SCRIPTS] + [(name, "") for name in MARKED_GPU]
    with ThreadPoolExecutor(max_workers=4) as pool:
        done = pool.map(lambda c: _run(["-m", f"benchmarks.{c[0]}", *c[1].split()], no_transformers_env), commands)
        return dict(zip(commands, done))


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_help_runs_on_a_cpu_without_transformers(name: str, script_runs) -> None:
    run = script_runs[(name, "--help")]
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.startswith(f"usage: {name}.py")
    assert "options:" in run.stdout


@pytest.mark.slow
@pytest.mark.parametrize("name", MARKED_GPU)
def test_gpu_only_script_refuses_without_cuda(name: str, script_runs) -> None:
    run = script_runs[(name, "")]
    assert run.returncode == 2, run.stderr[-3000:]
    assert run.stderr.strip().splitlines() == [
        f"{name}.py: {NO_GPU_MESSAGE} (torch.cuda.is_available() is False)"]
    assert run.stdout == ""


@pytest.mark.slow
def test_tiny_throughput_without_transformers(no_transformers_env: dict[str, str]) -> None:
    """The README's `pie bench throughput --tiny --skip-hf --repeats 1`, smaller still."""
    run = _run(["-m", "benchmarks.throughput", "--tiny", "--skip-hf", "--repeats", "1", "--requests", "4",
                "--max-tokens", "4"], no_transformers_env)
    assert run.returncode == 0, run.stderr[-3000:]
    table = [line for line in run.stdout.splitlines() if line.startswith("| pie, ")]
    assert [line.split(" | ")[0] for line in table] == ["| pie, int8 KV cache", "| pie, bf16 KV cache"], run.stdout
    assert "transformers generate_batch" not in run.stdout


@pytest.mark.slow
def test_tiny_long_work_runs_a_pass_per_pool(tmp_path: Path) -> None:
    """mixed.py --workload long (long_context.py before it was folded in) on the CPU: the long
    work's defaults, one pass with memory ample and one with the small fixed pool, each a table
    row per KV dtype, both passes in the JSON."""
    out = tmp_path / "long.json"
    run = _run(["-m", "benchmarks.mixed", "--tiny", "--workload", "long", "--requests", "4", "--repeats", "1",
                "--out", str(out)], dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1"))
    assert run.returncode == 0, run.stderr[-3000:]
    assert "# cpu: long work" in run.stdout, run.stdout
    for pool in ("memory ample", "KV pool 0.05 GiB"):
        assert sum(line.startswith(("| int8 |", "| bf16 |")) for line in run.stdout.split(f"## {pool}")[1]
                   .split("##")[0].splitlines()) == 2, run.stdout
    figures = json.loads(out.read_text())
    assert figures["workload"] == "long" and list(figures["passes"]) == ["memory ample", "KV pool 0.05 GiB"]
    assert all(f["tok_per_s_median"] > 0 for p in figures["passes"].values() for f in p.values())


@pytest.mark.parametrize("name", ["qwen3-4b", "llama-8b", "llama-1b", "qwen2-7b", "tiny"])
def test_every_shape_builds_its_architecture(name: str, tmp_path: Path) -> None:
    """build_model makes each shape's architecture (the chat work's qwen2-7b shape once failed on
    the GPU alone), shrunk to a few parameters here: the folder says that architecture."""
    mixed = _load(SCRIPTS["mixed"])
    assert set(mixed.SHAPES) == {"qwen3-4b", "llama-8b", "llama-1b", "qwen2-7b", "tiny"}
    arch, shape = mixed.SHAPES[name]
    small = {**shape, "hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
             "intermediate_size": 128, "vocab_size": 512, **({"head_dim": 32} if "head_dim" in shape else {})}
    assert mixed.build_model(tmp_path, arch, small, torch.float32, max_len=128) > 0
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == arch


@pytest.mark.slow
def test_tiny_chat_work_runs_every_tier_setting(tmp_path: Path) -> None:
    """mixed.py --workload chat on the CPU: a row per KV dtype and tier setting with every column,
    the host tier's rows reading prompt tokens back, the JSON holding each setting; then a row per
    KV dtype of decode steps alone and with a read-back before each."""
    out = tmp_path / "chat.json"
    run = _run(["-m", "benchmarks.mixed", "--tiny", "--workload", "chat", "--repeats", "1", "--conversations", "12",
                "--turns", "3", "--out", str(out)], dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1"))
    assert run.returncode == 0, run.stderr[-3000:]
    lines = [line.split(" | ") for line in run.stdout.splitlines() if line.startswith(("| int8 |", "| bf16 |"))]
    rows = [r for r in lines if r[1] in ("off", "host", "host+disk")]
    assert [(r[0], r[1]) for r in rows] == [(f"| {kv}", t) for kv in ("int8", "bf16") for t in ("off", "host", "host+disk")]
    assert all(len(r) == 9 for r in rows), run.stdout
    costs = [r for r in lines if r not in rows]
    assert [(r[0], len(r)) for r in costs] == [("| int8", 5), ("| bf16", 5)], run.stdout
    figures = json.loads(out.read_text())["figures"]
    assert figures["int8 off"]["median"]["host_hit_tokens"] == 0
    assert figures["int8 host"]["median"]["host_hit_tokens"] > 0 and figures["int8 host"]["median"]["readback_ms"] > 0
    for kv in ("int8", "bf16"):
        cost = figures[f"{kv} readback cost"]
        assert cost["blocks"] > 0 and cost["step_ms"] > 0 and cost["ratio"] > 0


def test_ab_verdict_needs_the_spreads_apart() -> None:
    ab = _load(SCRIPTS["ab"])
    assert ab.verdict([90, 95, 97], [100, 104, 110], higher_better=True) == "REGRESSION"
    assert ab.verdict([90, 101, 97], [100, 104, 110], higher_better=True) == "same"  # best round within
    assert ab.verdict([111, 115], [100, 110], higher_better=True) == "better"
    assert ab.verdict([12.0, 13.0], [10.0, 11.5], higher_better=False) == "REGRESSION"  # a latency went up
    assert ab.verdict([9.0, 9.5], [10.0, 11.5], higher_better=False) == "better"
    text, regressions = ab.table({"offline-int8": {"new": [{"tok_per_s": 90.0}, {"tok_per_s": 95.0}],
                                                   "old": [{"tok_per_s": 100.0}, {"tok_per_s": 104.0}]}},
                                 ["new", "old"])
    assert "| offline-int8 | tok_per_s (tok/s, higher is better) | 92.5 (90-95) | 102 (100-104) | 0.907 | REGRESSION |" \
        in text, text
    assert regressions == ["REGRESSION: offline-int8 tok_per_s: new 92.5 against old 102"]


def test_ab_variants_are_engine_fields_and_server_flags() -> None:
    ab = _load(SCRIPTS["ab"])
    fields = ab.parse_variant("batch_invariant=true,decode_stall_factor=0,kv_smoothing=off,x=2.5")
    assert fields == {"batch_invariant": True, "decode_stall_factor": 0, "kv_smoothing": "off", "x": 2.5}
    assert ab.server_flags(fields) == ["--batch-invariant", "--decode-stall-factor", "0", "--kv-smoothing", "off",
                                       "--x", "2.5"]
    with pytest.raises(ValueError, match="FIELD=VALUE"):
        ab.parse_variant("batch_invariant")
    with pytest.raises(ValueError, match="compare without it"):
        ab.server_flags({"enable_prefix_caching": False})


def test_ab_columns_share_the_gpu(capsys) -> None:
    """Every column's engine is up at once, the k-th asking k shares: more columns than the GPU
    holds at --memory-fraction is refused at once, naming the share that fits (it once failed in
    the fourth engine's start, after three had built)."""
    ab = _load(SCRIPTS["ab"])
    variants = [a for n in (2, 4, 8) for a in ("--variant", f"max_num_seqs={n}")]
    with pytest.raises(SystemExit) as stop:
        ab.main(["--tiny", "--workloads", "offline-int8", "--memory-fraction", "0.3", *variants])
    assert stop.value.code == 2
    assert "4 columns x --memory-fraction 0.3 is more than the GPU: give --memory-fraction 0.23" in capsys.readouterr().err


def test_ab_workloads_share_a_unit_and_poisson_lasts_the_arrival_seconds() -> None:
    ab = _load(SCRIPTS["ab"])
    assert ab.groups(ab.MODES["full"]) == [["offline-int8", "stream-int8", "ttft-4k"], ["offline-bf16", "stream-bf16"],
                                           ["offline-int8-8g"], ["offline-bf16-8g"], ["burst", "poisson-4", "poisson-8"]]
    assert ab.groups(["burst", "offline-int8"]) == [["burst"], ["offline-int8"]]  # in the order given
    args = argparse.Namespace(requests=256, arrival_seconds=30.0)
    assert [ab.served_requests(n, args) for n in ("burst", "poisson-4", "poisson-8")] == [256, 120, 240]
    args.arrival_seconds = 100.0
    assert ab.served_requests("poisson-4", args) == 256  # never more than the long work holds


def test_ab_resumes_only_the_same_trees_device_and_work(tmp_path: Path) -> None:
    """--resume takes an earlier call's complete workloads, and refuses where the code, a tree's
    settings, the device or the work differ."""
    ab = _load(SCRIPTS["ab"])
    new, base = tmp_path / "new", tmp_path / "base"
    for tree, text in ((new, "x = 1\n"), (base, "x = 0\n")):
        (tree / "engine").mkdir(parents=True)
        (tree / "engine" / "a.py").write_text(text)
    trees = {"new": ab.Arm(new, {}), "base": ab.Arm(base, {})}
    args = argparse.Namespace(shape="qwen2-7b", device="cpu", requests=256, scale=1.0, kv_gib=8.0, ttft_tokens=4096,
                              arrival_seconds=30.0, rounds=2, max_num_seqs=256, max_num_batched_tokens=8192,
                              memory_fraction=0.45)
    two = [{"tok_per_s": 1.0}, {"tok_per_s": 2.0}]
    earlier = dict(trees={"new": [str(new), {}], "base": [str(base), {}]},
                   fingerprints={"new": ab.tree_fingerprint(new), "base": ab.tree_fingerprint(base)}, device="cpu",
                   results={"offline-int8": {"new": two, "base": two},
                            "burst": {"new": two, "base": two[:1]}},  # stopped in its second round
                   args={k: v for k, v in vars(args).items()})
    path = tmp_path / "earlier.json"
    path.write_text(json.dumps(earlier))
    assert ab.resumed(path, trees, args) == {"offline-int8": {"new": two, "base": two}}  # the burst is not whole
    copy = tmp_path / "elsewhere"  # the same code at another path (another machine's) is the same tree
    shutil.copytree(new, copy)
    moved = {"new": ab.Arm(copy, {}), "base": trees["base"]}
    assert ab.resumed(path, moved, args) == {"offline-int8": {"new": two, "base": two}}
    (copy / "engine" / "a.py").write_text("x = 2\n")
    with pytest.raises(ValueError, match="new: its code differs"):
        ab.resumed(path, moved, args)
    with pytest.raises(ValueError, match="its settings"):
        ab.resumed(path, {"new": trees["new"], "base": ab.Arm(base, {"batch_invariant": True})}, args)
    with pytest.raises(ValueError, match="its trees are"):
        ab.resumed(path, {"new": trees["new"]}, args)
    with pytest.raises(ValueError, match="its rounds is 2, this call's 3"):
        ab.resumed(path, trees, argparse.Namespace(**{**vars(args), "rounds": 3}))
    earlier["device"] = "NVIDIA H200"
    path.write_text(json.dumps(earlier))
    with pytest.raises(ValueError, match="it ran on NVIDIA H200, this call on cpu"):
        ab.resumed(path, trees, args)


@pytest.mark.slow
def test_tiny_ab_gate_of_a_setting_against_the_defaults_over_two_calls(tmp_path: Path) -> None:
    """ab.py --variant on the CPU: this tree at its defaults against itself with the stall bound
    off, offline (an engine field) and served (a server flag); then a second call with --resume
    runs only the workload it is asked for, and tables and writes both calls' workloads."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    first, second = tmp_path / "first.json", tmp_path / "second.json"
    common = ["-m", "benchmarks.ab", "--tiny", "--rounds", "1", "--variant", "decode_stall_factor=0",
              "--model-cache", str(tmp_path / "models")]
    run = _run([*common, "--workloads", "offline-int8,burst", "--out", str(first)], env, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "new / new+decode_stall_factor=0" in run.stdout, run.stdout
    data = json.loads(first.read_text())
    assert data["trees"]["new+decode_stall_factor=0"][1] == {"decode_stall_factor": 0}
    for name in ("offline-int8", "burst"):
        assert {label: len(rounds) for label, rounds in data["results"][name].items()} == {
            "new": 1, "new+decode_stall_factor=0": 1}

    run = _run([*common, "--workloads", "ttft-4k", "--resume", str(first), "--out", str(second)], env, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "taken from" in run.stdout and "model tiny taken from" in run.stdout, run.stdout
    assert "offline-int8 round" not in run.stdout and "burst round" not in run.stdout, run.stdout  # not run again
    for row in ("| offline-int8 | tok_per_s", "| burst | itl_p99_over_p50", "| ttft-4k | ttft_ms"):
        assert row in run.stdout, run.stdout
    results = json.loads(second.read_text())["results"]
    assert list(results) == ["offline-int8", "burst", "ttft-4k"]  # the full table's order
    assert results["burst"] == data["results"]["burst"]
    assert all(len(rounds) == 1 for name in results for rounds in results[name].values())


@pytest.mark.slow
def test_ab_gate_stopped_by_a_time_limit_still_tables_what_ran() -> None:
    """SIGTERM (gpu.sh's `timeout`) once the offline rows are in, while the burst's servers start:
    the table holds the offline rows, no burst row, a line naming the burst, and the status is 1."""
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.ab", "--tiny", "--rounds", "1", "--workloads",
                             "offline-int8,burst", "--variant", "decode_stall_factor=0"], cwd=ROOT,
                            env={**os.environ, "CUDA_VISIBLE_DEVICES": ""}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("offline-int8: 1 rounds"):
                proc.send_signal(signal.SIGTERM)
                break
        rest, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    out = "".join(lines) + rest
    assert proc.returncode == 1, out[-3000:]
    assert "| offline-int8 | tok_per_s" in out and "| burst |" not in out, out[-3000:]
    assert "STOPPED by SIGTERM: not every round ran of burst" in out, out[-3000:]


@pytest.mark.slow
def test_tiny_ab_gate_against_a_tree_from_before_the_pie_names(tmp_path: Path) -> None:
    """ab.py on the CPU: this tree against 65bef9d (its packages still top-level), offline and
    served, each tree in its own processes."""
    base = tmp_path / "65bef9d"
    base.mkdir()
    archive = subprocess.run(["git", "archive", "65bef9d", "--", ".", ":!model/bundled", ":!tests"], cwd=ROOT,
                             capture_output=True)
    if archive.returncode != 0:
        pytest.skip("not a git checkout with 65bef9d")
    subprocess.run(["tar", "-x", "-C", str(base)], input=archive.stdout, check=True)
    out = tmp_path / "ab.json"
    run = _run(["-m", "benchmarks.ab", "--tiny", "--rounds", "2", "--workloads", "offline-int8,burst", "--base",
                str(base), "--out", str(out)], {**os.environ, "CUDA_VISIBLE_DEVICES": ""}, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "| offline-int8 | tok_per_s" in run.stdout and "| burst | itl_p99_over_p50" in run.stdout, run.stdout
    assert "REGRESSION" in run.stdout or "verdict: no regression beyond the spreads" in run.stdout
    results = json.loads(out.read_text())["results"]
    for name in ("offline-int8", "burst"):
        assert {label: len(rounds) for label, rounds in results[name].items()} == {"new": 2, "65bef9d": 2}
        assert all(r["tok_per_s"] > 0 for rounds in results[name].values() for r in rounds)
