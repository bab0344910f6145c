"""Dependencies point one way. Read from the source (every import statement, also those inside
functions), so a lazy import cannot slip past:

    clients/   nothing of the server, no torch
    service/   gRPC and the engine's handle; no torch, triton or kernels of its own
    engine/    model and kernels; never the service or training
    training/  model; never the engine, service or kernels
    model/     torch alone: attention (AttentionBackend) and fused ops (FusedOps) come from its owner
    kernels/   torch and triton; nothing else of ours

and checked once more by importing `model` and `kernels` in a fresh interpreter."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SERVER = {"engine", "kernels", "model", "service", "training"}
FORBIDDEN = {
    "clients": SERVER | {"torch", "triton"},
    "service": {"torch", "triton", "kernels"},
    "engine": {"service", "training", "clients", "pie_client"},
    "training": {"engine", "service", "kernels", "triton", "clients", "pie_client"},
    "model": {"engine", "service", "training", "kernels", "triton", "clients", "pie_client"},
    "kernels": (SERVER - {"kernels"}) | {"clients", "pie_client"},
}


def imported_packages(source: str) -> set[str]:
    """Top-level names of every absolute import in the source (relative ones stay in the package)."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


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
    ("model", ["kernels", "engine", "service", "training", "triton"]),
    ("kernels", ["engine", "model", "service", "training"]),
])
def test_importing_loads_nothing_it_must_not(package: str, never: list[str]) -> None:
    code = (f"import sys, {package}; "
            f"bad = sorted(m for m in sys.modules if m.split('.')[0] in {never!r}); "
            "assert not bad, bad")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr


OURS = ("engine", "kernels", "model", "service", "training", "pie_client")


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT / "clients" if path.is_relative_to(ROOT / "clients") else ROOT).with_suffix("")
    parts = list(rel.parts)
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
    assert "engine.core" in graph and "engine.scheduler" in graph["engine.core"]
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle)
