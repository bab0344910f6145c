"""Another distribution's `kernels` (or `model`, ...) next to pie: the CLI says so at start."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

# slow: every test runs `pie` in a subprocess
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def _pie(*args: str, path: list[Path]) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, [*path, ROOT, ROOT / "clients"]))}
    return subprocess.run([sys.executable, "-c", "import sys; from service.cli import main; sys.exit(main())", *args],
                          capture_output=True, text=True, env=env, cwd=path[0] if path else ROOT, timeout=120)


def test_a_shadowing_package_stops_the_cli_with_the_cause(tmp_path: Path) -> None:
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "__init__.py").write_text("")
    result = _pie("bench", "--list", path=[tmp_path])
    assert result.returncode == 2, result.stderr
    assert "'kernels' imports from" in result.stderr and "pip uninstall kernels" in result.stderr


def test_another_distribution_with_the_name_is_a_warning(tmp_path: Path) -> None:
    info = tmp_path / "kernels-0.4.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: kernels\nVersion: 0.4.0\n")
    (info / "top_level.txt").write_text("kernels\n")
    result = _pie("bench", "--list", path=[tmp_path])
    assert result.returncode == 0, result.stderr
    assert "warning: the distribution(s) kernels also install a package named 'kernels'" in result.stderr


def test_a_clean_environment_says_nothing(tmp_path: Path) -> None:
    result = _pie("bench", "--list", path=[])
    assert result.returncode == 0 and "warning" not in result.stderr, result.stderr
