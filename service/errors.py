"""Rich gRPC errors: a status code, a message, and google.rpc details a client can read.

INVALID_ARGUMENT carries google.rpc.BadRequest field violations; RESOURCE_EXHAUSTED carries
google.rpc.RetryInfo. Every error carries the request id in its trailing metadata.
"""

from __future__ import annotations

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2


class ServiceError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str, *, field: str | None = None,
                 description: str | None = None, retry_after_s: float | None = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.field = field
        self.description = description or message
        self.retry_after_s = retry_after_s

    def trailing_metadata(self, request_id: str | None) -> tuple[tuple[str, str | bytes], ...]:
        status = status_pb2.Status(code=getattr(code_pb2, self.code.name), message=self.message)
        if self.field is not None:
            detail = any_pb2.Any()
            detail.Pack(error_details_pb2.BadRequest(field_violations=[
                error_details_pb2.BadRequest.FieldViolation(field=self.field, description=self.description)]))
            status.details.append(detail)
        if self.retry_after_s is not None:
            detail = any_pb2.Any()
            delay = duration_pb2.Duration()
            delay.FromNanoseconds(int(self.retry_after_s * 1e9))
            detail.Pack(error_details_pb2.RetryInfo(retry_delay=delay))
            status.details.append(detail)
        md: list[tuple[str, str | bytes]] = [("grpc-status-details-bin", status.SerializeToString())]
        if request_id:
            md.append(("x-request-id", request_id))
        return tuple(md)


def invalid_argument(field: str, description: str) -> ServiceError:
    return ServiceError(grpc.StatusCode.INVALID_ARGUMENT, f"{field}: {description}", field=field,
                        description=description)
