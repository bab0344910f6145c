"""clients/node/example.mjs's flags, run with `node` as a user runs it: values the request cannot
carry are refused in one line with exit status 2 before anything reaches the server (a listening
socket here sees no connection), and --help prints the usage. (tests/node/example.test.mjs runs
it against a live server.)"""

from __future__ import annotations

import shutil
import socket
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "clients" / "node" / "example.mjs"
HINT = " (node example.mjs --help shows the usage)"


@pytest.fixture(scope="module")
def node() -> str:
    path = shutil.which("node")
    assert path is not None, "node is not on PATH: the Node.js example's tests need Node 20 (README: the test command)"
    return path


@pytest.fixture
def server_socket():
    """A listening socket standing in for the server: a refused flag must never connect to it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        s.settimeout(0.2)
        yield s


def run(node: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([node, str(EXAMPLE), *args], capture_output=True, text=True, timeout=60, cwd=ROOT)


@pytest.mark.parametrize(("flags", "problem"), [
    (["--max-tokens=-3"], '--max-tokens must be a whole number in 1..4294967295, got "-3"'),
    (["--max-tokens", "abc"], '--max-tokens must be a whole number in 1..4294967295, got "abc"'),
    (["--max-tokens", "0"], '--max-tokens must be a whole number in 1..4294967295, got "0"'),
    (["--max-tokens", "4294967296"], '--max-tokens must be a whole number in 1..4294967295, got "4294967296"'),
    (["--max-tokens", "1.5"], '--max-tokens must be a whole number in 1..4294967295, got "1.5"'),
    (["--max-tokens", "0x10"], '--max-tokens must be a whole number in 1..4294967295, got "0x10"'),
    (["--temperature", "abc"], '--temperature must be a number, got "abc"'),
    (["--temperature="], '--temperature must be a number, got ""'),
    (["--temperature", "1e39"], "--temperature must fit a 32-bit float (magnitude below 3.4e38), got 1e39"),
])
def test_values_the_request_cannot_carry_never_reach_the_server(node, server_socket, flags, problem):
    address = f"127.0.0.1:{server_socket.getsockname()[1]}"
    done = run(node, address, "Once upon a time", *flags)
    assert done.returncode == 2, done.stderr
    assert done.stderr == f"example.mjs: error: {problem}{HINT}\n" and done.stdout == ""
    with pytest.raises(TimeoutError):
        server_socket.accept()  # no connection was made


@pytest.mark.parametrize(("args", "problem"), [
    ([], "give the PROMPT (and, before it, the ADDRESS if not 127.0.0.1:50051)"),
    (["a", "b", "c"], "expected [ADDRESS] PROMPT, got 3 arguments (quote a prompt with spaces)"),
    (["hi", "--bogus"], "Unknown option '--bogus'."),
    (["hi", "--max-tokens", "-3"], "Option '--max-tokens' argument is ambiguous."),
])
def test_usage_errors_are_one_line(node, args, problem):
    done = run(node, *args)
    assert done.returncode == 2 and len(done.stderr.splitlines()) == 1, done.stderr
    assert done.stderr.startswith(f"example.mjs: error: {problem}") and done.stderr.endswith(f"{HINT}\n")


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help(node, flag):
    done = run(node, flag)
    assert done.returncode == 0 and done.stderr == ""
    assert done.stdout.startswith("usage: node example.mjs [ADDRESS] PROMPT [--max-tokens N] [--temperature T]\n")
    for words in ("--max-tokens N", "1..4294967295 (default: 64)", "--temperature T", "(default: 0.7",
                  "(default: 127.0.0.1:50051)", "Exit status: 0 done; 1 the server answered with an error"):
        assert words in done.stdout
