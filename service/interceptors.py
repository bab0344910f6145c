"""Server interceptors that are not about auth.

UndecodableRequestInterceptor: grpc answers UNKNOWN ("Unexpected DecodeError") when a request's
bytes do not parse (garbage, a truncated message, a string field with bad UTF-8). That is the
client's fault, so this interceptor turns it into INVALID_ARGUMENT naming the message type: the
deserializer returns a marker instead of raising, and the wrapped method aborts on the marker.
"""

from __future__ import annotations

import inspect

import grpc
from google.protobuf.message import DecodeError

from .errors import ServiceError, send_error


class _Undecodable:
    __slots__ = ("error",)

    def __init__(self, error: str) -> None:
        self.error = error


def _safe(deserializer):
    if deserializer is None:
        return None

    def parse(data: bytes):
        try:
            return deserializer(data)
        except DecodeError as e:
            return _Undecodable(str(e))

    return parse


def _reject(request: _Undecodable, context: grpc.aio.ServicerContext) -> None:
    send_error(context, ServiceError(grpc.StatusCode.INVALID_ARGUMENT,
                                     f"the request message does not parse: {request.error}",
                                     reason="MALFORMED_MESSAGE"), None)


def _guard(behavior):
    """For a coroutine method (unary responses, or streams written with context.write)."""
    async def call(request, context):
        if isinstance(request, _Undecodable):
            return _reject(request, context)
        result = behavior(request, context)
        return await result if inspect.isawaitable(result) else result

    return call


def _guard_async_gen(behavior):
    """For a method that is an async generator of responses."""
    async def call(request, context):
        if isinstance(request, _Undecodable):
            _reject(request, context)
            return
        async for item in behavior(request, context):
            yield item

    return call


class UndecodableRequestInterceptor(grpc.aio.ServerInterceptor):
    """Unary-request methods only (all of this server's); streaming-request handlers pass through."""

    async def intercept_service(self, continuation, handler_call_details: grpc.HandlerCallDetails):
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_streaming:
            return handler
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                _guard(handler.unary_unary), request_deserializer=_safe(handler.request_deserializer),
                response_serializer=handler.response_serializer)
        behavior = handler.unary_stream
        guard = _guard_async_gen if inspect.isasyncgenfunction(behavior) else _guard
        return grpc.unary_stream_rpc_method_handler(
            guard(behavior), request_deserializer=_safe(handler.request_deserializer),
            response_serializer=handler.response_serializer)
