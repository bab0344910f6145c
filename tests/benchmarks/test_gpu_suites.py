"""benchmarks/gpu.sh, the one GPU entry point: the suites its header lists are the ones it defines
and accepts, the docs name only those, the scripts it runs exist, every script of benchmarks/ has
its line in benchmarks/README.md, and nothing points at the per-issue scripts it replaced. The
slow tests run it on the CPU: its refusals, and a suite on a baseline commit checked out beside the
working tree (the GPU runs themselves happen on the lent machine)."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GPU_SH = (ROOT / "benchmarks" / "gpu.sh").read_text()
DOCS = ["README.md", *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md")),
        "benchmarks/README.md", "benchmarks/RESULTS.md"]
PATH = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])  # python3: this one
REPLACED = ("gpu_issue14.sh", "gpu_issue15.sh", "gpu_issue16.sh", "gpu_issue19.sh", "gpu_engine.sh", "gpu_check.sh")


def _accepted() -> list[str]:
    (suites,) = re.findall(r'^SUITES=" ([a-z ]+) "$', GPU_SH, re.M)
    return suites.split()


def test_the_listed_defined_and_accepted_suites_agree() -> None:
    listed = re.findall(r"^#   ([a-z]+) ", GPU_SH, re.M)
    defined = re.findall(r"^suite_([a-z]+)\(\)", GPU_SH, re.M)
    assert listed and listed == _accepted() and sorted(defined) == sorted(listed)


def test_the_docs_name_only_suites_that_exist() -> None:
    accepted = set(_accepted()) | {"fingerprint"}  # gpu.sh fingerprint: a command of its own, not a suite
    named = 0
    for doc in DOCS:
        for words in re.findall(r"gpu\.sh((?: [a-z]+)+)", (ROOT / doc).read_text()):
            assert set(words.split()) <= accepted, f"{doc}: gpu.sh {words.strip()}"
            named += 1
    assert named >= 3
    (listed,) = re.findall(r"lists the suites: ([a-z,\s]+)\.", (ROOT / "benchmarks" / "README.md").read_text())
    assert re.split(r",\s+", listed) == _accepted(), "benchmarks/README.md lists other suites than gpu.sh"


def test_the_suites_run_the_scripts_as_modules_and_they_exist() -> None:
    """Every suite runs a script as `python3 -m benchmarks.NAME` (or tests.NAME), never by its path."""
    assert not re.findall(r"python3? [a-z]+/[a-z0-9_]+\.py", GPU_SH)
    modules = set(re.findall(r"python3 -m ((?:benchmarks|tests)\.[a-z0-9_]+)", GPU_SH))
    assert {"benchmarks.attention", "benchmarks.throughput", "benchmarks.profile_step", "benchmarks.serving",
            "benchmarks.mixed", "benchmarks.ab", "tests.smollm2"} <= modules
    assert [m for m in modules if not (ROOT / (m.replace(".", "/") + ".py")).is_file()] == []


def test_every_script_has_its_line_in_the_benchmarks_readme() -> None:
    readme = (ROOT / "benchmarks" / "README.md").read_text()
    scripts_section = readme.split("## The scripts")[1].split("\n## ")[0]  # not the retired ones' table
    listed = set(re.findall(r"^\| `([a-z0-9_]+\.py)` \|", scripts_section, re.M))
    scripts = {p.name for p in (ROOT / "benchmarks").glob("*.py")
               if any(isinstance(n, ast.If) and "__main__" in ast.unparse(n.test) for n in ast.parse(p.read_text()).body)}
    assert scripts == listed, f"not in benchmarks/README.md: {scripts - listed}; listed, not scripts: {listed - scripts}"


def test_benchmarks_no_larger_than_the_engine() -> None:
    """Issue 60's rule for the house: benchmarks/ (its code: scripts and shell) stays no larger than
    engine/, so that new studies fold into the lasting tools instead of piling up beside them."""
    def lines(folder: str, *patterns: str) -> int:
        return sum(len(p.read_text().splitlines()) for pattern in patterns for p in (ROOT / folder).rglob(pattern))

    bench, engine = lines("benchmarks", "*.py", "*.sh"), lines("engine", "*.py")
    assert bench <= engine, f"benchmarks/ has {bench} lines of code, engine/ {engine}: fold or retire a script"


def test_nothing_points_at_the_per_issue_scripts() -> None:
    assert not [name for name in REPLACED if (ROOT / "benchmarks" / name).exists()]
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    if not files:
        pytest.skip("not a git checkout")
    stale = [f for f in files if f != "benchmarks/HISTORY.md" and f.endswith((".md", ".py", ".sh", ".toml"))
             and any(name in (ROOT / f).read_text(errors="replace") for name in REPLACED if (ROOT / f).is_file())]
    assert stale in ([], ["tests/benchmarks/test_gpu_suites.py"]), stale


def _gpu_sh(*args: str, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "benchmarks/gpu.sh", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PATH": PATH, **(env or {})})


def test_the_fingerprint_names_the_code_not_the_git(tmp_path) -> None:
    """`gpu.sh fingerprint` hashes the code's files (the lent machine's .git can be stale): the same
    for the same files, different once one of them changes, blind to files that are not code."""
    for folder in ("engine", "kernels", "model", "service", "training", "protos", "benchmarks", "clients/pie_client"):
        (tmp_path / folder).mkdir(parents=True)
        (tmp_path / folder / "a.py").write_text(folder)
    (tmp_path / "benchmarks" / "gpu.sh").write_text(GPU_SH)

    def fingerprint() -> str:
        run = subprocess.run(["bash", "benchmarks/gpu.sh", "fingerprint"], cwd=tmp_path, capture_output=True, text=True)
        assert run.returncode == 0 and re.fullmatch(r"[0-9a-f]{12}\n", run.stdout), run.stdout + run.stderr
        return run.stdout

    first = fingerprint()
    assert fingerprint() == first
    (tmp_path / "kernels" / "a.py").write_text("changed")
    changed = fingerprint()
    assert changed != first
    (tmp_path / "kernels" / "notes.txt").write_text("not code")  # only code files count
    assert fingerprint() == changed


@pytest.mark.slow
def test_no_suite_lists_them_and_an_unknown_one_is_refused(tmp_path) -> None:
    listing = _gpu_sh(env={"OUT": str(tmp_path)})
    assert listing.returncode == 2
    assert re.findall(r"^#   ([a-z]+) ", listing.stdout, re.M) == _accepted()
    unknown = _gpu_sh("kernels", "nosuch", env={"OUT": str(tmp_path)})
    assert unknown.returncode == 2 and "unknown suite: nosuch" in unknown.stdout
    assert "=== kernels" not in unknown.stdout  # refused before anything runs
    missing = _gpu_sh("offline", env={"OUT": str(tmp_path), "BASELINE": "0000000"})
    assert missing.returncode == 2 and "BASELINE=0000000: no such commit" in missing.stderr


@pytest.mark.slow
def test_a_suite_runs_on_the_working_tree_and_on_a_baseline_commit(tmp_path) -> None:
    """The offline suite, CPU-sized, on the working tree and on HEAD checked out in a worktree:
    each writes its own files, the baseline's from its own tree, and the checkout is gone after."""
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    if not head:
        pytest.skip("not a git checkout")
    run = _gpu_sh("offline", env={"OUT": str(tmp_path), "BASELINE": "HEAD", "PYTHONPATH": "",
                                  "OFFLINE_ARGS": "--tiny --repeats 1 --requests 4 --max-tokens 4"})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    tree = f"/tmp/pie-baseline-{head[:12]}"
    assert re.search(rf"^=== offline \(baseline HEAD\) .*\n    in {tree}, PYTHONPATH=(?:{ROOT}/\.site:)?{tree}:{tree}/clients", run.stdout,
                     re.M), run.stdout
    for out in (tmp_path, tmp_path / "baseline"):
        table = (out / "offline.md").read_text()
        assert "| pie, int8 KV cache |" in table and "| pie, bf16 KV cache |" in table, table
        assert (out / "offline.json").is_file()
    assert not Path(tree).exists()
    worktrees = subprocess.run(["git", "worktree", "list"], cwd=ROOT, capture_output=True, text=True).stdout
    assert tree not in worktrees
