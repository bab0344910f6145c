"""Bearer-token check for every RPC but health and reflection, as a grpc.aio server interceptor.

A client sends `authorization: Bearer <token>` metadata; the token is compared in constant time
(hmac.compare_digest) with each accepted token. Health and reflection stay open so that load
balancers and grpcurl can probe a server without a secret. A missing or wrong token answers
UNAUTHENTICATED without reaching the servicer.
"""

from __future__ import annotations

import hmac
from collections.abc import Sequence
from pathlib import Path

import grpc

from .errors import ServiceError, send_error

# Method prefixes that need no token.
OPEN_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.v1alpha.ServerReflection/",
                 "/grpc.reflection.v1.ServerReflection/")


def read_token_file(path: str | Path) -> tuple[str, ...]:
    """One token per line; blank lines and lines starting with `#` are skipped."""
    tokens = tuple(line.strip() for line in Path(path).read_text().splitlines()
                   if line.strip() and not line.strip().startswith("#"))
    if not tokens:
        raise ValueError(f"{path}: no tokens (one token per line)")
    return tokens


_DENIED = ServiceError(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token", reason="UNAUTHENTICATED")


def _ignore(data: bytes) -> None:
    """A refused caller's request is never parsed (it may be a 16 MiB message)."""
    return None


async def _deny_unary(request, context: grpc.aio.ServicerContext) -> None:
    send_error(context, _DENIED, None)


async def _deny_stream(request, context: grpc.aio.ServicerContext):
    send_error(context, _DENIED, None)
    return
    yield  # never reached; makes this an async generator like the handler it stands in for


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, tokens: Sequence[str]) -> None:
        if not tokens:
            raise ValueError("at least one token is needed")
        self._tokens = tuple(t.encode() for t in tokens)

    def _authorized(self, metadata) -> bool:
        presented = next((v for k, v in metadata or () if k == "authorization"), None)
        if not isinstance(presented, str) or not presented.startswith("Bearer "):
            return False
        given = presented[len("Bearer "):].strip().encode()
        ok = False
        for token in self._tokens:  # no early exit: every token costs the same comparison time
            ok |= hmac.compare_digest(given, token)
        return ok

    async def intercept_service(self, continuation, handler_call_details: grpc.HandlerCallDetails):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(OPEN_PREFIXES):
            return handler
        if self._authorized(handler_call_details.invocation_metadata):
            return handler
        # Same kind of handler as the real one, its request left unparsed.
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                _deny_unary, request_deserializer=_ignore, response_serializer=handler.response_serializer)
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                _deny_stream, request_deserializer=_ignore, response_serializer=handler.response_serializer)
        if handler.stream_unary is not None:
            return grpc.stream_unary_rpc_method_handler(
                _deny_unary, request_deserializer=_ignore, response_serializer=handler.response_serializer)
        return grpc.stream_stream_rpc_method_handler(
            _deny_stream, request_deserializer=_ignore, response_serializer=handler.response_serializer)
