"""`pie serve`'s flags: names, types, defaults and help. service/serve_config.py turns the parsed
flags into the engine's and the server's configs."""

from __future__ import annotations

import argparse

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

from .help_format import HelpFormatter
from .http.tool_parsers import PARSERS
from .server import ConnectionConfig
from .validation import Limits


def _port(text: str) -> int:
    """argparse type of --port and --metrics-port: a TCP port, refused outside 0..65535 (gRPC
    would take 70000 modulo 65536, and -1 as 65535)."""
    port = int(text)  # a ValueError is argparse's "invalid port value: 'x'"
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port in 0..65535 (0: any free port), got {port}")
    return port


_port.__name__ = "port"


def _lora(text: str) -> tuple[str, str]:
    """--lora NAME=DIR."""
    name, sep, folder = text.partition("=")
    if not sep or not name.strip() or not folder.strip():
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=DIR (an adapter's name, then its PEFT folder)")
    return name.strip(), folder.strip()


def _gib(text: str) -> float:
    """argparse type of --kv-cache-memory: a positive, finite number of GiB."""
    value = float(text)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of GiB, got {text}")
    return value


_gib.__name__ = "GiB"


def _gib_or_zero(text: str) -> float:
    """argparse type of --kv-host-gib: a finite number of GiB, 0 for none."""
    value = float(text)
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of GiB >= 0, got {text}")
    return value


_gib_or_zero.__name__ = "GiB"


def add_serve_parser(sub: argparse._SubParsersAction) -> None:
    """`pie serve` and its flags, each with its help (the flag table `pie serve --help` prints)."""
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
    p.add_argument("--kv-host-gib", type=_gib_or_zero, default=d.kv_host_gib,
                   help="host memory (GiB; pinned on CUDA) below the KV pool: full prefix blocks the pool lets go "
                        "of are copied there as stored (int8 pages with their scales) and read back on a later hit "
                        "instead of computed; LRU (default: 0, no host tier)")
    p.add_argument("--kv-disk-dir", default=None, metavar="DIR",
                   help="a disk tier below --kv-host-gib: blocks are also written to files in DIR (LRU within "
                        "--kv-disk-gib), which a restarted server of the same model, dtypes and block size serves "
                        "again; files of another model or failing their checksum are skipped (default: none)")
    p.add_argument("--kv-disk-gib", type=_gib, default=None,
                   help="the disk tier's size in GiB (with --kv-disk-dir) (default: none)")
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
                   help="a step carrying prompt tokens beside a streamed decode may take at most this many times "
                        "the decode step of the batch being built (learnt from step times): long prompts are cut into chunks that keep "
                        "the streams' inter-token stalls bounded (requests answered whole are not bounded); "
                        "0 = only --max-num-batched-tokens bounds a step")
    p.add_argument("--decode-stall-share", type=float, default=d.decode_stall_share,
                   help="share of the streams' inter-token gaps (below 0.01) that steps past --decode-stall-factor's "
                        "bound may stall while a backlog of prompts waits: a burst's first steps take the whole "
                        "budget while few streams decode, buying back what the bound costs in tokens/s at the "
                        "price of a higher inter-token p99 (0.005: +12%% tokens/s, p99 3.5x the median instead of "
                        "2.7x on a burst of 256 streams); 0 = every step with a streamed decode bounded (default: 0)")
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
    p.add_argument("--batch-invariant", action="store_true",
                   help="one answer per seed: every kernel reduces in an order set by the request's own tokens, "
                        "so a seeded request gives the same tokens alone or in any batch, cold, cached or chunked "
                        "(the Triton path on CUDA; slower: docs/serving.md says how much)")
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
    p.add_argument("--lora", action="append", default=[], metavar="NAME=DIR", type=_lora,
                   help="a LoRA adapter (a PEFT folder: adapter_config.json, adapter_model.safetensors) loaded at "
                        "start under NAME, which requests give as their adapter (gRPC `adapter`, HTTP `model`); "
                        "repeatable; more load at run time (LoadAdapter, POST /v1/load_lora_adapter)")
    p.add_argument("--max-loras", type=int, default=None, metavar="N",
                   help="GPU slots for the LoRA adapters requests run on at once, set aside before the KV pool "
                        "is sized; more adapters may be loaded, idle ones leave their slot (LRU) and a request "
                        "waits for one (default: one per --lora adapter, at most 8; none without --lora)")
    p.add_argument("--max-lora-rank", type=int, default=d.max_lora_rank, metavar="R",
                   help=f"the largest rank an adapter may have (the slots are sized for it; default: {d.max_lora_rank})")
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
    p.add_argument("--http-port", type=_port, default=None,
                   help="serve the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /v1/models; "
                        "docs at /docs, a playground at /) at http://HOST:PORT; 0 = any free port (default: off)")
    p.add_argument("--tool-call-parser", choices=PARSERS, default=None,
                   help="how the HTTP door reads tool calls out of the model's text when tool_choice is \"auto\": "
                        "hermes (<tool_call> blocks: Qwen2.5, Qwen3, Hermes) or llama3_json (a JSON object: Llama "
                        "3.1-3.3); \"required\" and named tool_choice need none (default: none, the text is the answer)")
    p.add_argument("--api-key", action="append", default=None,
                   help="an accepted API key, for both doors: HTTP callers send `Authorization: Bearer <key>`, gRPC "
                        "callers the same metadata; repeat for several; adds to --auth-token-file's (default: none)")
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
