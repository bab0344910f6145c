"""Every command in README.md is run somewhere. This test runs the cheap ones and checks the rest
against the code; blocks it does not run name the test or script that does:

- the `serve-command` and `test-command` blocks: `.ci/run` runs the test command verbatim on a
  fresh clone (the same install steps as the serve command); `pie serve` with no argument (the
  bundled model) is served by tests/service/test_bundled_model.py and as a subprocess by
  tests/service/test_shutdown.py;
- the `grpcurl` lines: tests/service/test_grpcurl_reflection.py;
- `pie train --generate-corpus ...` (hours of training): tests/training/test_training.py trains
  the same code path small; here only its flags are parsed;
- `pie serve --model models/...` (needs a downloaded model): here its flags are parsed;
- the Developing section's `python -m pytest`, `ruff check . && mypy` and `npx buf` lines: parts of
  the test command (`.ci/run`); its `bash benchmarks/gpu.sh` lines need a GPU:
  tests/benchmarks/test_gpu_suites.py checks the suites they name and runs one on the CPU.

Run here: `pie serve --help`, `pie-client --help`, `pie train --help`, the `pie-client` lines and
the Python blocks against live tiny servers, `python benchmarks/plot_results.py`.
tests/test_readme_fresh_install.py runs the commands again (the `pie bench` and shortened
`pie train` lines too) in an environment made only by the README's install.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pie.engine.config import EngineConfig
from pie.service.logging import RequestSummary
from pie.service.server import BackgroundServer, ServerConfig
from pie.service.servicer import SERVICE_NAME
from tests.chat_templates import make_chat_model_dir
from tests.helpers import help_problems

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


def blocks(lang: str | None = None) -> list[str]:
    return [body for tag, body in FENCE.findall(README) if lang is None or tag == lang]


def shell_lines() -> list[str]:
    """Commands of the untagged and `sh` blocks, continuation lines joined."""
    text = "\n".join(body for tag, body in FENCE.findall(README) if tag in ("", "sh"))
    return [line for line in text.replace("\\\n", " ").splitlines() if line and not line.startswith("{")]


def run(argv: list[str], **kw) -> subprocess.CompletedProcess:
    exe = shutil.which(argv[0], path=str(Path(sys.executable).parent))
    assert exe, f"{argv[0]} is not installed next to {sys.executable}"
    return subprocess.run([exe, *argv[1:]], capture_output=True, text=True, timeout=120, cwd=ROOT, **kw)


def test_every_shell_command_is_accounted_for():
    covered = ("python3 -m venv", "grpcurl ", "pie-client generate ", "pie-client chat ", "pie-client tokenize ",
               "pie-client info", "pie-client detokenize ", "pie-client abort ", "pie train ", "pie serve --model ",
               "pie bench ", "npm ci", "node clients/node/example.mjs ", "python -m pytest ",
               "ruff check . && mypy", "npx buf ", "bash benchmarks/gpu.sh ", "BASELINE=")
    lines = shell_lines()
    assert lines, "no commands found in README.md"
    for line in lines:
        assert line.startswith(covered), f"README command not run by any test: {line}"


@pytest.mark.slow
@pytest.mark.parametrize("argv", [["pie", "serve", "--help"], ["pie-client", "--help"], ["pie", "train", "--help"]])
def test_help_commands_run(argv):
    out = run(argv)
    assert out.returncode == 0, out.stderr
    assert "usage:" in out.stdout


@pytest.mark.slow
def test_bench_launcher():
    """The README's `pie bench` lines run in tests/test_readme_fresh_install.py (after the README's
    own install); here the launcher's listing and its refusal of an unknown name."""
    listing = run(["pie", "bench", "--list"]).stdout
    assert re.search(r"^  throughput +Offline throughput", listing, re.M), listing
    assert re.search(r"^  attention +GPU +Paged attention", listing, re.M), listing
    bad = run(["pie", "bench", "no-such-benchmark"])
    assert bad.returncode == 2 and "unknown benchmark" in bad.stderr


@pytest.mark.slow
def test_every_serve_flag_is_in_the_readme_table():
    help_text = run(["pie", "serve", "--help"]).stdout
    # option lines start with the flag; a boolean pair reads "--x, --no-x"
    flags = set(re.findall(r"(?:^\s+|, )(--[a-z][a-z-]*)", help_text, re.M)) - {"--help"}
    assert len(flags) > 10
    table = README.split("## Flags of `pie serve`", 1)[1].split("\n## ", 1)[0]
    documented = set(re.findall(r"`(--[a-z][a-z-]*)`", table))
    assert flags - documented == set(), "flags missing from the README's table"
    assert documented - flags == set(), "the README's table lists flags `pie serve` does not have"


def _serve_parser() -> argparse.ArgumentParser:
    from pie.service.cli import build_parser

    return build_parser()


def test_documented_commands_that_need_a_big_model_or_hours_parse():
    serve = [shlex.split(line) for line in shell_lines() if line.startswith("pie serve --model ")]
    assert serve
    for argv in serve:
        args = _serve_parser().parse_args(argv[1:])
        assert args.metrics_port == 9090 and args.host == "0.0.0.0"
    train = [shlex.split(line) for line in shell_lines() if line.startswith("pie train ")]
    assert train
    from pie.service.cli import build_parser

    parser = build_parser(with_train=True)
    for argv in train:
        parser.parse_args(argv[1:])


def test_every_flag_of_pie_has_one_line_and_its_default_once():
    from pie.service.cli import build_parser

    assert help_problems(build_parser(with_train=True)) == []


@pytest.mark.slow
def test_plot_script_draws_the_readme_figure(tmp_path):
    assert "](benchmarks/decode_bandwidth.png)" in README and (ROOT / "benchmarks/decode_bandwidth.png").is_file()
    out = subprocess.run([sys.executable, "benchmarks/plot_results.py", "--out", str(tmp_path / "p.png")],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "p.png").read_bytes() == (ROOT / "benchmarks/decode_bandwidth.png").read_bytes(), \
        "benchmarks/decode_bandwidth.png is stale: rerun python benchmarks/plot_results.py"


def test_probe_snippet_and_log_example_match_the_server():
    yaml = blocks("yaml")
    assert len(yaml) == 1
    services = re.findall(r"service: (.*)", yaml[0])
    assert set(services) == {'""', SERVICE_NAME}
    assert set(re.findall(r"port: (\d+)", yaml[0])) == {str(ServerConfig().port)}
    example = [json.loads(b) for tag, b in FENCE.findall(README) if tag == "" and b.startswith("{")]
    assert len(example) == 1
    # error: not OK only; num_draft_tokens, num_accepted_tokens (and acceptance_rate): when it speculated
    emitted = {f.name for f in dataclasses.fields(RequestSummary)} - {"started", "last_token_at", "ended", "ttft_s",
                                                                      "queue_time_s", "error", "num_draft_tokens",
                                                                      "num_accepted_tokens"}
    assert emitted | {"ttft_ms", "queue_ms", "total_ms", "event", "level", "timestamp"} == set(example[0])


@pytest.fixture(scope="module")
def two_servers(tmp_path_factory):
    model_dir = make_chat_model_dir(tmp_path_factory.mktemp("llama"), "chatml")  # the README's chat lines need a template
    cfg = EngineConfig(model=str(model_dir), device="cpu", kv_cache_dtype="fp32", num_kv_blocks=64, max_num_seqs=8)
    with BackgroundServer(ServerConfig(port=0, grace_s=2), cfg) as a, BackgroundServer(ServerConfig(port=0, grace_s=2),
                                                                                       cfg) as b:
        yield a, b


@pytest.mark.slow
def test_client_commands_and_python_blocks_against_live_servers(two_servers, capsys):
    a, b = two_servers
    for line in shell_lines():
        if line.startswith("pie-client "):
            argv = shlex.split(line)
            out = run([argv[0], "--address", a.address, *argv[1:]])
            assert out.returncode == 0, (line, out.stderr)
            assert out.stdout.strip()
    python = blocks("python")
    assert len(python) >= 2
    for code in python:
        code = code.replace("127.0.0.1:50051", a.address).replace("127.0.0.1:50052", b.address)
        exec(compile(code, "README.md", "exec"), {})
    assert capsys.readouterr().out.strip()


def test_error_table_and_proto_comment_match_the_server():
    """README's error table and the .proto's header list exactly service/errors.py's reasons, each
    with its status code."""
    from pie.service.errors import REASONS

    table = README.split("## Errors", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| [^|]+ \| ([A-Z_]+) \| `([A-Z_]+)` \|", table, re.M)
    assert {reason: code for code, reason in rows} == {r: c.name for r, (c, _) in REASONS.items()}
    assert len(rows) == len(REASONS)
    proto = (ROOT / "protos/pie/v1/generate.proto").read_text()
    listed = re.findall(r"^//\s+([A-Z_]+)\s+([A-Z_]+)\s+\S", proto, re.M)
    assert dict((reason, code) for code, reason in listed) == {r: c.name for r, (c, _) in REASONS.items()}
