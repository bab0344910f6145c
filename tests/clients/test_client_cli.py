"""The `pie-client` command line against the fake GenerateService: its --help, where its global
options may go, the values it refuses before sending, and its --logprobs and --json output."""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import pie_client
from pie.v1 import generate_pb2 as pb
from pie_client import cli
from pie_client._channel import DEFAULT_TARGET
from pie_client._convert import SAMPLING_FIELDS
from tests.clients.fake_service import FakeGenerateService
from tests.helpers import help_problems

Fake = tuple[FakeGenerateService, str]


def test_every_flag_has_a_description_and_its_default_once() -> None:
    assert help_problems(cli._parser()) == []


@pytest.mark.parametrize("command", [[], ["generate"], ["chat"], ["info"], ["tokenize"], ["detokenize"], ["abort"]])
def test_help_of_every_command_renders(command: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([*command, "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # as one line, whatever the terminal's width
    assert out.startswith(f"usage: {' '.join(['pie-client', *command])} ")
    assert out.count(f"(default: {DEFAULT_TARGET})") == 1  # the global options, also after the subcommand
    if command in (["generate"], ["chat"]):
        for words in ("(default: the server's, 16)", "(default: 0, greedy)", "(default: 1.0, off)", "(default: off)"):
            assert words in out
        assert "JSON lines" in out and "stderr" in out  # where --logprobs and --json write


def test_the_formatter_appends_defaults_once_and_help_problems_sees_a_missing_one() -> None:
    parser = argparse.ArgumentParser(prog="toy", formatter_class=cli.HelpFormatter)
    parser.add_argument("--count", type=int, default=3, help="a count")
    parser.add_argument("--switch", action="store_true", help="a switch")
    parser.add_argument("--said", type=int, default=4, help="says it (default: four)")
    parser.add_argument("--words", default=None, help="nothing sent (default: the server's)")
    text = parser.format_help()
    assert "a count (default: 3)" in text and "a switch (default: off)" in text
    assert "says it (default: four)" in text and "(default: 4)" not in text
    assert help_problems(parser) == []
    parser.add_argument("--silent", default=None, help="no default in words")
    problems = help_problems(parser)
    assert len(problems) == 1 and "--silent" in problems[0], problems


def test_every_sampling_field_has_a_flag() -> None:
    parser = cli._parser()
    args = parser.parse_args(["generate", "x"])
    flags = {name for _, name, _, _, _ in cli._SAMPLING_FLAGS} | {"stop", "stop_token_ids", "ignore_eos", "logit_bias",
                                                                 "disable_speculation"}
    assert all(hasattr(args, name) for name in flags)
    # --keep-special-tokens sets skip_special_tokens, the structured-output flags `structured`
    assert flags | {"skip_special_tokens", "structured"} == SAMPLING_FIELDS
    kinds = {kind for _, kind, _ in cli._STRUCTURED_FLAGS}
    assert kinds == {f.name for f in pb.StructuredOutput.DESCRIPTOR.oneofs_by_name["kind"].fields}
    assert all(hasattr(args, kind) for kind in kinds)


def test_global_options_go_before_or_after_the_subcommand() -> None:
    after = cli._parse(["generate", "hi", "--address", "10.0.0.1:1", "--timeout", "2", "--request-id", "r-a"])
    assert (after.address, after.timeout, after.request_id) == (["10.0.0.1:1"], 2.0, "r-a")
    before = cli._parse(["--address", "10.0.0.1:1", "--timeout", "3", "--request-id", "r-b", "info"])
    assert (before.address, before.timeout, before.request_id) == (["10.0.0.1:1"], 3.0, "r-b")
    both = cli._parse(["--address", "10.0.0.1:1", "--timeout", "3", "tokenize", "x", "--address", "10.0.0.2:2",
                       "--timeout", "4"])
    assert (both.address, both.timeout, both.request_id) == (["10.0.0.1:1", "10.0.0.2:2"], 4.0, None)
    neither = cli._parse(["info"])
    assert (neither.address, neither.timeout, neither.request_id) == ([DEFAULT_TARGET], None, None)


def test_global_options_after_the_subcommand_reach_the_server(fake: Fake, capsys: pytest.CaptureFixture[str]) -> None:
    servicer, address = fake
    assert cli.main(["generate", "Hi", "--address", address, "--request-id", "after-1", "--timeout", "10"]) == 0
    assert servicer.metadata[-1]["x-request-id"] == "after-1" and servicer.requests[-1].request_id == "after-1"
    assert cli.main(["info", "--address", address, "--request-id", "info-1"]) == 0
    assert servicer.metadata[-1]["x-request-id"] == "info-1"
    assert "[finish_reason=length" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (["--max-tokens", "0"], "argument --max-tokens: must be >= 1, got 0 (leave it out for the server's default, 16)"),
        (["--max-tokens", "-5"], "argument --max-tokens: must be >= 1, got -5 (leave it out for the server's default, 16)"),
        (["--max-tokens", "4294967296"], "argument --max-tokens: must be <= 4294967295, got 4294967296"),
        (["--n", "0"], "argument --n: must be >= 1, got 0 (leave it out for the default, 1)"),
        (["--top-k", "-1"], "argument --top-k: must be >= 0, got -1"),
        (["--seed", "-1"], "argument --seed: must be >= 0, got -1"),
        (["--seed", str(2**64)], f"argument --seed: must be <= {2**64 - 1}, got {2**64}"),
        (["--logprobs", "-2"], "argument --logprobs: must be >= 0, got -2"),
        (["--stop-token-id", "2", "--stop-token-id", "-3"], "argument --stop-token-id: must be >= 0, got -3"),
        (["--temperature", "1e39"], "argument --temperature: must fit a 32-bit float (magnitude below 3.4e38), got 1e+39"),
        (["--top-k", "x"], "argument --top-k: invalid int value: 'x'"),
        (["--timeout", "0"], "argument --timeout: must be > 0 and finite, got 0 (leave it out for no deadline)"),
        (["--token-ids"], "argument prompt: token id 1: must be >= 0, got -2"),
        (["--min-tokens", "-1"], "argument --min-tokens: must be >= 0, got -1"),
        (["--prompt-logprobs", "-1"], "argument --prompt-logprobs: must be >= 0, got -1"),
        (["--logit-bias", "5"], "argument --logit-bias: expected ID=BIAS (e.g. 13=-100), got '5'"),
        (["--logit-bias", "x=1"], "argument --logit-bias: expected an integer token id and a number, got 'x=1'"),
        (["--logit-bias=-5=1"], "argument --logit-bias: logit_bias: key -5 must be >= 0, got -5"),
        (["--logit-bias", "5=1e39"],
         "argument --logit-bias: logit_bias[5]: must fit a 32-bit float (magnitude below 3.4e38), got 1e+39"),
    ],
)
def test_values_the_request_cannot_carry_are_refused_by_flag(
    fake: Fake, capsys: pytest.CaptureFixture[str], args: list[str], error: str
) -> None:
    sent = len(fake[0].requests)
    assert cli.main(["generate", "1 -2", "--address", fake[1], *args]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == f"pie-client generate: error: {error}"
    assert len(fake[0].requests) == sent  # nothing reached the server


def test_zeros_that_mean_zero_are_sent(fake: Fake) -> None:
    servicer, address = fake
    argv = ["generate", "Hi", "--address", address, "--seed", "0", "--top-k", "0", "--logprobs", "0", "--max-tokens", "1"]
    assert cli.main(argv) == 0
    sent = servicer.requests[-1].sampling
    assert sent.HasField("seed") and (sent.seed, sent.top_k, sent.logprobs, sent.max_tokens) == (0, 0, 0, 1)


def test_new_sampling_flags_are_sent(fake: Fake) -> None:
    servicer, address = fake
    argv = ["generate", "Hi", "--address", address, "--min-tokens", "3", "--prompt-logprobs", "0",
            "--logit-bias", "13=-100", "--logit-bias", "7=2.5", "--logit-bias", "13=-50"]
    assert cli.main(argv) == 0
    sent = servicer.requests[-1].sampling
    assert sent.min_tokens == 3 and sent.HasField("prompt_logprobs") and sent.prompt_logprobs == 0
    assert dict(sent.logit_bias) == {13: -50.0, 7: 2.5}  # a token given twice: the last bias
    assert cli.main(["generate", "Hi", "--address", address]) == 0
    assert not servicer.requests[-1].sampling.HasField("prompt_logprobs")
    assert not servicer.requests[-1].sampling.disable_speculation
    assert cli.main(["generate", "Hi", "--address", address, "--disable-speculation"]) == 0
    assert servicer.requests[-1].sampling.disable_speculation


@pytest.mark.parametrize("stream", [True, False])
def test_prompt_logprobs_table_goes_to_stderr(fake: Fake, capsys: pytest.CaptureFixture[str], stream: bool) -> None:
    argv = ["--address", fake[1], "generate", "Hi", "--prompt-logprobs", "1"] + ([] if stream else ["--no-stream"])
    assert cli.main(argv) == 0
    out, err = capsys.readouterr()
    assert out == "Hello!\n"
    assert err.splitlines()[:4] == [
        "prompt logprobs:",
        "   #      id  token   logprob  alternatives",
        '   0       1  "<s>"         -',
        '   1      72  "H"     -3.5000  "y" -0.2500',
    ]


def test_detokenize_and_abort_commands(fake: Fake, capsys: pytest.CaptureFixture[str]) -> None:
    servicer, address = fake
    assert cli.main(["detokenize", "1", "72,105", "--address", address]) == 0
    assert json.loads(capsys.readouterr().out) == {"text": "Hi"}
    assert list(servicer.requests[-1].token_ids) == [1, 72, 105]
    assert cli.main(["detokenize", "1", "72", "--keep-special-tokens", "--address", address]) == 0
    assert json.loads(capsys.readouterr().out) == {"text": "<s>H"}
    assert cli.main(["detokenize", "1", "-2", "--address", address]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == "pie-client detokenize: error: argument ID: must be >= 0, got -2"
    assert cli.main(["abort", "live-1", "gone-2", "--address", address]) == 0
    assert json.loads(capsys.readouterr().out) == {"aborted_request_ids": ["live-1"]}
    assert list(servicer.requests[-1].request_ids) == ["live-1", "gone-2"]


def test_logprobs_table_goes_to_stderr_after_the_text(fake: Fake, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--address", fake[1], "generate", "Hi", "--no-stream", "--logprobs", "1"]) == 0
    out, err = capsys.readouterr()
    assert out == "Hello!\n"  # the text alone, ready for a pipe
    assert fake[0].requests[-1].sampling.logprobs == 1
    assert err.splitlines() == [
        "logprobs:",
        "   #      id  token   logprob  alternatives",
        '   0       1  "x"     -0.5000  #9 -1.0000',  # the fake's alternative has no text: its id is shown
        '   1       2  "x"     -0.5000  #9 -1.0000',
        '   2       3  "x"     -0.5000  #9 -1.0000',
        "[finish_reason=stop stop_reason='\\n' prompt_tokens=4 completion_tokens=3 request_id=srv-1]",
    ]
    assert cli.main(["--address", fake[1], "generate", "Hi", "--no-stream"]) == 0
    assert "logprobs" not in capsys.readouterr().err  # only when asked


def test_json_lines_while_streaming(fake: Fake, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--address", fake[1], "generate", "Hi", "--json", "--request-id", "j-1"]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    messages = [json.loads(line) for line in out.splitlines()]
    assert [m["text"] for m in messages] == ["Hel", "lo", "!"]
    assert [m["finish_reason"] for m in messages] == [None, None, "length"]
    assert messages[-1]["usage"] == {"prompt_tokens": 2, "completion_tokens": 4, "total_tokens": 6,
                                     "cached_prompt_tokens": 0}
    assert {m["request_id"] for m in messages} == {"j-1"}
    assert set(messages[0]) == {f.name for f in dataclasses.fields(pie_client.Delta)}


def test_json_of_a_unary_call_is_the_whole_completion(fake: Fake, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--address", fake[1], "generate", "Hi", "--json", "--no-stream", "--logprobs", "1"]) == 0
    out, err = capsys.readouterr()
    assert err == "" and out.count("\n") == 1
    with pie_client.Client(fake[1], timeout=10) as client:
        assert json.loads(out) == dataclasses.asdict(client.generate("Hi", logprobs=1))


def test_n_above_one_is_unary(fake: Fake, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--address", fake[1], "generate", "Hi", "--n", "2"]) == 0
    sent = fake[0].requests[-1]
    assert isinstance(sent, pb.GenerateRequest) and sent.sampling.n == 2
    assert capsys.readouterr().out == "Hello!\n"  # the fake answers one choice whatever n is


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("argv", [["generate", "-"], ["generate"], ["generate", "--no-stream"]])
def test_the_prompt_comes_from_stdin_as_dash_or_when_piped(
    fake: Fake, monkeypatch: pytest.MonkeyPatch, argv: list[str]
) -> None:
    servicer, address = fake
    monkeypatch.setattr(sys, "stdin", io.StringIO("Once upon a time\n"))  # echo's newline is dropped
    assert cli.main([*argv, "--address", address]) == 0
    assert servicer.requests[-1].prompt == "Once upon a time"


def test_stdin_keeps_all_but_the_last_newline_and_feeds_token_ids_and_tokenize(
    fake: Fake, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    servicer, address = fake
    monkeypatch.setattr(sys, "stdin", io.StringIO("line one\n\nline two\r\n"))
    assert cli.main(["generate", "-", "--address", address]) == 0
    assert servicer.requests[-1].prompt == "line one\n\nline two"
    monkeypatch.setattr(sys, "stdin", io.StringIO("5, 6 7\n"))
    assert cli.main(["generate", "--token-ids", "-", "--address", address]) == 0
    assert list(servicer.requests[-1].prompt_token_ids.ids) == [5, 6, 7]
    monkeypatch.setattr(sys, "stdin", io.StringIO("ab\n"))
    capsys.readouterr()
    assert cli.main(["tokenize", "-", "--address", address, "--no-special-tokens"]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == [ord("a"), ord("b")]


@pytest.mark.parametrize(("stdin", "argv", "error"), [
    (_Terminal(""), ["generate"],
     "argument prompt: give the prompt as an argument, or '-' to read it from stdin, or pipe it in"),
    (io.StringIO(""), ["generate", "-"], "argument prompt: stdin held no prompt"),
    (io.StringIO("\n"), ["generate"], "argument prompt: stdin held no prompt"),
    (_Terminal(""), ["tokenize"], "argument text: give the text as an argument, or '-' to read it from stdin, or "
                                  "pipe it in"),
])
def test_no_prompt_anywhere_is_a_usage_error(
    fake: Fake, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], stdin, argv, error
) -> None:
    sent = len(fake[0].requests)
    monkeypatch.setattr(sys, "stdin", stdin)
    assert cli.main([*argv, "--address", fake[1]]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == f"pie-client {argv[0]}: error: {error}"
    assert len(fake[0].requests) == sent


@pytest.mark.slow
def test_a_prompt_piped_into_the_command_line(fake: Fake) -> None:
    """`echo "Once upon a time" | pie-client generate -` as a shell runs it (a real pipe on stdin)."""
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-m", "pie_client", "--address", fake[1], "generate", "-", "--no-stream"],
                          input="Once upon a time\n", capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(root / "clients")})
    assert done.returncode == 0, done.stderr
    assert fake[0].requests[-1].prompt == "Once upon a time"


def test_chat_sends_the_conversation_and_structured_flags_send_their_constraint(
    fake: Fake, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    servicer, address = fake
    history = tmp_path / "chat.json"
    history.write_text(json.dumps([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]))
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps([{"type": "function", "function": {"name": "f"}}]))
    schema = tmp_path / "schema.json"
    schema.write_text('{"type": "object", "properties": {"a": {"type": "integer"}}}')
    argv = ["chat", "Name a color.", "--address", address, "--system", "Be brief.", "--messages", str(history),
            "--tools", str(tools), "--json-schema", str(schema), "--max-tokens", "8"]
    assert cli.main(argv) == 0
    assert capsys.readouterr().out == "Hello!\n"
    sent = servicer.requests[-1]
    assert sent.WhichOneof("prompt_input") == "chat"
    assert [(m.role, m.content) for m in sent.chat.messages] == [
        ("system", "Be brief."), ("user", "Hi"), ("assistant", "Hello."), ("user", "Name a color.")]
    assert json.loads(sent.chat.tools_json) == [{"type": "function", "function": {"name": "f"}}]
    assert not sent.chat.HasField("add_generation_prompt")  # the server's default
    assert json.loads(sent.sampling.structured.json_schema) == json.loads(schema.read_text())
    assert sent.sampling.max_tokens == 8

    assert cli.main(["chat", "--address", address, "--messages", str(history), "--continue", "--no-stream"]) == 0
    sent = servicer.requests[-1]
    assert len(sent.chat.messages) == 2 and sent.chat.continue_final_message
    for flags, kind, value in [(["--regex", "[a-z]+"], "regex", "[a-z]+"), (["--json-object"], "json_object", True)]:
        assert cli.main(["generate", "x", "--address", address, *flags]) == 0
        structured = servicer.requests[-1].sampling.structured
        assert structured.WhichOneof("kind") == kind and getattr(structured, kind) == value
    assert cli.main(["generate", "x", "--address", address, "--choice", "red", "--choice", "日本"]) == 0
    assert list(servicer.requests[-1].sampling.structured.choice.choices) == ["red", "日本"]
    assert cli.main(["generate", "x", "--address", address]) == 0
    assert not servicer.requests[-1].sampling.HasField("structured")


def test_tokenize_chat_sends_the_conversation(fake: Fake, capsys: pytest.CaptureFixture[str]) -> None:
    servicer, address = fake
    assert cli.main(["tokenize", "--chat", "Hello", "--system", "S", "--address", address]) == 0
    sent = servicer.requests[-1]
    assert not sent.text and [(m.role, m.content) for m in sent.chat.messages] == [("system", "S"), ("user", "Hello")]
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"token_ids", "tokens", "count", "rendered_text"}


@pytest.mark.parametrize(("args", "error"), [
    (["chat", "x", "--regex", "a", "--choice", "b"], "argument --choice: not allowed with argument --regex"),
    (["tokenize", "x", "--system", "s"], "--system, --tools and --continue need --chat (or --messages)"),
])
def test_chat_and_structured_usage_errors(fake: Fake, capsys: pytest.CaptureFixture[str], args: list[str],
                                          error: str) -> None:
    sent = len(fake[0].requests)
    assert cli.main([*args, "--address", fake[1]]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == f"pie-client {args[0]}: error: {error}"
    assert len(fake[0].requests) == sent


@pytest.mark.parametrize(("content", "error"), [
    ("{not json", "--json-schema {path}: not JSON"),
    ("[1, 2]", "--json-schema {path}: must hold a JSON schema"),
])
def test_a_schema_file_that_is_not_a_schema_exits_2(fake: Fake, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                    content: str, error: str) -> None:
    path = tmp_path / "schema.json"
    path.write_text(content)
    sent = len(fake[0].requests)
    assert cli.main(["generate", "x", "--address", fake[1], "--json-schema", str(path)]) == 2
    assert f"pie-client: {error.format(path=path)}" in capsys.readouterr().err
    assert len(fake[0].requests) == sent
    assert cli.main(["generate", "x", "--address", fake[1], "--json-schema", str(tmp_path / "missing.json")]) == 2
    assert "missing.json" in capsys.readouterr().err


@pytest.mark.parametrize("json_lines", [False, True])
def test_a_reader_that_leaves_early_ends_it_quietly(fake: Fake, json_lines: bool) -> None:
    """`pie-client generate ... --json | head -1` through a real pipe (text, one line until the end:
    `| head -c 5`): once head has what it wants and exits, the next write fails; pie-client prints
    nothing, exits 141 as a tool that SIGPIPE ended, and its stream is cancelled at the server."""
    servicer, address = fake
    servicer.ticks_cancelled.clear()
    command = [sys.executable, "-m", "pie_client", "--address", address, "generate", "ticks"]
    writer = subprocess.Popen(command + ["--json"] * json_lines, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert writer.stdout is not None and writer.stderr is not None
    head = subprocess.run(["head", "-1"] if json_lines else ["head", "-c", "5"], stdin=writer.stdout, capture_output=True, timeout=60)
    writer.stdout.close()  # head's end is the only reader left: gone, once head has exited
    assert writer.wait(60) == cli.EXIT_BROKEN_PIPE
    assert writer.stderr.read() == b""
    writer.stderr.close()
    first = head.stdout.decode()
    assert first.startswith('{"request_id": "srv-1", "text": "tick "') if json_lines else first == "tick "
    assert servicer.ticks_cancelled.wait(10)
