"""The commands of deploy/README.md: the tests run them as written (`command`), and every one of
them is either run by a test (RUN_BY) or excused with its reason (NOT_RUN)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "deploy" / "README.md"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)

# Prefix of a command -> the test that runs it as written (with its own values of the $PIE_...
# variables the README exports).
RUN_BY = {
    "mkdir -p \"$PIE_NGINX_DIR\"": "tests/deploy/test_replicas.py",
    "envsubst ": "tests/deploy/test_replicas.py",
    "nginx -t ": "tests/deploy/test_replicas.py",
    "nginx -p ": "tests/deploy/test_replicas.py",
    "pie-client --address \"$PIE_GRPC_LISTEN\"": "tests/deploy/test_replicas.py",
    "curl ": "tests/deploy/test_replicas.py",
    "kubernetes-validate ": "tests/deploy/test_k8s_manifests.py",
}

# Commands no test runs as written, and why.
NOT_RUN = {
    "pie serve --port 50051 --http-port 8001 --metrics-port 9091 &":
        "fixed ports; test_replicas.py starts the same servers with --port 0 --http-port 0, on the CPU "
        "with small settings",
    "pie serve --port 50052 --http-port 8002 --metrics-port 9092 &": "as the line above",
    "export PIE_NGINX_DIR=/tmp/pie-nginx PIE_GRPC_LISTEN=127.0.0.1:8080 PIE_HTTP_LISTEN=127.0.0.1:8000":
        "example values; test_replicas.py exports its own folder and free ports",
    "export PIE_REPLICA_1_GRPC=127.0.0.1:50051 PIE_REPLICA_2_GRPC=127.0.0.1:50052": "as the line above",
    "export PIE_REPLICA_1_HTTP=127.0.0.1:8001 PIE_REPLICA_2_HTTP=127.0.0.1:8002": "as the line above",
    "kubectl apply -f deploy/k8s/deployment.yaml -f deploy/k8s/service.yaml -f deploy/k8s/pdb.yaml":
        "needs a cluster; test_k8s_manifests.py validates the objects offline",
    "kubectl apply -f deploy/k8s/inferencepool.yaml":
        "needs a cluster with the Inference Extension's CRD; test_k8s_manifests.py validates it offline",
}


def commands() -> list[str]:
    """The lines of the README's `sh` blocks, continuation lines joined."""
    text = "\n".join(body for tag, body in FENCE.findall(README.read_text()) if tag == "sh")
    return [line.strip() for line in text.replace("\\\n", " ").splitlines() if line.strip()]


def command(prefix: str, suffix: str = "") -> str:
    """The one README command that starts with `prefix` (and ends with `suffix`)."""
    found = [line for line in commands() if line.startswith(prefix) and line.endswith(suffix)]
    assert len(found) == 1, f"deploy/README.md: {len(found)} commands like {prefix!r}...{suffix!r}: {found}"
    return found[0]


def run(line: str, env: Mapping[str, str], timeout: float = 60.0) -> subprocess.CompletedProcess:
    """A README command in bash from the repository root, this Python's scripts first on PATH."""
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
    return subprocess.run(["bash", "-c", line], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PATH": path, **env})
