"""Other distributions next to pie: one that installs a `pie` package of its own is named at start;
those with generic names (Hugging Face's `kernels`, a `service`, an `engine`) are no concern."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

# slow: every test runs `pie` in a subprocess
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def _pie(*args: str, path: list[Path], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, [*path, ROOT / "clients"]))}
    return subprocess.run([sys.executable, "-c", "import sys; from pie.service.cli import main; sys.exit(main())", *args],
                          capture_output=True, text=True, env=env, cwd=cwd, timeout=120)


def _distribution(folder: Path, name: str, top_level: list[str]) -> None:
    """An installed distribution's metadata, as pip leaves it in site-packages."""
    info = folder / f"{name}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    (info / "top_level.txt").write_text("".join(f"{t}\n" for t in top_level))


def test_another_distribution_of_a_pie_package_is_named(tmp_path: Path) -> None:
    _distribution(tmp_path, "pie-charts", ["pie"])
    result = _pie("bench", "--list", path=[tmp_path], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert ("pie: warning: the distribution(s) pie-charts also install a package named 'pie'; installing either "
            "again may overwrite the other's files (pip uninstall pie-charts)") in result.stderr


def test_generic_names_beside_pie_are_no_concern(tmp_path: Path) -> None:
    """What pie's top-level packages used to collide with (issue 43): a `kernels` distribution
    and package, an `engine` and a `service`, on the path ahead of pie."""
    for name in ("kernels", "engine", "service"):
        _distribution(tmp_path, name, [name])
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text("raise ImportError('not this one')\n")
    result = _pie("bench", "--list", path=[tmp_path], cwd=tmp_path)
    assert result.returncode == 0 and "warning" not in result.stderr, result.stderr


def test_a_clean_environment_says_nothing(tmp_path: Path) -> None:
    result = _pie("bench", "--list", path=[], cwd=tmp_path)
    assert result.returncode == 0 and "warning" not in result.stderr, result.stderr
