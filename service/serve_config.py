"""`pie serve`'s parsed flags (service/serve_flags.py) as the engine's and the server's configs, and
the engine's complaints about them in the flags' words."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import re

from pie.engine.config import EngineConfig

from .auth import read_token_file
from .logging import configure_logging
from .server import ConnectionConfig, ServerConfig, TlsConfig
from .validation import Limits

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
        decode_stall_factor=args.decode_stall_factor, decode_stall_share=args.decode_stall_share,
        max_waiting=args.max_waiting, seed=args.seed,
        attention_backend=args.attention_backend, cpu_threads=args.cpu_threads,
        tensor_parallel_size=args.tensor_parallel_size, enable_prefix_caching=args.enable_prefix_caching,
        logprobs_mode=args.logprobs_mode, batch_invariant=args.batch_invariant, speculative=args.speculative,
        draft_model=args.draft_model, loras=tuple(args.lora), max_lora_rank=args.max_lora_rank,
        max_loras=args.max_loras if args.max_loras is not None else (min(len(args.lora), 8)),
        kv_host_gib=args.kv_host_gib, kv_disk_dir=args.kv_disk_dir, kv_disk_gib=args.kv_disk_gib,
        **given)


# EngineConfig's fields whose flag is not the field's name with dashes.
_FIELD_FLAGS = {"kv_cache_memory_bytes": "--kv-cache-memory"}
# A field's name in EngineConfig's messages, with the value it was given where one follows
# (speculative='draft'); group 1 the name, group 2 or 3 the value.
_FIELD_WORD = re.compile(r"\b([a-z][a-z0-9_]*)(?:='([^']*)'|=([^\s,;:)]+))?")


def _flag(field_name: str) -> str:
    return _FIELD_FLAGS.get(field_name, "--" + field_name.replace("_", "-"))


def in_flag_words(message: str) -> str:
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


def server_config_from(args: argparse.Namespace) -> ServerConfig:
    """`pie serve`'s flags as a ServerConfig; a ValueError names the flag that is wrong."""
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
    if any(not key.strip() for key in args.api_key or ()):
        raise ValueError("--api-key: must not be empty")
    tokens += tuple(args.api_key or ())
    return ServerConfig(
        host=args.host, port=args.port, grace_s=args.grace, model_name=args.model_name,
        max_message_bytes=args.max_message_bytes, limits=Limits(max_prompt_chars=args.max_prompt_chars),
        max_concurrent_rpcs=args.max_concurrent_rpcs, step_timeout_s=args.step_timeout or None, tls=tls,
        auth_tokens=tokens, connection=connection,
        metrics_port=args.metrics_port, http_port=args.http_port, engine_process=args.engine_process, stream_interval=args.stream_interval,
        chat_template=args.chat_template, tool_call_parser=args.tool_call_parser,
        log_setup=functools.partial(configure_logging, json=None if args.log_format == "auto" else args.log_format == "json",
                                    level=args.log_level))
