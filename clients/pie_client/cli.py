"""The `pie-client` command line: generate (streamed by default), info, tokenize.

    pie-client generate "Once upon a time" --max-tokens 64 --temperature 0.8
    pie-client --address 10.0.0.1:50051 --address 10.0.0.2:50051 generate "Hi" --no-stream
    pie-client info
    pie-client tokenize "Hello world"

Generated text goes to stdout as it arrives; finish reason and usage go to stderr. A failed RPC
prints one line to stderr and exits with status 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence
from typing import Any

from ._channel import DEFAULT_TARGET
from .client import Client
from .errors import PieError

# (flag, SamplingParams field, type) of the sampling options taking one value.
_SAMPLING_FLAGS: tuple[tuple[str, str, type], ...] = (
    ("--max-tokens", "max_tokens", int),
    ("--temperature", "temperature", float),
    ("--top-k", "top_k", int),
    ("--top-p", "top_p", float),
    ("--min-p", "min_p", float),
    ("--repetition-penalty", "repetition_penalty", float),
    ("--presence-penalty", "presence_penalty", float),
    ("--frequency-penalty", "frequency_penalty", float),
    ("--seed", "seed", int),
    ("--logprobs", "logprobs", int),
    ("--n", "n", int),
)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pie-client", description="Call a pie inference server.")
    parser.add_argument(
        "--address",
        action="append",
        help=f"server host:port, or any gRPC target; repeat to balance over several (default {DEFAULT_TARGET})",
    )
    parser.add_argument("--timeout", type=float, default=None, help="deadline of the call in seconds")
    parser.add_argument("--request-id", default=None, help="sent as x-request-id")
    commands = parser.add_subparsers(dest="command", required=True)

    gen = commands.add_parser("generate", help="generate text from a prompt")
    gen.add_argument("prompt", help="prompt text (or token ids with --token-ids)")
    gen.add_argument("--token-ids", action="store_true", help="PROMPT is token ids separated by spaces or commas")
    for flag, name, kind in _SAMPLING_FLAGS:
        gen.add_argument(flag, dest=name, type=kind, default=None)
    gen.add_argument("--stop", action="append", default=None, help="stop string; repeatable")
    gen.add_argument("--stop-token-id", dest="stop_token_ids", type=int, action="append", default=None)
    gen.add_argument("--ignore-eos", action="store_true", default=None)
    gen.add_argument("--keep-special-tokens", action="store_true", help="leave special tokens in the text")
    gen.add_argument("--no-stream", action="store_true", help="one unary call; print the whole answer")

    commands.add_parser("info", help="print model info and server load as JSON")

    tok = commands.add_parser("tokenize", help="print the token ids of TEXT as JSON")
    tok.add_argument("text")
    tok.add_argument("--no-special-tokens", action="store_true", help="do not add BOS and the like")
    return parser


def _sampling(args: argparse.Namespace) -> dict[str, Any]:
    names = [name for _, name, _ in _SAMPLING_FLAGS] + ["stop", "stop_token_ids", "ignore_eos"]
    sampling = {name: getattr(args, name) for name in names if getattr(args, name) is not None}
    if args.keep_special_tokens:
        sampling["skip_special_tokens"] = False
    return sampling


def _prompt(args: argparse.Namespace) -> str | list[int]:
    if not args.token_ids:
        return args.prompt
    return [int(t) for t in args.prompt.replace(",", " ").split()]


def _generate(client: Client, args: argparse.Namespace) -> None:
    prompt, sampling = _prompt(args), _sampling(args)
    if args.no_stream or sampling.get("n", 1) > 1:  # several choices: printed whole, one after another
        done = client.generate(prompt, request_id=args.request_id, **sampling)
        texts = [c.text for c in done.choices] or [done.text]
        sys.stdout.write("\n\n".join(f"[{i}] {t}" if len(texts) > 1 else t for i, t in enumerate(texts)) + "\n")
        sys.stdout.flush()
        reason, stop, request_id = done.finish_reason, done.stop_reason, done.request_id
        prompt_tokens, completion_tokens = done.prompt_tokens, done.completion_tokens
    else:
        reason, stop, request_id, prompt_tokens, completion_tokens = None, "", "", 0, 0
        for delta in client.stream(prompt, request_id=args.request_id, **sampling):
            if delta.text:
                sys.stdout.write(delta.text)
                sys.stdout.flush()
            request_id = delta.request_id or request_id
            if delta.finish_reason is not None:
                reason, stop = delta.finish_reason, delta.stop_reason
            if delta.usage is not None:
                prompt_tokens, completion_tokens = delta.usage.prompt_tokens, delta.usage.completion_tokens
        sys.stdout.write("\n")
        sys.stdout.flush()
    stop_text = f" stop_reason={stop!r}" if stop else ""
    print(
        f"[finish_reason={reason}{stop_text} prompt_tokens={prompt_tokens} "
        f"completion_tokens={completion_tokens} request_id={request_id}]",
        file=sys.stderr,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    args = _parser().parse_args(argv)
    try:
        with Client(args.address or DEFAULT_TARGET, timeout=args.timeout) as client:
            if args.command == "generate":
                _generate(client, args)
            elif args.command == "info":
                print(json.dumps(dataclasses.asdict(client.model_info()), indent=2))
            else:
                result = client.tokenize(args.text, add_special_tokens=not args.no_special_tokens)
                print(json.dumps({"token_ids": result.token_ids, "tokens": result.tokens, "count": len(result)}))
    except PieError as error:
        print(f"pie-client: {error}", file=sys.stderr)
        return 1
    except ValueError as error:  # a malformed address or token id list
        print(f"pie-client: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0
