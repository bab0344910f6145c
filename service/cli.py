"""`pie` command line: `pie serve` starts the gRPC server, `pie train` trains a model (training/cli.py),
`pie bench` runs a script of benchmarks/."""

from __future__ import annotations

import argparse
import ast
import asyncio
import dataclasses
import functools
import os
import re
import runpy
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

import structlog

from pie.engine.config import (
    ATTENTION_BACKENDS,
    KV_CACHE_DTYPES,
    KV_SMOOTHING,
    LOGPROBS_MODES,
    MAX_SPECULATIVE_TOKENS,
    MODEL_DTYPES,
    SPECULATIVE_METHODS,
    EngineConfig,
)
from pie.engine.errors import StartupError
from pie.service.auth import read_token_file
from pie.service.logging import configure_logging
from pie.service.packages import check_own_packages
from pie.service.server import ConnectionConfig, PieServer, ServerConfig, TlsConfig
from pie.service.validation import Limits

if TYPE_CHECKING:
    from pie.engine.core.engine_core import EngineCore

log = structlog.get_logger(__name__)


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Every flag's help ends with its default, once: appended as "(default: X)" ("on"/"off" for a
    switch) unless the help already says "(default: ...)", which a flag without a value (None)
    must do in words. Descriptions keep their line breaks. Used by `pie serve`, `pie train` and the
    benchmarks."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "(default" in text or not action.option_strings or action.default in (None, argparse.SUPPRESS):
            return text
        if isinstance(action.default, bool):
            return f"{text} (default: {'on' if action.default else 'off'})"
        return text + " (default: %(default)s)"


class OneLineErrorParser(argparse.ArgumentParser):
    """A usage error is one line naming the flag, and where the flags are listed (argparse would
    print `pie serve`'s 30-line usage above it)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} ({self.prog} --help lists every flag)\n")


def _port(text: str) -> int:
    """argparse type of --port and --metrics-port: a TCP port, refused outside 0..65535 (gRPC
    would take 70000 modulo 65536, and -1 as 65535)."""
    port = int(text)  # a ValueError is argparse's "invalid port value: 'x'"
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port in 0..65535 (0: any free port), got {port}")
    return port


_port.__name__ = "port"


def _gib(text: str) -> float:
    """argparse type of --kv-cache-memory: a positive, finite number of GiB."""
    value = float(text)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of GiB, got {text}")
    return value


_gib.__name__ = "GiB"


def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve a model over gRPC", formatter_class=HelpFormatter)
    d = EngineConfig()
    p.add_argument("--model", default=d.model,
                   help="Hugging Face-layout model folder (default: the bundled story model)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (loopback unless told otherwise)")
    p.add_argument("--port", type=_port, default=50051, help="port to bind, 0..65535 (0 = any free port)")
    p.add_argument("--device", default=d.device, help="auto, cpu, cuda or cuda:N")
    p.add_argument("--dtype", default=d.dtype, choices=MODEL_DTYPES,
                   help="weights/activations dtype (auto: bf16 on cuda; on the cpu bf16 for a bf16 checkpoint "
                        "where the CPU has AVX512-BF16 or AMX, else fp32)")
    p.add_argument("--kv-cache-dtype", default=d.kv_cache_dtype, choices=KV_CACHE_DTYPES,
                   help="KV pages: int8 (one fp16 scale per token and head; ~2x the tokens of bf16) or exact")
    p.add_argument("--kv-smoothing", default=d.kv_smoothing, choices=KV_SMOOTHING,
                   help="int8 pages: even out K/V channel magnitudes in the weights (model/smoothing.py); auto "
                        "keeps it per layer and KV head where a calibration pass at load measures that it "
                        "lowers the int8 attention error; on: everywhere; off: never")
    p.add_argument("--block-size", type=int, default=d.block_size, help="tokens per KV block")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=d.enable_prefix_caching,
                   help="reuse the KV blocks of prompt prefixes already computed (a seeded request gives the same "
                        "tokens either way; --no-enable-prefix-caching computes every prompt in full)")
    p.add_argument("--kv-cache-memory", type=_gib, default=None,
                   help="KV pool budget in GiB (default: from --gpu-memory-fraction on CUDA; on the CPU what "
                        "--max-num-seqs sequences of the whole context can use, at most 1 GiB)")
    p.add_argument("--gpu-memory-fraction", type=float, default=d.gpu_memory_fraction,
                   help="share of the GPU's memory for weights, activations and the KV pool, which gets "
                        "what the weights and a profiling step leave")
    p.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                   help="run the engine in its own process, apart from the gRPC loop "
                        "(--no-engine-process: on a thread of the server process)")
    p.add_argument("--stream-interval", type=int, default=1,
                   help="tokens per stream message after the first (or the end): larger values send fewer "
                        "messages when hundreds of streams are open")
    p.add_argument("--enforce-eager", action="store_true",
                   help="run decode (and verify) steps eagerly instead of replaying CUDA graphs")
    p.add_argument("--mixed-graph-max-tokens", type=int, default=d.mixed_graph_max_tokens,
                   help="steps carrying prompt tokens of up to this many tokens replay piecewise CUDA graphs "
                        "(attention eager between them), longer ones run eagerly; 0 = all of them eagerly")
    p.add_argument("--num-kv-blocks", type=int, default=None, help="exact KV pool size in blocks, overriding the budget (default: sized from the budget)")
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs, help="running sequences per step at most")
    p.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens,
                   help="tokens per step at most (prefill chunks + decodes)")
    p.add_argument("--decode-stall-factor", type=float, default=d.decode_stall_factor,
                   help="a step carrying prompt tokens beside running decodes may take at most this many times "
                        "the decode step of the batch being built (learnt from step times): long prompts are cut into chunks that keep "
                        "inter-token stalls bounded; 0 = only --max-num-batched-tokens bounds a step")
    p.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    p.add_argument("--max-waiting", type=int, default=d.max_waiting,
                   help="waiting-queue bound; beyond it requests get RESOURCE_EXHAUSTED")
    p.add_argument("--attention-backend", default=d.attention_backend, choices=ATTENTION_BACKENDS,
                   help="attention kernels: triton on cuda, torch reference on cpu (auto)")
    p.add_argument("--tensor-parallel-size", type=int, default=d.tensor_parallel_size,
                   help="GPUs (or CPU processes) sharing the model: attention heads, the MLP, the embedding and "
                        "the LM head split over N processes; on cuda rank r uses device index base + r, the base "
                        "taken from --device")
    p.add_argument("--cpu-threads", type=int, default=None,
                   help="torch threads when the model runs on the CPU (default: the usable cores but one)")
    p.add_argument("--seed", type=int, default=d.seed, help="seeds the seeds of requests that bring none")
    p.add_argument("--logprobs-mode", default=d.logprobs_mode, choices=LOGPROBS_MODES,
                   help="what generated tokens' logprobs are: raw = log-softmax of the model's logits (as vLLM v1); "
                        "processed = of the logits the token was chosen from, after logit_bias, min_tokens, "
                        "penalties, temperature and the top-k/top-p/min-p filters")
    p.add_argument("--speculative", default=None, choices=SPECULATIVE_METHODS,
                   help="speculative decoding: propose tokens from the request's earlier text (ngram: prompt "
                        "lookup) or with a small model (draft: --draft-model), and verify them in one forward pass; "
                        "output as plain decoding's (greedy: the same tokens; sampled: the same distribution), only "
                        "faster where proposals are accepted (default: off)")
    p.add_argument("--num-speculative-tokens", type=int, default=None, metavar="K",
                   help=f"tokens proposed per request and step at most, 1..{MAX_SPECULATIVE_TOKENS}; needs "
                        f"--speculative (default: {d.num_speculative_tokens})")
    p.add_argument("--draft-model", default=None, metavar="DIR",
                   help="Hugging Face-layout folder of the draft model of --speculative draft, with the served "
                        "model's tokenizer (default: none)")
    p.add_argument("--speculative-max-batch", type=int, default=None, metavar="N",
                   help="speculate only in steps with at most N running decodes (in larger batches verifying "
                        f"costs more than it saves); needs --speculative (default: {d.speculative_max_batch})")
    p.add_argument("--prompt-lookup-max", type=int, default=None, metavar="N",
                   help="--speculative ngram: the longest suffix of the request's tokens looked up earlier in its "
                        f"prompt and output (default: {d.prompt_lookup_max})")
    p.add_argument("--prompt-lookup-min", type=int, default=None, metavar="N",
                   help="--speculative ngram: the shortest suffix looked up; shorter matches propose nothing "
                        f"(default: {d.prompt_lookup_min})")
    p.add_argument("--grace", type=float, default=30.0, help="seconds in-flight requests get after SIGTERM")
    p.add_argument("--model-name", default=None, help="name reported by GetModelInfo and in the metrics' model_name label (default: the model folder's name)")
    p.add_argument("--max-message-bytes", type=int, default=16 << 20,
                   help="largest gRPC message received or sent; larger ones get RESOURCE_EXHAUSTED")
    p.add_argument("--max-prompt-chars", type=int, default=Limits().max_prompt_chars,
                   help="text prompts (and chats) longer than this are refused before tokenizing")
    p.add_argument("--chat-template", metavar="FILE", default=None,
                   help="Jinja chat template that renders chat requests instead of the model's own "
                        "(default: the model's: chat_template.jinja or tokenizer_config.json's chat_template)")
    p.add_argument("--max-concurrent-rpcs", type=int, default=None,
                   help="RPCs in progress at most (streams included); beyond it RESOURCE_EXHAUSTED (default: no cap)")
    p.add_argument("--step-timeout", type=float, default=60.0,
                   help="watchdog, in the server process: with requests in flight and no engine step finished for "
                        "this long (a hung step, a stopped or frozen engine process), every RPC fails with "
                        "UNAVAILABLE, readiness turns off and the server exits with status 3 (0 = off)")
    p.add_argument("--tls-cert", default=None, help="PEM certificate chain: serve TLS (needs --tls-key) (default: plaintext)")
    p.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert (default: none)")
    p.add_argument("--tls-client-ca", default=None,
                   help="PEM CA bundle: require client certificates signed by it (mutual TLS) (default: no client certificates)")
    p.add_argument("--auth-token-file", default=None,
                   help="file of accepted bearer tokens, one per line: every RPC but health and reflection "
                        "needs `authorization: Bearer <token>` metadata (default: no authentication)")
    p.add_argument("--metrics-port", type=_port, default=None,
                   help="serve Prometheus metrics at http://HOST:PORT/metrics; 0 = any free port (default: off)")
    c = ConnectionConfig()
    p.add_argument("--keepalive-time", type=float, default=c.keepalive_time_s,
                   help="seconds between the server's pings on an idle connection (keeps NATs and load balancers "
                        "from dropping it)")
    p.add_argument("--keepalive-timeout", type=float, default=c.keepalive_timeout_s,
                   help="seconds a ping may go unanswered before the connection is closed")
    p.add_argument("--keepalive-permit-without-calls", action=argparse.BooleanOptionalAction,
                   default=c.keepalive_permit_without_calls,
                   help="ping, and accept clients' keepalive pings, on connections with no call in flight")
    p.add_argument("--keepalive-min-client-interval", type=float, default=c.min_client_ping_interval_s,
                   help="seconds between a client's pings the server accepts; more often is answered with GOAWAY "
                        "(too_many_pings)")
    p.add_argument("--max-connection-age", type=float, default=c.max_connection_age_s,
                   help="seconds after which a connection is asked to close (GOAWAY) so that round-robin clients "
                        "reconnect and spread over replicas; in-flight calls finish first; 0 = never")
    p.add_argument("--max-connection-age-grace", type=float, default=None,
                   help="seconds in-flight calls get after --max-connection-age before they are cut "
                        "(default: as long as they need)")
    p.add_argument("--compression", choices=("none", "gzip"), default=c.compression,
                   help="compress responses (requests are accepted gzip-compressed either way)")
    p.add_argument("--log-format", choices=("auto", "json", "console"), default="auto",
                   help="log lines on stderr: JSON objects, or readable console lines (auto: console on a terminal)")
    p.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default="info",
                   help="least severe log level written")


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


BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@dataclasses.dataclass(frozen=True, slots=True)
class Benchmark:
    name: str
    summary: str  # the docstring's first sentence, up to a colon
    needs_gpu: bool  # the script's NEEDS_GPU = True


def benchmarks(folder: Path = BENCHMARKS) -> list[Benchmark]:
    """The runnable scripts of benchmarks/ (those with a `__main__` block), read without importing
    them: a listing must not load torch or touch a GPU."""
    found = []
    for path in sorted(folder.glob("*.py")) if folder.is_dir() else []:
        tree = ast.parse(path.read_text(), str(path))
        if not any(isinstance(node, ast.If) and "__main__" in ast.unparse(node.test) for node in tree.body):
            continue
        needs_gpu = any(isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "NEEDS_GPU" for t in node.targets)
                        and isinstance(node.value, ast.Constant) and node.value.value is True for node in tree.body)
        paragraph = " ".join((ast.get_docstring(tree) or "").split("\n\n")[0].split())
        sentence = paragraph.split(". ")[0].split(": ")[0].rstrip(".")
        found.append(Benchmark(path.stem, sentence, needs_gpu))
    return found


def _bench(argv: list[str]) -> int:
    """`pie bench NAME [ARGS...]` runs benchmarks/NAME.py with ARGS, as `python benchmarks/NAME.py`
    would (the scripts live in the source checkout, next to their RESULTS.md)."""
    found = {b.name: b for b in benchmarks()}
    if not argv or argv[0] in ("-h", "--help", "--list"):
        print("usage: pie bench NAME [ARGS...]   (pie bench NAME --help: that benchmark's own flags)")
        if not found:
            print(f"no benchmarks: {BENCHMARKS} is not there (they run from a source checkout)")
            return 0 if argv[:1] == ["--list"] else 2
        print("benchmarks (GPU: needs a CUDA GPU):")
        width = max(map(len, found))
        for b in found.values():
            print(f"  {b.name:<{width}}  {'GPU' if b.needs_gpu else '   '}  {b.summary}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in found:
        print(f"pie bench: unknown benchmark {name!r}; one of: {', '.join(found) or 'none'}", file=sys.stderr)
        return 2
    saved = sys.argv
    sys.argv = [str(BENCHMARKS / f"{name}.py"), *rest]
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    except SystemExit as e:
        if isinstance(e.code, str):  # sys.exit("message"): Python prints it and exits 1
            print(e.code, file=sys.stderr)
            return 1
        return 0 if e.code is None else e.code if isinstance(e.code, int) else 1
    finally:
        sys.argv = saved
    return 0


def build_parser(*, with_train: bool = False) -> argparse.ArgumentParser:
    """The `pie` command line. `pie train` and `pie bench` parse their own flags (main() hands them
    over before this parser runs); `with_train` adds train's real parser (it imports training/),
    for tests of the whole help."""
    parser = argparse.ArgumentParser(prog="pie", description="Paged INT8 LLM inference over gRPC")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=OneLineErrorParser)
    _add_serve(sub)
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
        return _bench(argv[1:])
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
        server_config = dataclasses.replace(_server_config(args), engine_setup=engine_setup)
    except ValueError as e:
        return _startup_failed(_in_flag_words(str(e)), 2)
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


# The flags of speculative decoding that mean nothing without --speculative (EngineConfig fields);
# given alone they are refused rather than ignored. --draft-model is EngineConfig's to refuse.
_SPECULATIVE_FLAGS = ("num_speculative_tokens", "speculative_max_batch", "prompt_lookup_max", "prompt_lookup_min")


def engine_config_from(args: argparse.Namespace) -> EngineConfig:
    """`pie serve`'s flags as an EngineConfig; a ValueError names the field or flag that is wrong."""
    given = {name: getattr(args, name) for name in _SPECULATIVE_FLAGS if getattr(args, name) is not None}
    if given and args.speculative is None:
        flags = " and ".join(f"--{name.replace('_', '-')}" for name in given)
        raise ValueError(f"{flags} {'needs' if len(given) == 1 else 'need'} --speculative ngram or draft "
                         "(speculative decoding is off without it)")
    return EngineConfig(
        model=args.model, device=args.device, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype,
        kv_smoothing=args.kv_smoothing, block_size=args.block_size, kv_cache_memory_bytes=None if args.kv_cache_memory is None else int(args.kv_cache_memory * 2**30),
        gpu_memory_fraction=args.gpu_memory_fraction, enforce_eager=args.enforce_eager,
        mixed_graph_max_tokens=args.mixed_graph_max_tokens,
        num_kv_blocks=args.num_kv_blocks, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
        decode_stall_factor=args.decode_stall_factor,
        max_waiting=args.max_waiting, seed=args.seed,
        attention_backend=args.attention_backend, cpu_threads=args.cpu_threads,
        tensor_parallel_size=args.tensor_parallel_size, enable_prefix_caching=args.enable_prefix_caching,
        logprobs_mode=args.logprobs_mode, speculative=args.speculative, draft_model=args.draft_model,
        **given)


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


# EngineConfig's fields whose flag is not the field's name with dashes.
_FIELD_FLAGS = {"kv_cache_memory_bytes": "--kv-cache-memory"}
# A field's name in EngineConfig's messages, with the value it was given where one follows
# (speculative='draft'); group 1 the name, group 2 or 3 the value.
_FIELD_WORD = re.compile(r"\b([a-z][a-z0-9_]*)(?:='([^']*)'|=([^\s,;:)]+))?")


def _flag(field_name: str) -> str:
    return _FIELD_FLAGS.get(field_name, "--" + field_name.replace("_", "-"))


def _in_flag_words(message: str) -> str:
    """EngineConfig says "block_size must be ..."; the operator typed --block-size. Translated: a
    field's name that starts the message followed by "must" or "is" (so "speculative decoding"
    stays words), one with an underscore anywhere, and `name='value'` anywhere (`--name value`)."""
    fields = {f.name for f in dataclasses.fields(EngineConfig)}

    def word(m: re.Match) -> str:
        name, value = m.group(1), m.group(2) if m.group(2) is not None else m.group(3)
        if name not in fields:
            return m.group(0)
        if value is not None:
            return f"{_flag(name)} {value}"
        if "_" in name or (m.start() == 0 and message[m.end():].startswith((" must ", " is "))):
            return _flag(name)
        return m.group(0)

    return _FIELD_WORD.sub(word, message)


def _server_config(args: argparse.Namespace) -> ServerConfig:
    if (args.tls_cert is None) != (args.tls_key is None):
        raise ValueError("--tls-cert and --tls-key go together")
    if args.tls_client_ca and args.tls_cert is None:
        raise ValueError("--tls-client-ca needs --tls-cert and --tls-key")
    for name in ("max_message_bytes", "max_prompt_chars"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    if args.max_concurrent_rpcs is not None and args.max_concurrent_rpcs < 1:
        raise ValueError("--max-concurrent-rpcs must be >= 1")
    if args.stream_interval < 1:
        raise ValueError("--stream-interval must be >= 1")
    if args.step_timeout < 0:
        raise ValueError("--step-timeout must be >= 0 (0 = off)")
    for name in ("keepalive_time", "keepalive_timeout", "keepalive_min_client_interval"):
        if not getattr(args, name) > 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0 seconds")
    if args.max_connection_age < 0 or (args.max_connection_age_grace or 0) < 0:
        raise ValueError("--max-connection-age and --max-connection-age-grace must be >= 0")
    connection = ConnectionConfig(
        keepalive_time_s=args.keepalive_time, keepalive_timeout_s=args.keepalive_timeout,
        keepalive_permit_without_calls=args.keepalive_permit_without_calls,
        min_client_ping_interval_s=args.keepalive_min_client_interval,
        max_connection_age_s=args.max_connection_age or None, max_connection_age_grace_s=args.max_connection_age_grace,
        compression=args.compression)
    tls = TlsConfig(args.tls_cert, args.tls_key, args.tls_client_ca) if args.tls_cert else None
    try:
        tokens = read_token_file(args.auth_token_file) if args.auth_token_file else ()
    except OSError as e:
        raise ValueError(f"--auth-token-file {args.auth_token_file}: cannot read it ({e.strerror or e})") from e
    except ValueError as e:
        raise ValueError(f"--auth-token-file {e}") from e
    return ServerConfig(
        host=args.host, port=args.port, grace_s=args.grace, model_name=args.model_name,
        max_message_bytes=args.max_message_bytes, limits=Limits(max_prompt_chars=args.max_prompt_chars),
        max_concurrent_rpcs=args.max_concurrent_rpcs, step_timeout_s=args.step_timeout or None, tls=tls,
        auth_tokens=tokens, connection=connection,
        metrics_port=args.metrics_port, engine_process=args.engine_process, stream_interval=args.stream_interval,
        chat_template=args.chat_template,
        log_setup=functools.partial(configure_logging, json=None if args.log_format == "auto" else args.log_format == "json",
                                    level=args.log_level))


if __name__ == "__main__":
    sys.exit(main())
