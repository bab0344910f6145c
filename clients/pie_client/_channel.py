"""Channel targets, options and per-call metadata shared by Client and AsyncClient."""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Sequence
from typing import Any

import grpc

from pie.v1 import generate_pb2 as pb

from .errors import REQUEST_ID_KEY

DEFAULT_TARGET = "127.0.0.1:50051"

Metadata = Sequence[tuple[str, str | bytes]]
ChannelOptions = Sequence[tuple[str, Any]]


def _split_host_port(address: str) -> tuple[str, str]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"address {address!r} is not host:port")
    return host.removeprefix("[").removesuffix("]"), port


def resolve_target(target: str | Sequence[str]) -> tuple[str, bool]:
    """Return (channel target, whether it names several servers).

    A string is used as it is (it may be any gRPC target, e.g. "dns:///pie.internal:50051").
    Several "ip:port" addresses become one static target, "ipv4:a:p,b:q" (or "ipv6:[a]:p,[b]:q"),
    which gRPC balances over with the lb policy the client sets. Host names cannot be listed that
    way: give one "dns:///name:port" target instead, and every address it resolves to is used.
    """
    if isinstance(target, str):
        return target, False
    addresses = list(target)
    if not addresses:
        raise ValueError("no server address given")
    if len(addresses) == 1:
        return addresses[0], False
    versions = set()
    parts = []
    for address in addresses:
        host, port = _split_host_port(address)
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            raise ValueError(
                f"{address!r}: several addresses must be IP literals; for a host name use one "
                "'dns:///name:port' target with lb_policy='round_robin'"
            ) from None
        versions.add(ip.version)
        parts.append(f"{ip}:{port}" if ip.version == 4 else f"[{ip}]:{port}")
    if len(versions) > 1:
        raise ValueError("cannot mix IPv4 and IPv6 addresses in one target")
    scheme = "ipv4" if versions == {4} else "ipv6"
    return f"{scheme}:{','.join(parts)}", True


# gRPC's retry policy (gRFC A6) for every method of the service: a call that ends UNAVAILABLE
# before the server sent anything back (a replica that is down, loading or draining; a balancer with
# no replica to give it) is sent again, up to 4 attempts in all, after random pauses of up to 0.1 s,
# 0.2 s and 0.4 s (doubling, at most 1 s). The call's deadline covers every attempt. gRPC never
# replays a call whose response headers arrived: pie sends a stream's once it admits it (a stream
# that began is never replayed) and a unary Generate's with its answer, so a Generate cut by its
# replica's end before answering runs again on another (what it generated there is lost with it).
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["GenerateService"].full_name
RETRY_POLICY = {
    "maxAttempts": 4,
    "initialBackoff": "0.1s",
    "maxBackoff": "1s",
    "backoffMultiplier": 2,
    "retryableStatusCodes": ["UNAVAILABLE"],
}


def service_config(retry: bool) -> str | None:
    """The channel's service config (JSON): RETRY_POLICY on the service's methods, or None for none."""
    if not retry:
        return None
    return json.dumps({"methodConfig": [{"name": [{"service": SERVICE_NAME}], "retryPolicy": RETRY_POLICY}]})


def channel_options(
    several: bool, lb_policy: str | None, options: ChannelOptions, retry: bool = True
) -> list[tuple[str, Any]]:
    """The caller's options plus the lb policy (round_robin by default over several servers) and the
    retry policy's service config; an option the caller gives (grpc.lb_policy_name,
    grpc.service_config) is kept as it is."""
    merged = list(options)
    given = {key for key, _ in merged}
    policy = lb_policy or ("round_robin" if several else None)
    if policy and "grpc.lb_policy_name" not in given:
        merged.append(("grpc.lb_policy_name", policy))
    config = service_config(retry)
    if config is not None and "grpc.service_config" not in given:
        merged.append(("grpc.service_config", config))
    return merged


COMPRESSIONS = {None: grpc.Compression.NoCompression, "none": grpc.Compression.NoCompression,
                "gzip": grpc.Compression.Gzip, "deflate": grpc.Compression.Deflate}


def compression_algorithm(name: str | None) -> grpc.Compression:
    """The channel's compression of requests: None or "none" (the default), "gzip" or "deflate"."""
    if name not in COMPRESSIONS:
        raise ValueError(f"compression must be one of none, gzip, deflate; got {name!r}")
    return COMPRESSIONS[name]


def call_metadata(base: Metadata, request_id: str | None) -> list[tuple[str, str | bytes]]:
    """The client's metadata for every call, plus x-request-id when the caller chose one."""
    metadata = [(key, value) for key, value in base if not (request_id and key == REQUEST_ID_KEY)]
    if request_id:
        metadata.append((REQUEST_ID_KEY, request_id))
    return metadata
