"""Rich gRPC errors: a status code, a message, and google.rpc details a client can read.

Every error the service raises carries a google.rpc.ErrorInfo (domain "pie.v1", one of the
REASONS below, which clients may switch on); INVALID_ARGUMENT also carries google.rpc.BadRequest
naming the field; errors worth retrying carry google.rpc.RetryInfo. The request id rides in the
trailing metadata. docs/api.md "Errors" and the .proto's header comment list them; tests hold both
to this module.
"""

from __future__ import annotations

import uuid

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2

from pie.engine.errors import RequestError

from .validation import valid_request_id

DOMAIN = "pie.v1"
# ErrorInfo.reason -> (status code, when). docs/api.md's error table is checked against this.
REASONS: dict[str, tuple[grpc.StatusCode, str]] = {
    "INVALID_FIELD": (grpc.StatusCode.INVALID_ARGUMENT, "a request field is out of range or malformed, a chat the model's "
                      "template refuses, a structured output that does not compile (BadRequest names it)"),
    "PROMPT_TOO_LONG": (grpc.StatusCode.INVALID_ARGUMENT, "the prompt leaves no room in the context or the KV pool"),
    "MALFORMED_MESSAGE": (grpc.StatusCode.INVALID_ARGUMENT, "the request bytes do not parse as the RPC's message"),
    "NO_CHAT_TEMPLATE": (grpc.StatusCode.FAILED_PRECONDITION, "a chat was sent and the model has no usable chat "
                         "template (none, or it does not compile): start pie serve with --chat-template FILE"),
    "ADAPTER_NOT_FOUND": (grpc.StatusCode.NOT_FOUND, "the request names a LoRA adapter that is not loaded (ListAdapters)"),
    "ADAPTER_INVALID": (grpc.StatusCode.INVALID_ARGUMENT, "LoadAdapter: the adapter cannot be served (its rank, modules, "
                        "shapes or files; the message names it), or the server has no adapter slots (--max-loras)"),
    "UNAUTHENTICATED": (grpc.StatusCode.UNAUTHENTICATED, "bearer token missing or not accepted (--auth-token-file)"),
    "QUEUE_FULL": (grpc.StatusCode.RESOURCE_EXHAUSTED, "the waiting queue is at --max-waiting (RetryInfo: 1 s)"),
    "OUT_OF_MEMORY": (grpc.StatusCode.RESOURCE_EXHAUSTED, "the device ran out of memory for this request (RetryInfo: 1 s)"),
    "MODEL_LOADING": (grpc.StatusCode.UNAVAILABLE, "the model is still loading (RetryInfo: 5 s)"),
    "DRAINING": (grpc.StatusCode.UNAVAILABLE, "the server is shutting down: send it elsewhere"),
    "ENGINE_STOPPED": (grpc.StatusCode.UNAVAILABLE, "the engine died or hung; the server exits with status 3"),
    "ENGINE_FAULT": (grpc.StatusCode.INTERNAL, "the engine failed this request (the server log has its id)"),
    "REQUEST_ABORTED": (grpc.StatusCode.CANCELLED, "an Abort call of the same caller ended the request"),
}


class ServiceError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str, *, reason: str, field: str | None = None,
                 description: str | None = None, retry_after_s: float | None = None):
        super().__init__(message)
        assert REASONS[reason][0] == code, f"{reason} is documented with {REASONS[reason][0].name}, not {code.name}"
        self.code = code
        self.message = message
        self.reason = reason
        self.field = field
        self.description = description or message
        self.retry_after_s = retry_after_s

    def details(self) -> status_pb2.Status:
        """The google.rpc.Status sent as `grpc-status-details-bin`."""
        status = status_pb2.Status(code=getattr(code_pb2, self.code.name), message=self.message)
        _pack(status, error_details_pb2.ErrorInfo(reason=self.reason, domain=DOMAIN))
        if self.field is not None:
            _pack(status, error_details_pb2.BadRequest(field_violations=[
                error_details_pb2.BadRequest.FieldViolation(field=self.field, description=self.description)]))
        if self.retry_after_s is not None:
            delay = duration_pb2.Duration()
            delay.FromNanoseconds(int(self.retry_after_s * 1e9))
            _pack(status, error_details_pb2.RetryInfo(retry_delay=delay))
        return status

    def trailing_metadata(self, request_id: str | None) -> tuple[tuple[str, str | bytes], ...]:
        md: list[tuple[str, str | bytes]] = [("grpc-status-details-bin", self.details().SerializeToString())]
        if request_id:
            md.append(("x-request-id", request_id))
        return tuple(md)


def _pack(status: status_pb2.Status, detail) -> None:
    wrapped = any_pb2.Any()
    wrapped.Pack(detail)
    status.details.append(wrapped)


def status_of(err: ServiceError | RequestError) -> ServiceError:
    """The gRPC door's one mapping of a refusal: a RequestError is INVALID_ARGUMENT with a
    BadRequest field violation naming its field (its reason: INVALID_FIELD or PROMPT_TOO_LONG)."""
    if isinstance(err, ServiceError):
        return err
    return ServiceError(grpc.StatusCode.INVALID_ARGUMENT, str(err), reason=err.reason, field=err.field,
                        description=err.message)


def send_error(context, err: ServiceError | RequestError, request_id: str | None) -> None:
    """Ends the RPC with `err` once its method returns: status, message and trailing details set on
    the context, with a request id whatever the RPC (`request_id`, else the caller's x-request-id
    metadata, else one minted for the error, which the caller can quote). Not `context.abort()`: that raises an exception grpc.aio keeps with the call, and
    with it, through its traceback, every frame's locals (the request message, the prompt, what
    tokenizing it built): measured, 16 refused 1M-character prompts kept ~700 MB alive."""
    err = status_of(err)
    context.set_code(err.code)
    context.set_details(err.message)
    context.set_trailing_metadata(err.trailing_metadata(request_id or _caller_id(context)))


def _caller_id(context) -> str:
    given = next((v for k, v in context.invocation_metadata() or () if k == "x-request-id"), "")
    return given if isinstance(given, str) and given and valid_request_id(given) else uuid.uuid4().hex
