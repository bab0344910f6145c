"""The client stands alone: importing it pulls in no server-side package."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

# slow: every test imports the client in a fresh interpreter (a subprocess)
pytestmark = pytest.mark.slow

CLIENTS = Path(__file__).resolve().parents[2] / "clients"


def _run(code: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(CLIENTS)}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=cwd, env=env)


def test_import_pulls_no_server_packages(tmp_path: Path) -> None:
    code = (
        "import pie_client, pie_client.cli, sys; "
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
        "('torch', 'engine', 'model', 'service', 'kernels', 'training')); "
        "assert not bad, bad"
    )
    result = _run(code, tmp_path)
    assert result.returncode == 0, result.stderr


def test_errors_work_without_google_rpc_protos(tmp_path: Path) -> None:
    # googleapis-common-protos is optional: block it and errors must still map, minus field details.
    code = """
import sys
sys.modules["google.rpc"] = None
import grpc
import pie_client
from pie_client import errors
assert errors.status_pb2 is None

class FakeError(grpc.RpcError):
    def code(self): return grpc.StatusCode.INVALID_ARGUMENT
    def details(self): return "bad top_p"
    def trailing_metadata(self): return [("grpc-status-details-bin", b"\\x08\\x03"), ("x-request-id", "r1")]

err = pie_client.from_rpc_error(FakeError())
assert type(err) is pie_client.InvalidArgument, type(err)
assert (err.details, err.request_id, err.field_violations) == ("bad top_p", "r1", []), vars(err)
"""
    result = _run(code, tmp_path)
    assert result.returncode == 0, result.stderr
