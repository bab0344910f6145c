"""What `pie serve` checks before it binds anything, so that an operator's mistake ends in one line
naming the flag or path and what to do (service/cli.py prints a StartupError's message, exit 2)
rather than a traceback after `server_listening`.

Checked, in this order: the device (`--device cuda` without CUDA), the TLS files (present,
readable, PEM), the model folder (engine/model_check.py: config.json readable and of a supported
architecture, weights and tokenizer present, the tokenizer within the embedding, --chat-template's
file readable and compiling; its notes logged once), --draft-model's folder (config.json and
weights), tensor-parallel shardability, a KV budget that holds one sequence (where it is known
before the model loads), and last the ports (bindable now; the binds follow at once). What only
loading the model can show (a tensor missing from the checkpoint, the GPU's memory) fails after
the server bound, and `pie serve` says that in one line too.
"""

from __future__ import annotations

import errno
import socket
import ssl
from pathlib import Path

import structlog

from pie.engine.config import EngineConfig
from pie.engine.device import resolve_device
from pie.engine.errors import StartupError
from pie.engine.model_check import (
    ModelNote,
    check_chat_template,
    check_vocab,
    check_weights_present,
    model_notes,
    read_model_config,
    read_tokenizer,
)
from pie.engine.offload.disk import check_disk
from pie.engine.offload.host import check_host_memory
from pie.engine.runner.kv_cache import KVCache
from pie.engine.runner.kv_sizing import budget_blocks
from pie.model.config import ModelConfig
from pie.model.parallel import check_shardable

log = structlog.get_logger(__name__)


def check_startup(engine: EngineConfig, *, host: str, ports: dict[str, int | None],
                  tls: tuple[str, str, str | None] | None = None, chat_template: str | None = None) -> None:
    """Everything that can be checked before binding; raises StartupError. `ports` maps a flag
    ("--port") to its port (None: off, 0: any free port); `tls` is (certificate chain, key, client
    CA bundle or None), or None for plaintext; `chat_template`: --chat-template's file."""
    device = resolve_device(engine.device)
    if tls is not None:
        check_tls(*tls)
    model_config, notes = check_model(engine, chat_template)
    if engine.draft_model is not None:
        check_draft_model(engine.draft_model)
    if engine.tensor_parallel_size > 1:
        try:
            check_shardable(model_config, engine.tensor_parallel_size)
        except ValueError as e:
            raise StartupError(f"--tensor-parallel-size {engine.tensor_parallel_size}: {e}") from e
    elif not engine.num_kv_blocks:  # an exact --num-kv-blocks is taken as given
        max_len = model_config.max_model_len if engine.max_model_len is None else min(engine.max_model_len,
                                                                                       model_config.max_model_len)
        block_bytes = KVCache.bytes_per_block(
            num_layers=model_config.num_hidden_layers, block_size=engine.block_size,
            num_kv_heads=model_config.num_key_value_heads, head_dim=model_config.head_dim,
            kv_cache_dtype=engine.kv_cache_dtype)
        budget_blocks(engine, device, block_bytes, max_len)  # None on CUDA without a budget: sized at load
    if engine.kv_host_gib:  # the tiers below the KV pool: memory and folder (engine/offload/)
        check_host_memory(int(engine.kv_host_gib * 2**30))
        if engine.kv_disk_dir is not None:
            check_disk(engine.kv_disk_dir, int((engine.kv_disk_gib or 0) * 2**30), held=None)
    check_ports(host, ports)
    # Logged once all is known good, so that a refusal is the only line (the engine process reads
    # the folder again, silently).
    for note in notes:
        (log.warning if note.level == "warning" else log.info)(note.event, model=engine.model, **note.fields)


def check_model(engine: EngineConfig, chat_template: str | None = None) -> tuple[ModelConfig, list[ModelNote]]:
    """The model folder as engine/model_check.py reads it (and --chat-template's file), and its
    notes (to log once)."""
    model_config = read_model_config(engine.model)
    check_weights_present(engine.model)
    tokenizer = read_tokenizer(engine.model, model_config)
    check_vocab(engine.model, model_config, tokenizer)
    if chat_template is not None:
        check_chat_template(engine.model, chat_template)
    return model_config, model_notes(engine.model, model_config, tokenizer, chat_template)


def check_draft_model(path: str) -> None:
    """--draft-model's folder holds a model's config.json and weights (the draft reads the served
    model's tokenizer; whether the two fit together is the engine's to check when it loads them).
    engine/model_check.py's messages name --model: here they name --draft-model."""
    try:
        read_model_config(path)
        check_weights_present(path)
    except StartupError as e:
        raise StartupError("--draft-model" + str(e).removeprefix("--model")) from e


def check_tls(cert: str, key: str, client_ca: str | None) -> None:
    """The TLS files are readable PEM of the right kind, and the key is the certificate's (checked
    with Python's ssl, the same OpenSSL checks gRPC's credentials would fail on at bind time)."""
    check_pem("--tls-cert", cert, "CERTIFICATE")
    check_pem("--tls-key", key, "PRIVATE KEY")
    if client_ca is not None:
        check_pem("--tls-client-ca", client_ca, "CERTIFICATE")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:  # a password callback, so an encrypted key fails here instead of prompting on the terminal
        context.load_cert_chain(cert, key, password=lambda: b"")
    except ssl.SSLError as e:
        if "KEY_VALUES_MISMATCH" in str(e):
            raise StartupError(f"--tls-key {key} is not the key of --tls-cert {cert}; give the pair's key") from e
        raise StartupError(f"--tls-cert {cert} / --tls-key {key}: OpenSSL refuses them ({e.reason or e}); give "
                           "a PEM certificate chain and its unencrypted private key") from e
    if client_ca is not None:
        try:
            context.load_verify_locations(client_ca)
        except ssl.SSLError as e:
            raise StartupError(f"--tls-client-ca {client_ca}: OpenSSL refuses it ({e.reason or e}); give a "
                               "bundle of PEM CA certificates") from e


def check_pem(flag: str, path: str, kind: str) -> None:
    """A readable PEM file holding a `kind` block ("CERTIFICATE", "PRIVATE KEY")."""
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError as e:
        raise StartupError(f"{flag} {path}: no such file; give the PEM file's path") from e
    except IsADirectoryError as e:
        raise StartupError(f"{flag} {path} is a folder; give the PEM file in it") from e
    except OSError as e:
        raise StartupError(f"{flag} {path}: cannot read it ({e.strerror or e}); check its permissions") from e
    if b"-----BEGIN " not in data:
        raise StartupError(f"{flag} {path}: not a PEM file (no '-----BEGIN' line); give the PEM encoding "
                           "(openssl x509 -outform PEM converts a DER file)")
    if f"{kind}-----".encode() not in data:
        raise StartupError(f"{flag} {path}: holds no {kind} (PEM blocks say what they hold: "
                           f"'-----BEGIN {kind}-----'); was it swapped with another TLS flag's file?")


def check_ports(host: str, ports: dict[str, int | None]) -> None:
    """Each port can be bound on `host` now (0: any free port; `host` must still be this
    machine's), and no two flags share one. None: that listener is off."""
    given = {flag: port for flag, port in ports.items() if port is not None}
    seen: dict[int, str] = {}
    for flag, port in given.items():
        if port and port in seen:
            raise StartupError(f"{flag} {port} is also {seen[port]}'s port; give each its own")
        seen[port] = flag
    for flag, port in given.items():
        errors: list[OSError] = []
        addresses = _addresses(host, port)
        for family, kind, proto, sockaddr in addresses:
            with socket.socket(family, kind, proto) as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC's own listener does
                try:
                    s.bind(sockaddr)
                except OSError as e:
                    errors.append(e)
        # gRPC serves when one of a name's addresses binds (localhost's ::1 may not exist); a port
        # in use on any of them would send some clients to the other process, so that is refused.
        taken = [e for e in errors if e.errno in (errno.EADDRINUSE, errno.EACCES)]
        if taken or (errors and len(errors) == len(addresses)):
            raise bind_error((taken or errors)[0], host, port, flag)


def _addresses(host: str, port: int) -> list[tuple[socket.AddressFamily, socket.SocketKind, int, tuple]]:
    name = host[1:-1] if host.startswith("[") and host.endswith("]") else host  # gRPC's [::1] form
    try:
        infos = socket.getaddrinfo(name, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise StartupError(f"--host {host}: cannot resolve it ({e.strerror}); give an address of this machine "
                           "(127.0.0.1: this machine only; 0.0.0.0: every interface)") from e
    return [(family, kind, proto, sockaddr) for family, kind, proto, _, sockaddr in infos]


def bind_error(e: OSError, host: str, port: int, flag: str) -> StartupError:
    """The StartupError for a failed bind of `host`:`port`, given by `flag`."""
    if e.errno == errno.EADDRINUSE:
        return StartupError(f"{flag} {port}: the port is already in use on {host} (`ss -ltnp 'sport = :{port}'` "
                            f"shows by whom); stop that process or pick another port ({flag} 0: any free port)")
    if e.errno == errno.EACCES:
        return StartupError(f"{flag} {port}: permission denied on {host} (ports below 1024 need root or "
                            "CAP_NET_BIND_SERVICE); pick a port of 1024 or above")
    if e.errno == errno.EADDRNOTAVAIL:
        return StartupError(f"--host {host}: not an address of this machine; use 127.0.0.1 (this machine only) "
                            "or 0.0.0.0 (every interface)")
    return StartupError(f"{flag} {port}: cannot bind {host}:{port} ({e.strerror or e})")
