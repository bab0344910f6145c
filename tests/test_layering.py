"""Dependencies point one way. Read from the source (every import statement, also those inside
functions), so a lazy import cannot slip past:

    clients/   nothing of the server, no torch
    service/   gRPC and the engine's handle; no torch, triton or kernels of its own
    engine/    model and kernels; never the service or training
    training/  model; never the engine, service or kernels
    model/     torch alone: attention (AttentionBackend) and fused ops (FusedOps) come from its owner
    kernels/   torch and triton; nothing else of ours

and checked once more by importing `pie.model` and `pie.kernels` in a fresh interpreter. Inside
engine/, its rooms (sub-packages) import downward only, in ENGINE_ROOMS' order; no engine/ or
service/ file is longer than MAX_LINES, and none carries a date or a GPU's name. Every
import of ours goes through its `pie.` name (README "Import names"), or, inside engine/, kernels/,
model/ and training/, is relative to its own folder: a bare `import kernels` would be Hugging
Face's package, or the checkout's folder imported a second time under another name."""

from __future__ import annotations

import ast
import io
import re
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SERVER = {"engine", "kernels", "model", "service", "training"}  # each imported as pie.<name>
FORBIDDEN = {
    "clients": SERVER | {"torch", "triton"},
    "service": {"torch", "triton", "kernels"},
    "engine": {"service", "training", "pie_client", "pie.v1"},
    "training": {"engine", "service", "kernels", "triton", "pie_client", "pie.v1"},
    "model": {"engine", "service", "training", "kernels", "triton", "pie_client", "pie.v1"},
    "kernels": (SERVER - {"kernels"}) | {"pie_client", "pie.v1"},
}


def _package_of(module: str) -> str:
    """The unit the rules speak of: pie.engine.core.engine_core -> engine, pie.v1.generate_pb2 -> pie.v1,
    torch.nn -> torch; a bare engine.core -> "bare engine" (never ours, so never allowed)."""
    parts = module.split(".")
    if parts[0] == "pie" and len(parts) > 1:
        return parts[1] if parts[1] in SERVER else f"pie.{parts[1]}"
    return f"bare {parts[0]}" if parts[0] in SERVER else parts[0]


def imported_modules(source: str) -> set[str]:
    """Every absolute import in the source, as written (relative ones stay in the package)."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def imported_packages(source: str) -> set[str]:
    return {_package_of(name) for name in imported_modules(source)}


def test_the_scanner_sees_every_kind_of_import() -> None:
    source = """
import a.b
from c.d import e
from . import local
def f():
    import g
    from h import i
try:
    import j
except ImportError:
    pass
"""
    assert imported_packages(source) == {"a", "c", "g", "h", "j"}
    assert imported_packages("import pie.engine.core.engine_core\nfrom pie.v1 import x\nimport kernels") == {
        "engine", "pie.v1", "bare kernels"}


def _python_files() -> list[Path]:
    """The project's own sources: the packages, clients, tests and benchmarks (not the generated
    stubs; clients/pie's links to the packages are not followed, so each file comes once)."""
    folders = [*sorted(SERVER), "clients", "tests", "benchmarks"]
    return [p for folder in folders for p in sorted((ROOT / folder).rglob("*.py"))
            if not p.is_relative_to(ROOT / "clients" / "pie" / "v1")]


# Bare names that are not ours: Hugging Face's `kernels`; the engine of a base tree from before
# the pie.* names, which the A/B gate runs with that tree's import path.
NOT_OURS = {"tests/test_import_names.py": {"kernels"},
            "benchmarks/ab.py": {"engine.config", "engine.core", "engine.engine", "engine.sampling_params"}}


def test_our_packages_are_imported_by_their_pie_names() -> None:
    bare = {path: sorted(n for n in imported_modules(p.read_text())
                         if n.split(".")[0] in SERVER and n not in NOT_OURS.get(path, ()))
            for p in _python_files() if (path := str(p.relative_to(ROOT)))}
    bare = {path: names for path, names in bare.items() if names}
    assert not bare, f"import these as pie.<name>: {bare}"


def test_clients_pie_links_each_package_to_its_folder() -> None:
    """clients/pie is the `pie` namespace of a checkout: its server subpackages are the top-level
    folders themselves (links), the rest is the generated stubs. The folders are namespace packages
    (no __init__.py): from the checkout's root, where Python puts them on its path as `kernels`,
    `model`, ..., they never hide an installed package of that name."""
    pie = ROOT / "clients" / "pie"
    assert not (pie / "__init__.py").exists(), "`pie` is a namespace package that neither distribution owns"
    for name in SERVER:
        assert (pie / name).is_symlink() and (pie / name).resolve() == ROOT / name, name
        assert not (ROOT / name / "__init__.py").exists(), f"{name}/__init__.py would hide an installed {name!r}"
    assert {p.name for p in pie.iterdir() if p.is_dir()} == SERVER | {"v1"}


# Inside each of these folders a module imports its neighbours relatively (`from ..config import
# EngineConfig`), so the folder's structure shows in its imports; what crosses folders names
# pie.<folder> (`from pie.model.llama import ...`).
RELATIVE_INSIDE = ("engine", "kernels", "model", "training", "service")


def own_import_faults(source: str, module: str) -> list[str]:
    """The imports of `module` (pie.engine.core.loop) that name its own top-level folder absolutely,
    or that climb out of it relatively."""
    folder = module.split(".")[:2]
    package = module.split(".")[:-1]
    faults = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            faults += [f"import {a.name}" for a in node.names if a.name.split(".")[:2] == folder]
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0 and node.module and node.module.split(".")[:2] == folder:
                faults.append(f"from {node.module} import (make it relative)")
            elif node.level and node.level > len(package) - 1:
                faults.append(f"from {'.' * node.level}{node.module or ''} import (leaves {'.'.join(folder)})")
    return faults


def test_imports_inside_a_folder_are_relative() -> None:
    found = {}
    for folder in RELATIVE_INSIDE:
        for path in sorted((ROOT / folder).rglob("*.py")):
            module = _module_name(path) + (".__init__" if path.name == "__init__.py" else "")
            if faults := own_import_faults(path.read_text(), module):
                found[str(path.relative_to(ROOT))] = faults
    assert not found, f"imports inside a folder: {found}"
    # and it finds both kinds of fault
    assert own_import_faults("from pie.engine.config import X\nfrom ..config import Y\nfrom pie.model import Z",
                             "pie.engine.core.loop") == ["from pie.engine.config import (make it relative)"]
    assert own_import_faults("from ...service import X\nimport pie.engine.errors", "pie.engine.core.loop") == [
        "from ...service import (leaves pie.engine)", "import pie.engine.errors"]

@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_imports_point_one_way(package: str) -> None:
    files = sorted((ROOT / package).rglob("*.py"))
    assert files, f"no sources under {package}/"
    wrong = {}
    for path in files:
        bad = imported_packages(path.read_text()) & FORBIDDEN[package]
        if bad:
            wrong[str(path.relative_to(ROOT))] = sorted(bad)
    assert not wrong, f"{package}/ must not import {sorted(FORBIDDEN[package])}: {wrong}"


@pytest.mark.slow
@pytest.mark.parametrize("package, never", [
    ("model", ["pie.kernels", "pie.engine", "pie.service", "pie.training", "triton"]),
    ("kernels", ["pie.engine", "pie.model", "pie.service", "pie.training"]),
])
def test_importing_loads_nothing_it_must_not(package: str, never: list[str], tmp_path: Path) -> None:
    code = (f"import sys, pie.{package}; "
            f"bad = sorted(m for m in sys.modules if m.split('.')[0] in {never!r} or '.'.join(m.split('.')[:2]) in {never!r}); "
            "assert not bad, bad")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 0, result.stderr


OURS = ("engine", "kernels", "model", "service", "training", "pie_client")


def _module_name(path: Path) -> str:
    """engine/core/engine_core.py -> pie.engine.core.engine_core, clients/pie_client/aio.py -> pie_client.aio."""
    if path.is_relative_to(ROOT / "clients"):
        parts = list(path.relative_to(ROOT / "clients").with_suffix("").parts)
    else:
        parts = ["pie", *path.relative_to(ROOT).with_suffix("").parts]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules of ours it imports (every import statement: at the top, in functions,
    under TYPE_CHECKING). `from pkg import name` counts as pkg.name where that is a module, else pkg."""
    files = [p for pkg in OURS for p in (ROOT / ("clients" if pkg == "pie_client" else "") / pkg).rglob("*.py")]
    modules = {_module_name(p): p for p in files}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the package (up level - 1)
                    base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([base] if base else []))
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
            else:
                continue
            deps.update(t for t in targets if t in modules and t != name)
        graph[name] = deps
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 on the path, 2 done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                return path[path.index(dep):] + [dep]
            if dep not in state and (cycle := visit(dep)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_cycle_finder_finds_one() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycles() -> None:
    """No module of ours reaches itself through imports, counting those in functions and under
    TYPE_CHECKING: each module can be read (and tested) with what it depends on, and no further."""
    graph = import_graph()
    assert "pie.engine.core.engine_core" in graph and "pie.engine.scheduling.scheduler" in graph["pie.engine.core.engine_core"]
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle)


LAB_NOTES = re.compile(r"\b20\d\d-\d\d-\d\d\b|\b(?:H100|H200|H800|A100|A800|B200|GB200|V100|MI300X?|L40S?|RTX ?\d{4})\b")


def test_the_code_keeps_no_lab_notebook() -> None:
    """Comments and docstrings say what the code does and why, in the present tense: a dated
    measurement or a GPU's name rots the moment the code changes, so figures live in
    benchmarks/RESULTS.md (current) and HISTORY.md (dated)."""
    found = {str(p.relative_to(ROOT)): [n for n, line in enumerate(p.read_text().splitlines(), 1) if LAB_NOTES.search(line)]
             for package in ("engine", "service", "kernels", "model") for p in sorted((ROOT / package).rglob("*.py"))}
    found = {path: lines for path, lines in found.items() if lines}
    assert not found, f"dates or GPU names in the code (move them to benchmarks/RESULTS.md or HISTORY.md): {found}"
    assert LAB_NOTES.search("measured on the H200 (2026-12-02)") and not LAB_NOTES.search("an H-shaped tile 2026")


# A measurement quoted in prose (a time, a rate, a speed-up, a share) or a pointer to where one is
# kept (HISTORY.md, RESULTS.md, an issue number): the comment states the rule, RESULTS.md the figure.
MEASUREMENTS = re.compile(
    r"\b(?:HISTORY|RESULTS)\.md\b|\bbenchmarks/(?:HISTORY|RESULTS)\b|\bissues? #?\d+\b|(?<![\w&])#\d+\b"
    r"|\d(?:[\d.,]*\d)?\s?(?:ns|us|µs|ms|s|TB/s|GB/s|tokens?/s|tok/s)\b"
    r"|\d(?:\.\d+)?\s?x\s(?:faster|slower|less|more|fewer|larger|smaller|the)\b"
    r"|\d(?:\.\d+)?\s?%")
NO_FIGURES = ("engine", "kernels", "model")  # service/ not yet


def prose_lines(source: str) -> list[tuple[int, str]]:
    """(line number, text) of every comment and every line of a module's, class's or function's
    docstring."""
    lines = [(t.start[0], t.string) for t in tokenize.generate_tokens(io.StringIO(source).readline)
             if t.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                lines += [(first.lineno + i, text) for i, text in enumerate(first.value.value.splitlines())]
    return lines


def test_comments_state_rules_not_measurements() -> None:
    found = {str(p.relative_to(ROOT)): [n for n, text in prose_lines(p.read_text()) if MEASUREMENTS.search(text)]
             for package in NO_FIGURES for p in sorted((ROOT / package).rglob("*.py"))}
    found = {path: sorted(lines) for path, lines in found.items() if lines}
    assert not found, f"measurements or pointers to them in comments (state the rule; figures in RESULTS.md): {found}"
    planted = '''"""Steps took 7 ms (benchmarks/HISTORY.md)."""
x = 1  # 2.4x faster, issue 29
y = "12% in a string is code, not prose"
def f():
    """Keeps 5% of RESULTS.md."""
# the fixed split: 1024 keys, 16 splits, head dim 128
'''
    assert sorted(n for n, text in prose_lines(planted) if MEASUREMENTS.search(text)) == [1, 2, 5]


# engine/'s rooms, lowest first: a module may import from its own room and the rooms before it,
# never from one after it. The top level is the contract every room shares (config, errors,
# sampling parameters, the messages that cross the process boundary, the limits a request is
# checked against, the device and the model folder's checks).
ENGINE_ROOMS = ["", "sample", "scheduling", "runner", "offload", "spec_decode", "core", "client"]


def _engine_room(module: str) -> str | None:
    """pie.engine.runner.staging -> "runner", pie.engine.config -> "", pie.model.llama -> None."""
    parts = module.split(".")
    if parts[:2] != ["pie", "engine"]:
        return None
    return parts[2] if len(parts) > 3 else ""


def test_engine_rooms_import_downward_only() -> None:
    graph = import_graph()
    rooms = {m: r for m in graph if (r := _engine_room(m)) is not None}
    assert set(rooms.values()) == set(ENGINE_ROOMS), f"engine/ has rooms {sorted(set(rooms.values()))}: order them here"
    upward = {m: sorted(d for d in graph[m] if d in rooms and ENGINE_ROOMS.index(rooms[d]) > ENGINE_ROOMS.index(r))
              for m, r in rooms.items()}
    upward = {m: deps for m, deps in upward.items() if deps}
    assert not upward, f"imports up engine/'s order {ENGINE_ROOMS}: {upward}"



MAX_LINES = 400


def test_every_engine_and_service_file_fits_in_one_sitting() -> None:
    """Each file holds one concept and is read top to bottom: at most MAX_LINES lines."""
    long = {str(p.relative_to(ROOT)): n for package in ("engine", "service") for p in sorted((ROOT / package).rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"longer than {MAX_LINES} lines (split by concept): {long}"


# tests/engine/ mirrors engine/: a test of engine/<room>/ lies in tests/engine/<room>/, a test of a
# top-level module (engine/model_check.py) beside the rooms as test_<module>.py; the only other files
# there are helpers that tests of several rooms share.
ENGINE_TEST_HELPERS = {"invariants.py"}


def mirror_faults(tests: Path, engine: Path) -> list[str]:
    """Each file of `tests` (a tests/engine/) that is not where the mirror of `engine` puts it."""
    rooms = {p.name for p in engine.iterdir() if (p / "__init__.py").is_file()}
    modules = {p.stem for p in engine.glob("*.py")}
    faults = []
    for path in sorted(tests.rglob("*.py")):
        parts = path.relative_to(tests).parts
        if len(parts) == 1:
            name = parts[0]
            if name not in ENGINE_TEST_HELPERS and not (name.startswith("test_") and name[5:-3] in modules):
                faults.append(f"{name}: a flat file that tests no top-level module of engine/ (move it to its room)")
        elif len(parts) > 2 or parts[0] not in rooms:
            faults.append(f"{'/'.join(parts)}: engine/ has no room {'/'.join(parts[:-1])}/")
    return faults


def test_engine_tests_mirror_the_engine(tmp_path: Path) -> None:
    assert {p.name for p in (ROOT / "engine").iterdir() if (p / "__init__.py").is_file()} == set(ENGINE_ROOMS) - {""}
    faults = mirror_faults(ROOT / "tests" / "engine", ROOT / "engine")
    assert not faults, f"tests/engine/ does not mirror engine/: {faults}"

    # and it finds what is out of place
    (tmp_path / "engine" / "runner").mkdir(parents=True)
    (tmp_path / "engine" / "runner" / "__init__.py").touch()
    (tmp_path / "engine" / "config.py").touch()
    for name in ("test_config.py", "invariants.py", "test_scheduler.py", "runner/test_pool.py", "sampler/test_x.py",
                 "runner/deep/test_y.py"):
        (tmp_path / "tests" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "tests" / name).touch()
    assert [f.split(":")[0] for f in mirror_faults(tmp_path / "tests", tmp_path / "engine")] == [
        "runner/deep/test_y.py", "sampler/test_x.py", "test_scheduler.py"]
