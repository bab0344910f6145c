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
