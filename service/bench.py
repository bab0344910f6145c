"""`pie bench`: lists the scripts of benchmarks/ and runs one, as `python -m benchmarks.NAME` from the
checkout's root would."""

from __future__ import annotations

import ast
import dataclasses
import runpy
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@dataclasses.dataclass(frozen=True, slots=True)
class Benchmark:
    name: str
    summary: str  # the docstring's first sentence, up to a colon
    needs_gpu: bool  # the script's NEEDS_GPU = True


def benchmarks(folder: Path = BENCHMARKS) -> list[Benchmark]:
    """The runnable scripts of benchmarks/ (those with a `__main__` block), read without importing
    them: a listing must not load torch or touch a GPU."""
    found = []
    for path in sorted(folder.glob("*.py")) if folder.is_dir() else []:
        tree = ast.parse(path.read_text(), str(path))
        if not any(isinstance(node, ast.If) and "__main__" in ast.unparse(node.test) for node in tree.body):
            continue
        needs_gpu = any(isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "NEEDS_GPU" for t in node.targets)
                        and isinstance(node.value, ast.Constant) and node.value.value is True for node in tree.body)
        paragraph = " ".join((ast.get_docstring(tree) or "").split("\n\n")[0].split())
        sentence = paragraph.split(". ")[0].split(": ")[0].rstrip(".")
        found.append(Benchmark(path.stem, sentence, needs_gpu))
    return found


def run_bench(argv: list[str]) -> int:
    """`pie bench NAME [ARGS...]` runs benchmarks/NAME.py with ARGS, as `python -m benchmarks.NAME`
    from the checkout's root would (the scripts live in the source checkout, next to their RESULTS.md):
    the checkout's root goes first on the import path while it runs."""
    found = {b.name: b for b in benchmarks()}

    def out(line: str) -> None:  # the listing is the command's answer, on stdout (not a log line)
        sys.stdout.write(line + "\n")

    if not argv or argv[0] in ("-h", "--help", "--list"):
        out("usage: pie bench NAME [ARGS...]   (pie bench NAME --help: that benchmark's own flags)")
        if not found:
            out(f"no benchmarks: {BENCHMARKS} is not there (they run from a source checkout)")
            return 0 if argv[:1] == ["--list"] else 2
        out("benchmarks (GPU: needs a CUDA GPU):")
        width = max(map(len, found))
        for b in found.values():
            out(f"  {b.name:<{width}}  {'GPU' if b.needs_gpu else '   '}  {b.summary}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in found:
        sys.stderr.write(f"pie bench: unknown benchmark {name!r}; one of: {', '.join(found) or 'none'}\n")
        return 2
    saved, saved_path = sys.argv, sys.path[:]
    sys.argv = [str(BENCHMARKS / f"{name}.py"), *rest]
    sys.path.insert(0, str(BENCHMARKS.parent))
    try:
        runpy.run_module(f"benchmarks.{name}", run_name="__main__", alter_sys=True)
    except SystemExit as e:
        if isinstance(e.code, str):  # sys.exit("message"): Python prints it and exits 1
            sys.stderr.write(f"{e.code}\n")
            return 1
        return 0 if e.code is None else e.code if isinstance(e.code, int) else 1
    finally:
        sys.argv, sys.path[:] = saved, saved_path
    return 0
