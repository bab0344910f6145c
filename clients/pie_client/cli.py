"""pie-client: call a pie inference server to generate text (streamed by default), answer a chat
with the model's chat template, describe its model (info), tokenize text or detokenize token ids,
or abort requests by id.

Examples:

    pie-client generate "Once upon a time" --max-tokens 64 --temperature 0.8
    pie-client generate "Hi" --no-stream --address 10.0.0.1:50051 --address 10.0.0.2:50051
    pie-client generate "Hi" --logprobs 3            # each token's logprob: a table on stderr
    pie-client generate "Hi" --prompt-logprobs 2     # the prompt tokens' logprobs too
    pie-client generate "Hi" --min-tokens 8 --logit-bias 13=-100
    pie-client generate "Hi" --json | jq -r .text    # JSON lines on stdout, for scripts
    echo "Once upon a time" | pie-client generate -  # the prompt from stdin (also with no PROMPT)
    pie-client chat "Name a color." --system "Answer in one word." --choice red --choice blue
    pie-client chat --messages chat.json --json-schema person.json   # output that parses
    pie-client generate "Date: " --regex '20[0-9]{2}-[01][0-9]-[0-3][0-9]'
    pie-client info
    pie-client tokenize "Hello world"
    pie-client tokenize --chat "Hello"               # the ids of a chat as the model sees it
    pie-client detokenize 1 9038 2501
    pie-client --token-file token.txt abort job-17 job-18

Global options (--address, --timeout, --request-id, --token-file, --tls, --tls-ca, --gzip, --no-retry) go
before or after the subcommand. Given after it, --timeout and --request-id replace a value given
before; --address adds to the list.

Output of generate and chat: stdout carries the generated text and nothing else, written as it
arrives, so it can be piped. Everything else goes to stderr after the text: with --prompt-logprobs
K a table of the prompt's tokens, with --logprobs K one of the generated tokens (each token, its
logprob, the K most likely alternatives with theirs), then one summary line (finish reason, stop
reason, token counts, request id). Several samples (--n) are printed whole,
one after another, each headed by its index. With --json, stdout is JSON lines and stderr stays
empty: while streaming, one object per stream message (request_id, text, token_ids,
finish_reason, stop_reason, usage, logprobs, index; the last has finish_reason and usage); with
--no-stream or --n > 1, one object: the whole completion (choices listed when --n > 1).

Exit status: 0 done; 1 the server answered with an error, printed as one line on stderr (code,
message, field, request id); 2 a usage error, printed by the flag it concerns, before anything is
sent (a value the request cannot carry, such as --max-tokens 0 or a negative --seed); 130
interrupted; 141 stdout closed before the output ended (`| head`), quietly, as a shell reports a
tool that SIGPIPE ended (the call is cancelled).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import grpc

from . import _convert
from ._channel import DEFAULT_TARGET
from .client import Client
from .errors import REQUEST_ID_KEY, PieError
from .types import PromptLogprob, TokenLogprob

_SUMMARY, _, _DETAILS = (__doc__ or "").partition("\n\n")
# The exit status of a pipeline's writer whose reader left (`pie-client ... | head`): what a shell
# reports for a process that SIGPIPE (13) ended, 128 + 13. Python ignores SIGPIPE, so the write
# raises BrokenPipeError instead, and the CLI ends as if the signal had.
EXIT_BROKEN_PIPE = 141

# (flag, SamplingParams field, type, metavar, help) of the sampling options taking one value. An
# absent flag sends nothing, so each help says in words what the server then does (generate.proto).
_SAMPLING_FLAGS: tuple[tuple[str, str, type, str, str], ...] = (
    ("--max-tokens", "max_tokens", int, "N",
     "most tokens to generate; it also stops when the context is full (default: the server's, 16)"),
    ("--temperature", "temperature", float, "T", "softmax temperature; 0 is greedy decoding (default: 0, greedy)"),
    ("--top-k", "top_k", int, "K", "sample among the K most likely tokens only; 0 is off (default: 0, off)"),
    ("--top-p", "top_p", float, "P",
     "nucleus sampling: keep the fewest tokens whose probabilities sum to P, in (0, 1] (default: 1.0, off)"),
    ("--min-p", "min_p", float, "P",
     "drop tokens less likely than P times the most likely one, in [0, 1]; 0 is off (default: 0, off)"),
    ("--repetition-penalty", "repetition_penalty", float, "X",
     "multiplicative penalty (> 0) on tokens already in the prompt or output (default: 1.0, off)"),
    ("--presence-penalty", "presence_penalty", float, "X",
     "additive penalty on tokens already in the output; 0 is off (default: 0, off)"),
    ("--frequency-penalty", "frequency_penalty", float, "X",
     "additive penalty scaled by how often a token is already in the output; 0 is off (default: 0, off)"),
    ("--seed", "seed", int, "N", "seed of this request's random numbers, for reproducible sampling (default: random)"),
    ("--logprobs", "logprobs", int, "K",
     "report each generated token's logprob and its K most likely alternatives: a table on stderr, "
     "or in --json; 0 reports none (default: 0, none)"),
    ("--n", "n", int, "N",
     "independent samples of the prompt, 1..16, printed whole one after another, never streamed (default: 1)"),
    ("--min-tokens", "min_tokens", int, "N",
     "generate at least N tokens: until then end-of-sequence, stop token ids and stop strings cannot end it "
     "(default: 0, off)"),
    ("--prompt-logprobs", "prompt_logprobs", int, "K",
     "report each prompt token's logprob given the tokens before it and the K most likely tokens there "
     "(0: its own only): a table on stderr, or in --json; the server then computes the whole prompt, "
     "without its prefix cache (default: none)"),
)
# The structured-output flags: (flag, StructuredOutput kind, help); at most one per call.
_STRUCTURED_FLAGS: tuple[tuple[str, str, str], ...] = (
    ("--json-schema", "json_schema", "FILE holding a JSON schema: the output is JSON that validates against it "
                                     "('-': stdin) (default: free text)"),
    ("--regex", "regex", "regular expression the whole output matches (default: free text)"),
    ("--choice", "choice", "the output is exactly one of these strings; repeatable (default: free text)"),
    ("--grammar", "grammar", "FILE holding a Lark grammar the output belongs to ('-': stdin) (default: free text)"),
    ("--json-object", "json_object", "the output is a JSON object"),
)


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Every flag's help ends with its default, once: "(default: X)" is appended ("on"/"off" for a
    switch) unless the help already says "(default ...)", which it must where there is no value to
    show (None: the flag then sends nothing, and its help says what the server does). The server's
    `pie` has a formatter of its own; the client stands alone and cannot import it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "(default" in text or not action.option_strings or action.default in (None, argparse.SUPPRESS):
            return text
        if isinstance(action.default, bool):
            return f"{text} (default: {'on' if action.default else 'off'})"
        return text + " (default: %(default)s)"


def _checked(name: str, kind: type) -> Callable[[str], Any]:
    """argparse type of the flag of SamplingParams field `name`: parses the text, then refuses a
    value the request cannot carry as meant (argparse names the flag and exits with status 2)."""

    def parse(text: str) -> Any:
        value = kind(text)  # a ValueError here is argparse's "invalid int value: 'x'"
        problem = _convert.value_problem(name, value)
        if problem:
            raise argparse.ArgumentTypeError(problem)
        return value

    parse.__name__ = kind.__name__
    return parse


def _logit_bias(text: str) -> tuple[int, float]:
    """argparse type of --logit-bias ID=BIAS: a token id and the bias added to its logit."""
    token, sep, bias = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"expected ID=BIAS (e.g. 13=-100), got {text!r}")
    try:
        entry = int(token), float(bias)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer token id and a number, got {text!r}") from None
    problem = _convert.map_problem("logit_bias", *entry)
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return entry


_logit_bias.__name__ = "ID=BIAS"


def _seconds(text: str) -> float:
    value = float(text)
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be > 0 and finite, got {text} (leave it out for no deadline)")
    return value


_seconds.__name__ = "float"


def _add_global_flags(parser: argparse.ArgumentParser, *, after_command: bool) -> None:
    """--address, --timeout and --request-id, on the main parser and again on each subcommand.

    On a subcommand their default is SUPPRESS, so that a value given before the subcommand is not
    overwritten by a default; its --address goes to `address_after`, added to the list by _parse.
    Their helps say their defaults in words, since the subcommand's copies have no value to show.
    """
    group = parser.add_argument_group("global options (before or after the subcommand)")
    default = argparse.SUPPRESS if after_command else None
    group.add_argument(
        "--address", action="append", dest="address_after" if after_command else "address", metavar="ADDRESS",
        default=default,
        help="server host:port, or any gRPC target; repeat to balance over several IP addresses "
             f"(default: {DEFAULT_TARGET})",
    )
    group.add_argument("--timeout", type=_seconds, metavar="SECONDS", default=default,
                       help="deadline of the call in seconds, of all of it for a stream "
                            "(default: none, the call may wait forever)")
    group.add_argument("--request-id", metavar="ID", default=default,
                       help=f"sent as {REQUEST_ID_KEY}; the server logs the request under it "
                            "(default: the server makes one)")
    group.add_argument("--token-file", metavar="PATH", default=default,
                       help="file holding the bearer token of a server started with --auth-token-file "
                            "(default: no token)")
    group.add_argument("--tls", action="store_true", default=argparse.SUPPRESS if after_command else False,
                       help="connect with TLS, checking the server against the system's CA roots (default: off)")
    group.add_argument("--tls-ca", metavar="PATH", default=default,
                       help="connect with TLS, checking the server against this PEM CA bundle (default: none)")
    group.add_argument("--gzip", action="store_true", default=argparse.SUPPRESS if after_command else False,
                       help="compress requests with gzip (default: off)")
    group.add_argument("--no-retry", action="store_true", default=argparse.SUPPRESS if after_command else False,
                       help="send the call once, even when it fails UNAVAILABLE before its answer began (default: "
                            "retried up to 4 attempts, as pie_client.Client does)")


def _connection(args: argparse.Namespace) -> dict[str, Any]:
    """Client keyword arguments of --token-file, --tls, --tls-ca, --gzip and --no-retry (files read
    here, so a missing one is an OSError reported like any other)."""
    kwargs: dict[str, Any] = {"compression": "gzip" if args.gzip else None, "retry": not args.no_retry}
    if args.token_file:
        with open(args.token_file) as f:
            kwargs["token"] = f.read().strip()
    if args.tls_ca:
        with open(args.tls_ca, "rb") as f:
            kwargs["credentials"] = grpc.ssl_channel_credentials(root_certificates=f.read())
    elif args.tls:
        kwargs["tls"] = True
    return kwargs


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pie-client", description=_SUMMARY, epilog=_DETAILS,
                                     formatter_class=HelpFormatter)
    _add_global_flags(parser, after_command=False)
    commands = parser.add_subparsers(dest="command", required=True)

    gen = commands.add_parser("generate", help="generate text from a prompt", description="Generate text from a prompt.",
                              epilog=_DETAILS, formatter_class=HelpFormatter)
    gen.set_defaults(command_parser=gen)  # for usage errors found after parsing
    gen.add_argument("prompt", nargs="?", default=None,
                     help="prompt text (or token ids with --token-ids); - reads it from stdin, less one final "
                          "newline (default: stdin, when it is not a terminal)")
    gen.add_argument("--token-ids", action="store_true", help="PROMPT is token ids separated by spaces or commas")
    _add_generation_flags(gen)
    _add_global_flags(gen, after_command=True)

    chat = commands.add_parser("chat", help="answer a conversation, rendered with the model's chat template",
                               description="Answer a conversation: MESSAGE as the user's turn (after --messages and "
                                           "--system), rendered with the served model's chat template.",
                               epilog=_DETAILS, formatter_class=HelpFormatter)
    chat.set_defaults(command_parser=chat)
    chat.add_argument("message", nargs="?", default=None,
                      help="the user's message; - reads it from stdin, less one final newline (default: stdin when "
                           "it is not a terminal and --messages is not given; none with --messages)")
    _add_chat_flags(chat)
    _add_generation_flags(chat)
    _add_global_flags(chat, after_command=True)

    info = commands.add_parser("info", help="print model info and server load as JSON",
                               description="Print the served model and the server's load as JSON.",
                               formatter_class=HelpFormatter)
    _add_global_flags(info, after_command=True)

    tok = commands.add_parser("tokenize", help="print the token ids of TEXT as JSON",
                              description="Print the token ids of TEXT (and their text pieces) as JSON.",
                              formatter_class=HelpFormatter)
    tok.set_defaults(command_parser=tok)
    tok.add_argument("text", nargs="?", default=None,
                     help="text to tokenize with the served model's tokenizer; - reads it from stdin, less one "
                          "final newline (default: stdin, when it is not a terminal)")
    tok.add_argument("--no-special-tokens", action="store_true",
                     help="do not add BOS and the like, which a text prompt gets")
    tok.add_argument("--chat", action="store_true",
                     help="TEXT is a user's message: print the ids of the chat rendered with the model's template "
                          "(with --messages, --system and --tools as for chat) and the rendered text")
    _add_chat_flags(tok)
    _add_global_flags(tok, after_command=True)

    detok = commands.add_parser("detokenize", help="print the text of token ids as JSON",
                                description="Print the text of token ids as JSON, with the served model's tokenizer.",
                                formatter_class=HelpFormatter)
    detok.add_argument("token_ids", nargs="+", type=_token_id, metavar="ID",
                       help="token ids, as separate arguments or separated by commas")
    detok.add_argument("--keep-special-tokens", action="store_true", help="leave special tokens in the text")
    _add_global_flags(detok, after_command=True)

    abort = commands.add_parser(
        "abort", help="abort in-flight requests by their request ids",
        description="Abort in-flight generate calls of this caller by the request ids they were given, and\n"
                    "print the ids found as JSON. The server tells callers apart by bearer token when it\n"
                    "requires one (--auth-token-file): give --token-file with the token the requests were\n"
                    "sent with. Without tokens a caller is its connection, which this command shares with\n"
                    "no other process: it then finds nothing.",
        formatter_class=HelpFormatter)
    abort.add_argument("request_ids", nargs="+", metavar="ID", help="request ids to abort")
    _add_global_flags(abort, after_command=True)
    return parser


def _token_id(text: str) -> list[int]:
    """argparse type of a detokenize argument: one id, or several separated by commas."""
    try:
        ids = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"token ids are integers, got {text!r}") from None
    for token_id in ids:
        problem = _convert.token_id_problem(token_id)
        if problem:
            raise argparse.ArgumentTypeError(problem)
    return ids


_token_id.__name__ = "token id"


def _add_chat_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("the conversation")
    group.add_argument("--system", metavar="TEXT", default=None, help="a system message first (default: none)")
    group.add_argument("--messages", metavar="FILE", default=None,
                       help="FILE holding the conversation so far: a JSON array of messages (role, content, name, "
                            "tool_call_id, tool_calls); '-': stdin (default: none)")
    group.add_argument("--tools", metavar="FILE", default=None,
                       help="FILE holding a JSON array of tool definitions for the template (default: none)")
    group.add_argument("--continue", dest="continue_final_message", action="store_true",
                       help="the model continues the last message instead of answering it")


def _add_generation_flags(parser: argparse.ArgumentParser) -> None:
    """The sampling, stop, structured-output and output flags of generate and chat."""
    for flag, name, kind, metavar, text in _SAMPLING_FLAGS:
        parser.add_argument(flag, dest=name, type=_checked(name, kind), metavar=metavar, default=None, help=text)
    parser.add_argument("--stop", action="append", metavar="TEXT", default=None,
                        help="stop string, left out of the text; repeatable (default: none)")
    parser.add_argument("--stop-token-id", dest="stop_token_ids", type=_checked("stop_token_ids", int),
                        action="append", metavar="ID", default=None,
                        help="token id that ends generation besides the model's end-of-sequence ids; repeatable "
                             "(default: none)")
    parser.add_argument("--logit-bias", dest="logit_bias", type=_logit_bias, action="append", metavar="ID=BIAS",
                        default=None,
                        help="add BIAS, in [-100, 100], to token ID's logit before sampling (-100 all but bans it, "
                             "100 all but forces it); repeatable (default: none)")
    parser.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence tokens")
    parser.add_argument("--adapter", default=None, metavar="NAME",
                        help="generate with this LoRA adapter, by the name the server loaded it under (default: the "
                             "base model)")
    parser.add_argument("--priority", type=_int32("--priority"), default=0, metavar="P",
                        help="scheduling priority: lower runs first, requests of one priority in arrival order")
    parser.add_argument("--keep-special-tokens", action="store_true", help="leave special tokens in the text")
    parser.add_argument("--disable-speculation", action="store_true",
                        help="decode without speculative decoding where the server speculates: the same tokens, "
                             "at plain decoding's speed")
    structured = parser.add_argument_group("structured output (one of these; the server refuses what does not "
                                           "compile)").add_mutually_exclusive_group()
    for flag, constraint, text in _STRUCTURED_FLAGS:
        if constraint == "json_object":
            structured.add_argument(flag, dest=constraint, action="store_true", help=text)
        else:
            structured.add_argument(flag, dest=constraint, action="append" if constraint == "choice" else "store",
                                    metavar="TEXT" if constraint in ("regex", "choice") else "FILE", default=None,
                                    help=text)
    parser.add_argument("--no-stream", action="store_true", help="one unary call; print the whole answer")
    parser.add_argument("--json", action="store_true",
                        help="print JSON lines on stdout instead of text: one object per stream message, or the "
                             "whole completion with --no-stream or --n > 1; nothing on stderr")


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    """Parsed arguments, with --address given before and after the subcommand joined (or the
    default) and a --token-ids prompt turned into its list of ids."""
    args = _parser().parse_args(argv)
    args.address = (args.address or []) + vars(args).pop("address_after", []) or [DEFAULT_TARGET]
    command_parser = vars(args).pop("command_parser", None)
    text_arg = {"generate": "prompt", "tokenize": "text", "chat": "message"}.get(args.command)
    if args.command == "tokenize":
        args.chat = args.chat or args.messages is not None
        if not args.chat and (args.system is not None or args.tools is not None or args.continue_final_message):
            command_parser.error("--system, --tools and --continue need --chat (or --messages)")
    # A chat may consist of --messages alone (then MESSAGE is not read from stdin).
    optional = args.command in ("chat", "tokenize") and getattr(args, "messages", None) is not None
    value = getattr(args, text_arg) if text_arg is not None else None
    if command_parser is not None and text_arg is not None and (value == "-" or (value is None and not optional)):
        setattr(args, text_arg, _read_stdin(command_parser, text_arg, asked=value == "-"))
    if args.command == "generate" and args.token_ids:
        try:
            args.prompt = [int(t) for t in args.prompt.replace(",", " ").split()]
        except ValueError:
            command_parser.error(f"argument prompt: with --token-ids, must be integers, got {args.prompt!r}")
        for i, token_id in enumerate(args.prompt):
            problem = _convert.token_id_problem(token_id)
            if problem:
                command_parser.error(f"argument prompt: token id {i}: {problem}")
    return args


def _read_stdin(parser: argparse.ArgumentParser, name: str, *, asked: bool) -> str:
    """The text on stdin, for an argument given as "-" (`asked`) or left out with stdin piped in;
    one final newline (echo's, a file's last) is dropped. A usage error when there is none."""
    stdin = sys.stdin
    if stdin is None or (not asked and stdin.isatty()):
        parser.error(f"argument {name}: give the {name} as an argument, or '-' to read it from stdin, or pipe it in")
    text = stdin.read()
    text = text.removesuffix("\n").removesuffix("\r") if text.endswith("\n") else text
    if not text:
        parser.error(f"argument {name}: stdin held no {name}")
    return text


def _read_file(flag: str, path: str) -> str:
    """A file's text for a flag ('-': stdin); OSError (exit 2) when it cannot be read."""
    if path == "-":
        return sys.stdin.read()
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as error:
        raise OSError(f"{flag} {path}: {error.strerror or error}") from None


def _read_json(flag: str, path: str, kind: type | tuple[type, ...], what: str) -> Any:
    """A file's JSON (ValueError, exit 2, when it is not JSON of the kind asked)."""
    try:
        value = json.loads(_read_file(flag, path))
    except json.JSONDecodeError as error:
        raise ValueError(f"{flag} {path}: not JSON ({error})") from None
    if not isinstance(value, kind):
        raise ValueError(f"{flag} {path}: must hold {what}")
    return value


def _structured(args: argparse.Namespace) -> dict[str, Any] | None:
    """The `structured=` keyword of the structured-output flag given, or None."""
    if args.json_schema is not None:
        return {"json_schema": json.dumps(_read_json("--json-schema", args.json_schema, (dict, bool), "a JSON schema"))}
    if args.regex is not None:
        return {"regex": args.regex}
    if args.choice is not None:
        return {"choice": args.choice}
    if args.grammar is not None:
        return {"grammar": _read_file("--grammar", args.grammar)}
    if args.json_object:
        return {"json_object": True}
    return None


def _sampling(args: argparse.Namespace) -> dict[str, Any]:
    """The keywords of Client.generate/stream for the flags given; an absent flag sends nothing."""
    names = [name for _, name, _, _, _ in _SAMPLING_FLAGS] + ["stop", "stop_token_ids"]
    sampling = {name: getattr(args, name) for name in names if getattr(args, name) is not None}
    if args.logit_bias:
        sampling["logit_bias"] = dict(args.logit_bias)  # a token given twice: the last bias
    if args.ignore_eos:
        sampling["ignore_eos"] = True
    if args.keep_special_tokens:
        sampling["skip_special_tokens"] = False
    if args.disable_speculation:
        sampling["disable_speculation"] = True
    structured = _structured(args)
    if structured is not None:
        sampling["structured"] = structured
    return sampling


def _chat(args: argparse.Namespace, message: str | None) -> Any:
    """The pb.ChatInput of --messages, --system, the user's message and --tools."""
    messages: list[dict[str, Any]] = []
    if args.system is not None:
        messages.append({"role": "system", "content": args.system})
    if args.messages is not None:
        listed = _read_json("--messages", args.messages, list, "a JSON array of messages")
        if not all(isinstance(m, dict) for m in listed):
            raise ValueError(f"--messages {args.messages}: every message must be a JSON object")
        messages += listed
    if message is not None:
        messages.append({"role": "user", "content": message})
    tools = _read_json("--tools", args.tools, list, "a JSON array of tools") if args.tools is not None else None
    try:
        return _convert.chat_input(messages, tools=tools, continue_final_message=args.continue_final_message)
    except TypeError as error:  # a message of --messages with a key or value a message cannot have
        raise ValueError(f"--messages {args.messages}: {error}") from None


def _shown(token: str, token_id: int) -> str:
    """A token's text piece in quotes (spaces and newlines visible), or #id when it has none."""
    return json.dumps(token, ensure_ascii=False) if token else f"#{token_id}"


def logprob_table(logprobs: Sequence[TokenLogprob | PromptLogprob]) -> list[str]:
    """Lines of a table of generated (or prompt) tokens: position, token id, text, logprob ("-" for
    the first prompt token, which has none), and the most likely alternatives ("text logprob", most
    likely first)."""
    texts = [_shown(lp.token, lp.token_id) for lp in logprobs]
    width = max([len("token"), *map(len, texts)])
    lines = [f"{'#':>4} {'id':>7}  {'token':<{width}}  {'logprob':>8}  alternatives"]
    for position, (lp, text) in enumerate(zip(logprobs, texts)):
        alternatives = "  ".join(f"{_shown(t.token, t.token_id)} {t.logprob:.4f}" for t in lp.top_logprobs)
        value = "-" if lp.logprob is None else f"{lp.logprob:.4f}"
        lines.append(f"{position:>4} {lp.token_id:>7}  {text:<{width}}  {value:>8}  {alternatives}".rstrip())
    return lines


def _print_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(dataclasses.asdict(obj), ensure_ascii=False) + "\n")
    sys.stdout.flush()


def _int32(flag: str):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} must be a whole number, got {text!r}") from None
        if not -2**31 <= value < 2**31:
            raise argparse.ArgumentTypeError(f"{flag} must fit an int32, got {value}")
        return value
    return parse


def _generate(client: Client, args: argparse.Namespace, prompt: Any) -> None:
    """generate and chat: `prompt` is text, token ids or a pb.ChatInput."""
    sampling = _sampling(args)
    logprobs: dict[int, list[TokenLogprob]] = {}  # by choice
    prompt_logprobs: list[PromptLogprob] = []
    if args.no_stream or sampling.get("n", 1) > 1:  # several choices: printed whole, one after another
        done = client.generate(prompt, request_id=args.request_id, priority=args.priority, adapter=args.adapter,
                                   **sampling)
        if args.json:
            _print_json(done)
            return
        choices = [(c.index, c.text, c.logprobs) for c in done.choices] or [(0, done.text, done.logprobs)]
        several = len(choices) > 1
        sys.stdout.write("\n\n".join(f"[{i}] {text}" if several else text for i, text, _ in choices) + "\n")
        sys.stdout.flush()
        logprobs = {i: items for i, _, items in choices}
        prompt_logprobs = done.prompt_logprobs
        reason, stop, request_id = done.finish_reason, done.stop_reason, done.request_id
        prompt_tokens, completion_tokens = done.prompt_tokens, done.completion_tokens
    else:
        reason, stop, request_id, prompt_tokens, completion_tokens = None, "", "", 0, 0
        for delta in client.stream(prompt, request_id=args.request_id, priority=args.priority, adapter=args.adapter,
                                   **sampling):
            if args.json:
                _print_json(delta)
                continue
            if delta.text:
                sys.stdout.write(delta.text)
                sys.stdout.flush()
            logprobs.setdefault(delta.index, []).extend(delta.logprobs)
            prompt_logprobs = prompt_logprobs or delta.prompt_logprobs
            request_id = delta.request_id or request_id
            if delta.finish_reason is not None:
                reason, stop = delta.finish_reason, delta.stop_reason
            if delta.usage is not None:
                prompt_tokens, completion_tokens = delta.usage.prompt_tokens, delta.usage.completion_tokens
        if args.json:
            return
        sys.stdout.write("\n")
        sys.stdout.flush()
    if args.prompt_logprobs is not None:
        print("\n".join(["prompt logprobs:", *logprob_table(prompt_logprobs)]), file=sys.stderr)
    if args.logprobs:
        for index, items in sorted(logprobs.items()):
            title = f"logprobs of choice {index}:" if len(logprobs) > 1 else "logprobs:"
            print("\n".join([title, *logprob_table(items)]), file=sys.stderr)
    stop_text = f" stop_reason={stop!r}" if stop else ""
    print(
        f"[finish_reason={reason}{stop_text} prompt_tokens={prompt_tokens} "
        f"completion_tokens={completion_tokens} request_id={request_id}]",
        file=sys.stderr,
    )


def _silence_stdout() -> None:
    """Points stdout's file descriptor at the null device, so that the interpreter's last flush at
    exit, of what the closed pipe did not take, raises nothing."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # not a file (a test's capture)
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    try:
        args = _parse(argv)
    except SystemExit as stop:  # --help (0), or a usage error argparse has printed (2)
        return stop.code if isinstance(stop.code, int) else 2
    metadata = [(REQUEST_ID_KEY, args.request_id)] if args.request_id else None  # info and tokenize too
    try:
        with Client(args.address, timeout=args.timeout, metadata=metadata, **_connection(args)) as client:
            if args.command == "generate":
                _generate(client, args, args.prompt)
            elif args.command == "chat":
                _generate(client, args, _chat(args, args.message))
            elif args.command == "info":
                print(json.dumps(dataclasses.asdict(client.model_info()), indent=2))
            elif args.command == "detokenize":
                ids = [t for part in args.token_ids for t in part]
                text = client.detokenize(ids, skip_special_tokens=not args.keep_special_tokens)
                print(json.dumps({"text": text}, ensure_ascii=False))
            elif args.command == "abort":
                print(json.dumps({"aborted_request_ids": client.abort(args.request_ids)}))
            elif args.chat:
                result = client.tokenize_chat(_chat(args, args.text))
                print(json.dumps({"token_ids": result.token_ids, "tokens": result.tokens, "count": len(result),
                                  "rendered_text": result.rendered_text}, ensure_ascii=False))
            else:
                result = client.tokenize(args.text, add_special_tokens=not args.no_special_tokens)
                print(json.dumps({"token_ids": result.token_ids, "tokens": result.tokens, "count": len(result)}))
    except PieError as error:
        print(f"pie-client: {error}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # stdout's reader went away: no message, nothing more to say
        _silence_stdout()
        return EXIT_BROKEN_PIPE
    except ValueError as error:  # a malformed address, or a value the request cannot carry
        print(f"pie-client: {error}", file=sys.stderr)
        return 2
    except OSError as error:  # --token-file or --tls-ca unreadable
        print(f"pie-client: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0
