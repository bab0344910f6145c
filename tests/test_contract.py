"""buf holds the contract (docs/api.md "Errors", buf.yaml): `buf lint` with the STANDARD rules and
`buf breaking` against protos/released.json run in the README's test command. Here: both pass on
the contract as it is, and both fail on a copy with a typical mistake, so the checks can fail."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BUF = ROOT / "node_modules" / ".bin" / "buf"
PROTO = "pie/v1/generate.proto"


@pytest.fixture(scope="module")
def buf() -> Path:
    assert BUF.exists(), "buf is not installed: run `npm ci` in the repository root (the README's test command does)"
    return BUF


def _run(buf: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(buf), *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def _copy(tmp_path: Path, edit) -> Path:
    """protos/ copied with one edit to the .proto, and the repo's buf.yaml rules."""
    shutil.copytree(ROOT / "protos", tmp_path / "protos", ignore=shutil.ignore_patterns("*.json"))
    shutil.copy(ROOT / "buf.yaml", tmp_path / "buf.yaml")
    path = tmp_path / "protos" / PROTO
    text = path.read_text()
    changed = edit(text)
    assert changed != text, "the edit did not apply"
    path.write_text(changed)
    return tmp_path


@pytest.mark.slow
def test_the_contract_passes_lint_and_breaking(buf: Path) -> None:
    for args in (["lint"], ["breaking", "--against", "protos/released.json"]):
        out = _run(buf, *args, cwd=ROOT)
        assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.slow
def test_breaking_catches_a_renumbered_field(buf: Path, tmp_path: Path) -> None:
    copy = _copy(tmp_path, lambda t: t.replace("uint32 max_tokens = 1;", "uint32 max_tokens = 17;"))
    out = _run(buf, "breaking", "--against", str(ROOT / "protos" / "released.json"), cwd=copy)
    assert out.returncode != 0 and 'field "1" with name "max_tokens"' in out.stdout, out.stdout + out.stderr


@pytest.mark.slow
def test_breaking_catches_a_removed_rpc(buf: Path, tmp_path: Path) -> None:
    copy = _copy(tmp_path, lambda t: t.replace("  rpc Tokenize(TokenizeRequest) returns (TokenizeResponse);\n", ""))
    out = _run(buf, "breaking", "--against", str(ROOT / "protos" / "released.json"), cwd=copy)
    assert out.returncode != 0 and "Tokenize" in out.stdout, out.stdout + out.stderr


@pytest.mark.slow
def test_adding_a_field_is_not_breaking(buf: Path, tmp_path: Path) -> None:
    copy = _copy(tmp_path, lambda t: t.replace("message GetModelInfoRequest {}",
                                               "message GetModelInfoRequest {\n  bool verbose = 1;\n}"))
    out = _run(buf, "breaking", "--against", str(ROOT / "protos" / "released.json"), cwd=copy)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.slow
def test_lint_catches_a_badly_named_field(buf: Path, tmp_path: Path) -> None:
    copy = _copy(tmp_path, lambda t: t.replace("uint32 max_tokens = 1;", "uint32 maxTokens = 1;"))
    out = _run(buf, "lint", cwd=copy)
    assert out.returncode != 0 and "maxTokens" in out.stdout, out.stdout + out.stderr


def test_the_released_contract_is_a_buf_image_of_ours() -> None:
    """protos/released.json is what `buf build --exclude-source-info -o protos/released.json` wrote
    when the contract was last released: our file, our package."""
    import json

    image = json.loads((ROOT / "protos" / "released.json").read_text())
    assert [f["name"] for f in image["file"]] == [PROTO]
    assert image["file"][0]["package"] == "pie.v1"
