"""Regenerate the Python stubs of the pie contract from protos/.

    python clients/codegen.py           # write clients/pie/v1/generate_pb2{.py,.pyi,_grpc.py}
    python clients/codegen.py --check   # exit 1 when the committed stubs differ from a fresh run

The output tree mirrors the proto package (`pie/v1/generate.proto` -> `pie.v1.generate_pb2`), so the
generated absolute imports work as they are: no rewriting of imports afterwards. Only files protoc
writes are touched; the hand-written `__init__.py` files stay.

`*_pb2_grpc.py` refuses a grpcio older than its GRPC_GENERATED_VERSION, which grpcio-tools sets to
its own version: a patch release of grpcio-tools would make the committed stubs stale and raise
the floor for every user. It is written as the floor this package declares instead (`grpcio>=`
in clients/pyproject.toml), so the stubs depend on the contract and the declared floor alone.
"""

from __future__ import annotations

import argparse
import filecmp
import importlib.resources
import re
import sys
import tempfile
import tomllib
from pathlib import Path

from grpc_tools import protoc

CLIENTS_DIR = Path(__file__).resolve().parent
REPO_ROOT = CLIENTS_DIR.parent
PROTO_ROOT = REPO_ROOT / "protos"
# Relative to PROTO_ROOT, the path protoc records in the generated code.
PROTO_FILES = ("pie/v1/generate.proto",)
# What protoc writes for each proto file, relative to the output root.
SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def generated_paths() -> list[Path]:
    """Paths (relative to the output root) of every file protoc writes."""
    return [Path(name.removesuffix(".proto") + suffix) for name in PROTO_FILES for suffix in SUFFIXES]


def generate(out_dir: Path) -> None:
    """Run protoc (from grpc_tools, with its bundled well-known protos) into out_dir."""
    well_known = importlib.resources.files("grpc_tools") / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{well_known}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *(str(PROTO_ROOT / name) for name in PROTO_FILES),
    ]
    status = protoc.main(args)
    if status != 0:
        raise SystemExit(f"protoc failed with status {status}")
    floor = grpcio_floor()
    for rel in generated_paths():
        if rel.name.endswith("_pb2_grpc.py"):
            path = out_dir / rel
            text, n = re.subn(r"^GRPC_GENERATED_VERSION = '[^']*'$", f"GRPC_GENERATED_VERSION = '{floor}'",
                              path.read_text(), flags=re.M)
            if n != 1:
                raise SystemExit(f"{rel}: no GRPC_GENERATED_VERSION line to set (a new grpcio-tools layout?)")
            path.write_text(text)


def grpcio_floor() -> str:
    """The lowest grpcio clients/pyproject.toml allows (its `grpcio>=X` dependency)."""
    deps = tomllib.loads((CLIENTS_DIR / "pyproject.toml").read_text())["project"]["dependencies"]
    floors = [m.group(1) for d in deps if (m := re.fullmatch(r"grpcio>=([0-9.]+)(,.*)?", d.replace(" ", "")))]
    if len(floors) != 1:
        raise SystemExit(f"clients/pyproject.toml: expected one `grpcio>=X` dependency, found {deps}")
    return floors[0]


def check() -> int:
    """Generate into a temporary folder and compare bytes; return 0 when fresh, 1 when stale."""
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        stale = []
        for rel in generated_paths():
            committed = CLIENTS_DIR / rel
            if not committed.is_file() or not filecmp.cmp(Path(tmp) / rel, committed, shallow=False):
                stale.append(str(rel))
    if stale:
        print("stale generated files (run `python clients/codegen.py`): " + ", ".join(stale), file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="compare instead of writing; exit 1 when stale")
    args = parser.parse_args(argv)
    if args.check:
        return check()
    generate(CLIENTS_DIR)
    for rel in generated_paths():
        print(f"wrote clients/{rel}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
