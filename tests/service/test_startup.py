"""`pie serve`'s start-up failures as an operator meets them: a real process, started the way the
README starts it, that exits non-zero within seconds with one line on stderr naming the flag or
path and what to do, and no traceback (that stays for --log-level debug). Also: what the start-up
checks say once about a folder that can be served, and that nothing listens before they pass."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from grpc_health.v1 import health_pb2
from safetensors.torch import load_file, save_file

from tests.helpers import make_hf_model_dir, wait_until
from tests.service.processes import ROOT, ServerProcess, readiness

pytestmark = pytest.mark.slow

WITHIN_S = 30.0  # a refusal comes in seconds (importing torch is most of it); generous for a busy machine
# A pool that needs no sizing, so that the checks under test are the only ones that can fail.
ARGS = ["--device", "cpu", "--kv-cache-dtype", "fp32", "--num-kv-blocks", "64", "--port", "0"]


def serve(*args: str, timeout: float = WITHIN_S) -> subprocess.CompletedProcess:
    """`python -m service.cli serve ARGS` to its end; fails the test (TimeoutExpired) if it
    outlives `timeout`: a refusal must not wait for anything."""
    return subprocess.run([sys.executable, "-m", "pie.service.cli", "serve", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'clients'}"})


def one_line(proc: subprocess.CompletedProcess, code: int = 2) -> str:
    """The one line on stderr of a refused start, without its "pie serve: error: " prefix."""
    assert proc.returncode == code, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("pie serve: error: "), lines[0]
    return lines[0].removeprefix("pie serve: error: ")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_hf_model_dir(tmp_path_factory.mktemp("startup"), "llama")


@pytest.fixture
def taken_port():
    """A port another process listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for file in src.iterdir():
        (dst / file.name).write_bytes(file.read_bytes())
    return dst


def test_no_such_model_folder(tmp_path):
    proc = serve("--model", str(tmp_path / "models" / "does-not-exist"), *ARGS)
    assert one_line(proc) == (f"--model {tmp_path}/models/does-not-exist: no such folder; give a Hugging "
                              "Face-layout folder holding config.json, *.safetensors and tokenizer.json")


def test_a_draft_model_folder_that_is_not_one(model_dir, tmp_path):
    proc = serve("--model", str(model_dir), *ARGS, "--speculative", "draft", "--draft-model", str(tmp_path / "draft"))
    assert one_line(proc) == (f"--draft-model {tmp_path}/draft: no such folder; give a Hugging "
                              "Face-layout folder holding config.json, *.safetensors and tokenizer.json")
    (tmp_path / "draft").mkdir()
    (tmp_path / "draft" / "config.json").write_bytes((model_dir / "config.json").read_bytes())
    assert one_line(serve("--model", str(model_dir), *ARGS, "--speculative", "draft", "--draft-model",
                          str(tmp_path / "draft"))).startswith(f"--draft-model {tmp_path}/draft: no model.safetensors")


def test_a_file_or_a_folder_without_config_json(model_dir, tmp_path):
    assert one_line(serve("--model", str(model_dir / "model.safetensors"), *ARGS)).startswith(
        f"--model {model_dir / 'model.safetensors'} is a file; give a Hugging Face-layout folder")
    assert one_line(serve("--model", str(tmp_path), *ARGS)).startswith(
        f"--model {tmp_path}: the folder has no config.json; give a Hugging Face-layout folder")


def test_unreadable_config(model_dir, tmp_path):
    broken = _copy(model_dir, tmp_path / "broken")
    (broken / "config.json").write_text("{not json")
    assert one_line(serve("--model", str(broken), *ARGS)).startswith(
        f"--model {broken}: config.json is not valid JSON (Expecting property name enclosed in double quotes")


def test_unsupported_architecture(model_dir, tmp_path):
    gpt2 = _copy(model_dir, tmp_path / "gpt2")
    raw = json.loads((gpt2 / "config.json").read_text())
    (gpt2 / "config.json").write_text(json.dumps({**raw, "model_type": "gpt2"}))
    assert one_line(serve("--model", str(gpt2), *ARGS)) == (
        f"--model {gpt2}: config.json: unsupported model_type 'gpt2'; supported: llama, mistral, qwen2, qwen3")


def test_a_tokenizer_larger_than_the_embedding(tmp_path):
    small = make_hf_model_dir(tmp_path, "llama", vocab_size=128)  # a byte-level BPE has 259 ids at least
    line = one_line(serve("--model", str(small), *ARGS))
    assert line.startswith(f"--model {small}: the tokenizer has ") and "the model's embedding only 128 rows" in line


def test_grpc_port_taken(model_dir, taken_port):
    args = [a if a != "0" else str(taken_port) for a in ARGS]  # --port TAKEN
    assert one_line(serve("--model", str(model_dir), *args)) == (
        f"--port {taken_port}: the port is already in use on 127.0.0.1 (`ss -ltnp 'sport = :{taken_port}'` shows "
        f"by whom); stop that process or pick another port (--port 0: any free port)")


def test_metrics_port_taken(model_dir, taken_port):
    line = one_line(serve("--model", str(model_dir), *ARGS, "--metrics-port", str(taken_port)))
    assert line.startswith(f"--metrics-port {taken_port}: the port is already in use on 127.0.0.1")


def test_host_not_of_this_machine(model_dir):
    assert one_line(serve("--model", str(model_dir), *ARGS, "--host", "192.0.2.1")) == (
        "--host 192.0.2.1: not an address of this machine; use 127.0.0.1 (this machine only) or 0.0.0.0 "
        "(every interface)")


@pytest.mark.parametrize("port", ["70000", "-1", "http"])
def test_ports_outside_the_range_are_refused_by_the_parser(model_dir, port):
    line = one_line(serve("--model", str(model_dir), "--port", port))
    expected = ("argument --port: invalid port value: 'http'" if port == "http"
                else f"argument --port: must be a port in 0..65535 (0: any free port), got {port}")
    assert line == f"{expected} (pie serve --help lists every flag)"


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_cuda_asked_for_without_cuda(model_dir):
    args = [a if a != "cpu" else "cuda" for a in ARGS]
    assert one_line(serve("--model", str(model_dir), *args)).startswith(
        "--device cuda: CUDA is not available here (")


def test_tls_files_missing_or_not_a_pair(model_dir, tmp_path):
    line = one_line(serve("--model", str(model_dir), *ARGS, "--tls-cert", str(tmp_path / "server.pem"),
                          "--tls-key", str(tmp_path / "server.key")))
    assert line == f"--tls-cert {tmp_path}/server.pem: no such file; give the PEM file's path"
    for name in ("a", "b"):
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out",
                        f"{name}.pem", "-days", "1", "-subj", f"/CN={name}"], cwd=tmp_path, check=True,
                       capture_output=True, timeout=60)
    line = one_line(serve("--model", str(model_dir), *ARGS, "--tls-cert", str(tmp_path / "a.pem"),
                          "--tls-key", str(tmp_path / "b.key")))
    assert line == f"--tls-key {tmp_path}/b.key is not the key of --tls-cert {tmp_path}/a.pem; give the pair's key"


def test_a_kv_budget_below_one_sequence(model_dir):
    args = [a for a in ARGS if a not in ("--num-kv-blocks", "64")]
    line = one_line(serve("--model", str(model_dir), *args, "--kv-cache-memory", "0.0001"))
    assert line.startswith("--kv-cache-memory 0.0001 GiB holds ") and "fewer than one sequence of 512 tokens" in line


@pytest.fixture(scope="module")
def missing_tensor(model_dir, tmp_path_factory) -> Path:
    """A folder the checks pass and the loader refuses: a tensor is missing from its checkpoint."""
    broken = _copy(model_dir, tmp_path_factory.mktemp("broken") / "missing-norm")
    tensors = load_file(broken / "model.safetensors")
    del tensors["model.norm.weight"]
    save_file(tensors, broken / "model.safetensors")
    return broken


def _load_failure(path: Path) -> str:
    return (f"the engine failed to start with --model {path}: ValueError: checkpoint {path} does not match its "
            "config (llama): missing tensors: model.norm.weight (--log-level debug shows the traceback)")


@pytest.mark.parametrize("engine", ["--engine-process", "--no-engine-process"])
def test_an_engine_that_fails_to_load_ends_in_one_line_too(missing_tensor, engine):
    """What the checks cannot see fails after the bind, in its own process or on a thread: one line
    (the only one at --log-level warning), exit 1."""
    assert one_line(serve("--model", str(missing_tensor), *ARGS, engine, "--log-level", "warning"),
                    code=1) == _load_failure(missing_tensor)


def test_the_log_around_a_load_failure_and_its_traceback_at_debug(missing_tensor):
    proc = serve("--model", str(missing_tensor), *ARGS, "--log-format", "json")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.splitlines()
    assert lines[-1] == f"pie serve: error: {_load_failure(missing_tensor)}"
    events = [json.loads(line)["event"] for line in lines[:-1]]
    assert events[-2:] == ["server_draining", "server_stopped"] and "server_ready" not in events
    debug = serve("--model", str(missing_tensor), *ARGS, "--log-format", "json", "--log-level", "debug")
    assert debug.returncode == 1 and debug.stderr.splitlines()[-1] == f"pie serve: error: {_load_failure(missing_tensor)}"
    assert "Traceback" in debug.stderr and "startup_failed" in debug.stderr and "engine_process_failed_to_start" in \
        debug.stderr  # the parent's traceback and the engine process's


def test_notes_once_and_nothing_listens_before_the_checks_pass(model_dir, tmp_path):
    """A folder with no end-of-sequence id anywhere serves, with one warning (not one per process:
    the engine process reads the folder again), logged before server_listening."""
    no_eos = _copy(model_dir, tmp_path / "no-eos")
    raw = json.loads((no_eos / "config.json").read_text())
    (no_eos / "config.json").write_text(json.dumps({**raw, "eos_token_id": None}))
    (no_eos / "generation_config.json").write_text(json.dumps({"bos_token_id": 1}))
    tok_cfg = json.loads((no_eos / "tokenizer_config.json").read_text())
    (no_eos / "tokenizer_config.json").write_text(json.dumps({k: v for k, v in tok_cfg.items() if k != "eos_token"}))
    server = ServerProcess(["--model", str(no_eos), *ARGS, "--engine-process"])
    try:
        port = wait_until(lambda: (server.event("server_listening") or {}).get("port"), timeout=60,
                          what="the server to listen")
        wait_until(lambda: readiness(f"127.0.0.1:{port}") == health_pb2.HealthCheckResponse.SERVING, timeout=60,
                   what="readiness")
    finally:
        server.proc.terminate()
        server.proc.wait(30)
        server.finish()
    events = [e.get("event") for e in server.events]
    assert events.count("model_has_no_eos") == 1 and events.count("model_has_no_chat_template") == 1, events
    assert events.index("model_has_no_eos") < events.index("server_listening") < events.index("server_ready")
    assert server.event("model_has_no_eos")["level"] == "warning"


def test_flag_values_the_engine_refuses_are_one_line_in_flag_words(model_dir):
    assert one_line(serve("--model", str(model_dir), *ARGS, "--block-size", "3")) == \
        "--block-size must be a power of two, got 3"


def test_config_errors_name_the_flag_not_the_field(tmp_path):
    from pie.service.cli import build_parser
    from pie.service.serve_config import in_flag_words, server_config_from

    assert in_flag_words("max_num_seqs must be >= 1") == "--max-num-seqs must be >= 1"
    assert in_flag_words("kv_cache_memory_bytes must be >= 1") == "--kv-cache-memory must be >= 1"
    assert in_flag_words("the folder is gone") == "the folder is gone"  # not a field: left as it is
    parser = build_parser()
    with pytest.raises(ValueError, match=f"^--auth-token-file {tmp_path}/tokens: cannot read it "):
        server_config_from(parser.parse_args(["serve", "--auth-token-file", str(tmp_path / "tokens")]))
    (tmp_path / "tokens").write_text("# none yet\n")
    with pytest.raises(ValueError, match=f"^--auth-token-file {tmp_path}/tokens: no tokens"):
        server_config_from(parser.parse_args(["serve", "--auth-token-file", str(tmp_path / "tokens")]))


def test_kv_tiers_refused_before_binding(model_dir, tmp_path):
    """The host and disk tiers' settings are checked before the server binds, in the flags' words."""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    line = one_line(serve("--model", str(model_dir), *ARGS, "--kv-host-gib", "0.01", "--kv-disk-dir",
                          str(blocker / "kv"), "--kv-disk-gib", "0.01"))
    assert line.startswith(f"--kv-disk-dir {blocker}/kv: cannot write there"), line
    line = one_line(serve("--model", str(model_dir), *ARGS, "--kv-disk-dir", str(tmp_path), "--kv-disk-gib", "1"))
    assert line.startswith("--kv-disk-dir needs --kv-host-gib"), line
    line = one_line(serve("--model", str(model_dir), *ARGS, "--kv-host-gib", "1048576"))
    assert "more host memory than is available" in line, line
