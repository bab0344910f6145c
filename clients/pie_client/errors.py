"""Exceptions of the pie client, and the one function that maps a grpc.RpcError to them.

The reason (google.rpc.ErrorInfo), field violations (BadRequest) and retry hint (RetryInfo) come
from the `grpc-status-details-bin` trailer (a serialized google.rpc.Status); the server's docs/api.md
("Errors") lists which error carries which. Its message types live in googleapis-common-protos, which this client does not
require: without it, errors still carry their code, details and request id, only no field details.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import grpc

try:  # optional: googleapis-common-protos (pulled in by grpcio-status)
    from google.rpc import error_details_pb2, status_pb2
except ImportError:  # pragma: no cover - depends on the environment
    error_details_pb2 = None
    status_pb2 = None

REQUEST_ID_KEY = "x-request-id"
STATUS_DETAILS_KEY = "grpc-status-details-bin"


class PieError(Exception):
    """A failed pie RPC.

    Attributes:
        code: the grpc.StatusCode.
        details: the server's message.
        request_id: the request's id, when the server or the caller named one.
        reason: the server's one-word reason (google.rpc.ErrorInfo), e.g. "QUEUE_FULL",
            "PROMPT_TOO_LONG", "MODEL_LOADING"; None when the error came from gRPC itself.
        field_violations: (field, description) pairs from a google.rpc.BadRequest detail.
        retry_after: the server's suggested wait in seconds before retrying (google.rpc.RetryInfo),
            or None.

    str() is one line: code, message, the field violations the message does not already say (pie's
    server writes "field: description" as the message), and the request id.
    """

    def __init__(
        self,
        code: grpc.StatusCode,
        details: str,
        *,
        request_id: str | None = None,
        field_violations: list[tuple[str, str]] | None = None,
        reason: str | None = None,
        retry_after: float | None = None,
    ) -> None:
        self.code = code
        self.details = details
        self.request_id = request_id
        self.field_violations = list(field_violations or [])
        self.reason = reason
        self.retry_after = retry_after
        super().__init__(self._message())

    def _message(self) -> str:
        text = f"{self.code.name}: {self.details}"
        unsaid = [(f, d) for f, d in self.field_violations if not (f in self.details and d in self.details)]
        if unsaid:
            text += " (" + "; ".join(f"{f}: {d}" for f, d in unsaid) + ")"
        if self.request_id:
            text += f" [request_id={self.request_id}]"
        return text


class InvalidArgument(PieError):
    """The request was rejected as malformed; see `field_violations`."""


class FailedPrecondition(PieError):
    """The server cannot serve this kind of request as it is set up (e.g. a chat to a model
    without a chat template: reason NO_CHAT_TEMPLATE)."""


class ResourceExhausted(PieError):
    """The server is full (its waiting queue is at its bound); retry after `retry_after` seconds."""


class Unavailable(PieError):
    """The server cannot be reached, or is loading or draining."""


class DeadlineExceeded(PieError):
    """The call's deadline passed before the answer was complete."""


class Cancelled(PieError):
    """The call was cancelled."""


class InternalError(PieError):
    """The server failed (INTERNAL, UNKNOWN or DATA_LOSS)."""


class Unauthenticated(PieError):
    """The call lacked valid credentials (UNAUTHENTICATED or PERMISSION_DENIED)."""


class NotFound(PieError):
    """The request names something the server does not have (NOT_FOUND: a LoRA adapter not loaded)."""


_CLASS_BY_CODE: dict[grpc.StatusCode, type[PieError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.OUT_OF_RANGE: InvalidArgument,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.CANCELLED: Cancelled,
    grpc.StatusCode.INTERNAL: InternalError,
    grpc.StatusCode.UNKNOWN: InternalError,
    grpc.StatusCode.DATA_LOSS: InternalError,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.PERMISSION_DENIED: Unauthenticated,
}


def _metadata(error: grpc.RpcError, which: str) -> list[tuple[str, Any]]:
    """initial_metadata() or trailing_metadata() of a call error, [] when it has none."""
    getter = getattr(error, which, None)
    if getter is None:
        return []
    try:
        return list(getter() or ())
    except Exception:  # a call that never started may have no metadata to give
        return []


def _first(metadata: Iterable[tuple[str, Any]], key: str) -> Any:
    return next((value for k, value in metadata if k == key), None)


def _parse_details(blob: bytes) -> tuple[list[tuple[str, str]], float | None, str | None, str | None]:
    """(field violations, retry-after seconds, request id, reason) from a serialized google.rpc.Status."""
    violations: list[tuple[str, str]] = []
    retry_after = None
    request_id = None
    reason = None
    if status_pb2 is None or not blob:
        return violations, retry_after, request_id, reason
    status = status_pb2.Status()
    try:
        status.ParseFromString(blob)
    except Exception:  # a malformed trailer must not hide the real error
        return violations, retry_after, request_id, reason
    for detail in status.details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            reason = info.reason or None
        elif detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            violations.extend((v.field, v.description) for v in bad.field_violations)
        elif detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            info = error_details_pb2.RetryInfo()
            detail.Unpack(info)
            retry_after = info.retry_delay.seconds + info.retry_delay.nanos / 1e9
        elif detail.Is(error_details_pb2.RequestInfo.DESCRIPTOR):
            req = error_details_pb2.RequestInfo()
            detail.Unpack(req)
            request_id = req.request_id or None
    return violations, retry_after, request_id, reason


def from_rpc_error(error: grpc.RpcError, request_id: str | None = None) -> PieError:
    """Map a grpc.RpcError (sync or asyncio) to the matching PieError subclass.

    `request_id` is the caller's own id, used when the server did not send one back.
    """
    code = error.code() if callable(getattr(error, "code", None)) else None
    code = code or grpc.StatusCode.UNKNOWN
    details = error.details() if callable(getattr(error, "details", None)) else str(error)
    trailing = _metadata(error, "trailing_metadata")
    initial = _metadata(error, "initial_metadata")
    violations, retry_after, detail_request_id, reason = _parse_details(_first(trailing, STATUS_DETAILS_KEY) or b"")
    request_id = (
        _first(trailing, REQUEST_ID_KEY) or _first(initial, REQUEST_ID_KEY) or detail_request_id or request_id
    )
    cls = _CLASS_BY_CODE.get(code, PieError)
    return cls(code, details or "", request_id=request_id, field_violations=violations, reason=reason,
               retry_after=retry_after)
