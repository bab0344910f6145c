"""pie-client: a typed Python client (blocking and asyncio) of the pie GenerateService.

Needs only grpcio and protobuf. The generated stubs are importable as `pie.v1.generate_pb2` and
`pie.v1.generate_pb2_grpc` for anyone who wants the raw messages.
"""

from .aio import AsyncClient
from .client import Client
from .errors import (
    Cancelled,
    DeadlineExceeded,
    FailedPrecondition,
    InternalError,
    InvalidArgument,
    NotFound,
    PieError,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
    from_rpc_error,
)
from .types import (
    Choice,
    Completion,
    Delta,
    ModelInfo,
    ModelLoad,
    PromptLogprob,
    SpeculativeDecoding,
    Tokenization,
    TokenLogprob,
    TopLogprob,
    Usage,
)

__all__ = [
    "AsyncClient",
    "Cancelled",
    "Client",
    "Choice",
    "Completion",
    "DeadlineExceeded",
    "Delta",
    "FailedPrecondition",
    "InternalError",
    "InvalidArgument",
    "ModelInfo",
    "ModelLoad",
    "PieError",
    "PromptLogprob",
    "ResourceExhausted",
    "SpeculativeDecoding",
    "TokenLogprob",
    "Tokenization",
    "TopLogprob",
    "NotFound",
    "Unauthenticated",
    "Unavailable",
    "Usage",
    "from_rpc_error",
]
