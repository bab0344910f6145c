"""The contract from Node.js: tests/node/*.test.mjs (node:test) call a real `pie serve` through
clients/node/pie.mjs, the example other services copy. Here: start the server on a loopback port
with a tiny random model, run `node --test` against it, and check what only the server's log can
show (the cancelled stream ended CANCELLED). Needs Node 20 and `npm ci` (the README's test command
runs it); without them the test fails, so a CI that lost Node cannot pass silently."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from grpc_health.v1 import health_pb2

from tests.chat_templates import make_chat_model_dir
from tests.helpers import save_peft_adapter
from tests.service.processes import ServerProcess, readiness

# slow: runs node against a live server
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "clients" / "node"
NODE_TESTS = ROOT / "tests" / "node"
READY_WITHIN_S = 60.0
CONTEXT = 16384  # tokens: cancel.test.mjs's stream would run for tens of seconds if nothing stopped it
# What the Node tests count on: a KV pool that holds the whole context (1024 blocks of 16), and one
# batch slot with one waiting place, which errors.test.mjs fills to get QUEUE_FULL.
SERVE_ARGS = ["--device", "cpu", "--kv-cache-dtype", "fp32", "--num-kv-blocks", "1024", "--max-num-seqs", "1",
              "--max-waiting", "1", "--host", "127.0.0.1", "--port", "0"]
CANCELLED_REQUEST_ID = "node-cancelled-stream"  # cancel.test.mjs's REQUEST_ID


def _example_dependencies() -> dict[str, str]:
    return json.loads((EXAMPLE / "package.json").read_text())["dependencies"]


def test_the_example_pins_the_versions_that_ci_installs() -> None:
    root = json.loads((ROOT / "package.json").read_text())["devDependencies"]
    for name, version in _example_dependencies().items():
        assert re.fullmatch(r"\d+\.\d+\.\d+", version), f"clients/node/package.json: {name} {version} is not exact"
        assert root.get(name) == version, f"{name}: clients/node pins {version}, the root package.json {root.get(name)}"


def _log_tail(server: ServerProcess, lines: int = 40) -> str:
    return "\n".join(json.dumps(e) for e in server.events[-lines:])


def _ready_address(server: ServerProcess) -> str:
    """Waits for the port the server bound (--port 0) and for readiness (the model loaded)."""
    deadline = time.monotonic() + READY_WITHIN_S
    address = None
    while time.monotonic() < deadline:
        assert server.proc.poll() is None, f"pie serve exited with {server.proc.returncode}:\n{_log_tail(server)}"
        listening = server.event("server_listening")
        if listening is not None:
            address = f"127.0.0.1:{listening['port']}"
            if readiness(address) == health_pb2.HealthCheckResponse.SERVING:
                return address
        time.sleep(0.1)
    raise AssertionError(f"pie serve was not ready within {READY_WITHIN_S:.0f} s (address {address}):\n"
                         f"{_log_tail(server)}")


def test_node_calls_a_live_server(tmp_path: Path) -> None:
    node = shutil.which("node")
    assert node is not None, "node is not on PATH: the Node.js client test needs Node 20 (README: the test command)"
    missing = [name for name in _example_dependencies() if not (ROOT / "node_modules" / name).is_dir()]
    assert not missing, f"node_modules/ lacks {missing}: run `npm ci` in the repository root (the README's test command does)"

    # A ChatML model: chat.test.mjs renders conversations with its template.
    model = make_chat_model_dir(tmp_path, "chatml", weight_scale=4.0, max_position_embeddings=CONTEXT)
    # adapters.test.mjs: one LoRA adapter loaded at start, two slots (it loads the same one again)
    adapter = save_peft_adapter(model, tmp_path / "node-lora", seed=3, scale=3.0, r=8, lora_alpha=16,
                                target_modules=["q_proj", "v_proj", "down_proj"])
    server = ServerProcess(["--model", str(model), *SERVE_ARGS, "--lora", f"node-lora={adapter}", "--max-loras", "2",
                            "--max-lora-rank", "16"])
    try:
        address = _ready_address(server)
        done = subprocess.run([node, "--test", "--test-concurrency=1", "--test-reporter=spec", str(NODE_TESTS)],
                              cwd=ROOT, env={**os.environ, "PIE_ADDRESS": address, "PIE_ADAPTER_DIR": str(adapter)},
                              capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0, (f"node --test exited with {done.returncode}:\n{done.stdout}\n{done.stderr}\n"
                                      f"--- pie serve's log ---\n{_log_tail(server)}")
        summary = next((e for e in server.events
                        if e.get("event") == "request_done" and e.get("request_id") == CANCELLED_REQUEST_ID), None)
        assert summary is not None, f"no request_done line for {CANCELLED_REQUEST_ID}:\n{_log_tail(server)}"
        assert summary["status"] == "CANCELLED", summary
        assert summary["generated_tokens"] < CONTEXT // 2, summary  # stopped early, not run out
    finally:
        server.proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            server.proc.wait(10)
        server.finish()  # kills it if SIGTERM was not enough, and collects the rest of its log
