"""The committed stubs match the .proto, and the .proto documents every element."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PROTO = REPO / "protos" / "pie" / "v1" / "generate.proto"

# Lines that declare something a reader needs explained: services, rpcs, messages, enums, oneofs,
# fields (optional/repeated, scalar, message or map typed) and enum values.
_DECLARATION = re.compile(
    r"^(service|rpc|message|enum|oneof)\s+\w+"
    r"|^(optional\s+|repeated\s+)?([\w.]+|map<[\w.]+,\s*[\w.]+>)\s+\w+\s*=\s*\d+\s*;"
    r"|^[A-Z][A-Z0-9_]*\s*=\s*\d+\s*;"
)


def undocumented(proto_text: str) -> list[str]:
    """Declarations with neither a `//` comment line just above them nor a trailing comment."""
    missing = []
    previous = ""
    for raw in proto_text.splitlines():
        line = raw.strip()
        if not line:
            continue
        if _DECLARATION.match(line) and "//" not in line and not previous.startswith("//"):
            missing.append(line)
        previous = line
    return missing


@pytest.mark.slow
def test_codegen_check_passes() -> None:
    result = subprocess.run(
        [sys.executable, str(REPO / "clients" / "codegen.py"), "--check"], capture_output=True, text=True, cwd=REPO
    )
    assert result.returncode == 0, result.stderr


def test_the_stubs_ask_for_the_declared_grpcio_floor_whatever_generated_them() -> None:
    """grpcio-tools writes its own version as the lowest grpcio the stubs run on; codegen writes
    clients/pyproject.toml's floor instead, so a grpcio-tools patch release (1.85.4 made CI red)
    neither stales the stubs nor raises users' floor."""
    spec = importlib.util.spec_from_file_location("pie_codegen", REPO / "clients" / "codegen.py")
    assert spec is not None and spec.loader is not None
    codegen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(codegen)
    grpcio_floor = codegen.grpcio_floor
    stub = (REPO / "clients" / "pie" / "v1" / "generate_pb2_grpc.py").read_text()
    assert re.findall(r"^GRPC_GENERATED_VERSION = '(.*)'$", stub, re.M) == [grpcio_floor()]
    assert f"grpcio>={grpcio_floor()}" in (REPO / "pyproject.toml").read_text()  # the server's floor too


def test_every_proto_element_has_a_comment() -> None:
    text = PROTO.read_text()
    assert undocumented(text) == []
    assert len(re.findall(r"^\s*rpc ", text, re.M)) == 9  # the checker saw the declarations at all


def test_comment_checker_flags_missing_comments() -> None:
    proto = """
        // Documented.
        message A {
          // Documented field.
          uint32 x = 1;
          repeated string y = 2;
          B z = 3;  // trailing comment counts
          map<uint32, float> m = 4;
        }
        enum E {
          E_UNSPECIFIED = 0;
        }
    """
    assert undocumented(proto) == ["repeated string y = 2;", "map<uint32, float> m = 4;", "enum E {",
                                   "E_UNSPECIFIED = 0;"]
