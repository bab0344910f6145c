"""`pie` command line: `pie serve` starts the gRPC server, `pie train` trains a model (training/cli.py),
`pie bench` runs a script of benchmarks/ (service/bench.py). `pie serve`'s flags are in
service/serve_flags.py, what they build in service/serve_config.py."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

import structlog

from pie.engine.errors import StartupError

from .bench import run_bench
from .help_format import HelpFormatter, OneLineErrorParser
from .logging import configure_logging
from .packages import check_own_packages
from .serve_config import engine_config_from, in_flag_words, server_config_from
from .serve_flags import add_serve_parser
from .server import PieServer

if TYPE_CHECKING:
    from pie.engine.core.engine_core import EngineCore

log = structlog.get_logger(__name__)


def _train(argv: list[str]) -> int:
    """`pie train ...`: the training branch, imported only here so the server never loads it."""
    from pie.training.cli import add_train_parser, run

    parser = argparse.ArgumentParser(prog="pie")
    add_train_parser(parser.add_subparsers(dest="command", required=True), formatter_class=HelpFormatter)
    args = parser.parse_args(["train", *argv])
    try:
        return run(args)
    except KeyboardInterrupt:  # before training began, or a second Ctrl-C: the checkpoint on disk is what there is
        print(f"\npie train: interrupted; {args.out} keeps what was written so far", file=sys.stderr)
        return 130


def build_parser(*, with_train: bool = False) -> argparse.ArgumentParser:
    """The `pie` command line. `pie train` and `pie bench` parse their own flags (main() hands them
    over before this parser runs); `with_train` adds train's real parser (it imports training/),
    for tests of the whole help."""
    parser = argparse.ArgumentParser(prog="pie", description="Paged INT8 LLM inference over gRPC")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=OneLineErrorParser)
    add_serve_parser(sub)
    if with_train:
        from pie.training.cli import add_train_parser

        add_train_parser(sub, formatter_class=HelpFormatter)
    else:
        sub.add_parser("train", help="train a model and export it in the Hugging Face layout (pie train --help)")
    sub.add_parser("bench", help="run a script of benchmarks/ from the source checkout (pie bench --list)")
    return parser


def main(argv: list[str] | None = None, *, engine_setup: Callable[[EngineCore], None] | None = None) -> int:
    """`pie ...`; `engine_setup` (for embedding and tests) is called with the built engine before
    it serves (ServerConfig.engine_setup)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    for warning in check_own_packages():
        print(f"pie: warning: {warning}", file=sys.stderr)
    if argv[:1] == ["train"]:
        return _train(argv[1:])
    if argv[:1] == ["bench"]:
        return run_bench(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    configure_logging(json=None if args.log_format == "auto" else args.log_format == "json", level=args.log_level)
    if args.command == "serve":
        return _serve(args, engine_setup)
    return 0


def _serve(args: argparse.Namespace, engine_setup: Callable[[EngineCore], None] | None) -> int:
    """`pie serve`: the exit status. A start-up failure is one line on stderr naming the flag or
    path and what to do (exit 2: the flags, files or machine cannot work; exit 1: the engine
    failed to load anyway); --log-level debug adds its traceback."""
    try:
        engine_config = engine_config_from(args)
        server_config = dataclasses.replace(server_config_from(args), engine_setup=engine_setup)
    except ValueError as e:
        return _startup_failed(in_flag_words(str(e)), 2)
    server = PieServer(server_config, engine_config)
    try:
        code = asyncio.run(server.serve_forever())
    except StartupError as e:
        return _startup_failed(str(e), 2)
    except Exception as e:  # the checks passed, and loading the model failed all the same
        return _startup_failed(f"the engine failed to start with --model {args.model}: {_one_line(e)} "
                               "(--log-level debug shows the traceback)", 1)
    if code or server.load_interrupted:
        # The engine thread may be stuck inside a device call, or still loading a model: do
        # not wait for it at exit.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return 0


def _startup_failed(message: str, code: int) -> int:
    """Writes the one line (the traceback, at --log-level debug, goes to the log before it)."""
    log.debug("startup_failed", exc_info=True)
    print(f"pie serve: error: {message}", file=sys.stderr)
    return code


def _one_line(error: BaseException) -> str:
    """An exception as one line: its message's lines joined, after its type's name (an engine
    process's failure names the type of what failed in it already)."""
    text = " ".join(line.strip() for line in str(error).splitlines() if line.strip())
    if isinstance(error, RuntimeError) and text.startswith("the engine process"):
        return text.removeprefix("the engine process failed to start: ")
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


if __name__ == "__main__":
    sys.exit(main())
