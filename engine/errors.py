"""The engine's errors, as callers see them."""

from __future__ import annotations


class RequestError(ValueError):
    """A request that cannot be served as given, from any layer (sampling ranges, the prompt, a
    structured output that does not compile, the service's own checks): `field` names the request
    field at fault, `message` says what is wrong with it, `reason` says why in one word
    (INVALID_FIELD; PROMPT_TOO_LONG: it leaves no room in the context or the KV pool). Each door
    maps it once: gRPC to INVALID_ARGUMENT with a BadRequest field violation, HTTP to a 400
    OpenAI error object whose `param` is the field."""

    def __init__(self, field_name: str, message: str, reason: str = "INVALID_FIELD"):
        super().__init__(f"{field_name}: {message}")
        self.field = field_name
        self.message = message
        self.reason = reason


class QueueFullError(RuntimeError):
    """The waiting queue is at its bound; the caller should retry later."""


class EngineDeadError(RuntimeError):
    """The engine loop has stopped; no request can be served."""


class RequestAbortedError(RuntimeError):
    """The request's stream was cancelled from elsewhere (an Abort call of its caller): its reader
    gets this instead of more outputs."""


class StepTimeoutError(RuntimeError):
    """One engine step ran past the watchdog's limit; the engine is presumed hung."""


class StartupError(ValueError):
    """The engine cannot start as configured. The message names the `pie serve` flag or the file at
    fault and what to do, in one line: `pie serve` prints it as its whole answer (no traceback)."""
