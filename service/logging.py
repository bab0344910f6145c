"""structlog set-up (JSON lines when stderr is not a terminal, readable console output when it is)
and the one summary line every generation request ends with."""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass, field
from typing import TextIO

import structlog


def configure_logging(*, json: bool | None = None, level: str = "info", stream: TextIO | None = None) -> None:
    """`stream` defaults to stderr; `json=None` picks JSON unless that stream is a terminal."""
    stream = sys.stderr if stream is None else stream
    if json is None:
        json = not stream.isatty()
    renderer = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer()
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info if json else structlog.dev.set_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelNamesMapping()[level.upper()]),
        logger_factory=structlog.PrintLoggerFactory(file=stream),
        cache_logger_on_first_use=False,
    )


@dataclass(slots=True)
class RequestSummary:
    """What the `request_done` line says about one generation RPC; filled in as the request runs.
    Times are seconds on the monotonic clock from the RPC's arrival."""

    rpc: str  # "Generate" or "GenerateStream"
    peer: str  # context.peer(), e.g. "ipv4:127.0.0.1:53422"
    request_id: str | None = None  # the caller's: from the request or x-request-id metadata, or generated
    engine_request_id: str | None = None  # the engine's own id for it (engine logs name this one)
    started: float = field(default_factory=time.monotonic)
    prompt_tokens: int | None = None  # known once the request passed validation
    generated_tokens: int = 0
    ttft_s: float | None = None  # arrival -> first generated token reached the servicer
    last_token_at: float | None = None  # monotonic time the latest tokens arrived (inter-token gaps)
    queue_time_s: float | None = None  # engine's waiting time (RequestOutput.queue_time_s)
    finish_reason: str | None = None  # "stop", "length", "abort"; None when the RPC ended otherwise
    status: str = "OK"  # the gRPC status code's name the caller got
    error: str | None = None  # the status message for non-OK endings
    ended: bool = False  # the line was written (exactly one per RPC)
    # Speculative decoding: proposals verified for the request (all its samples) and, of those,
    # accepted; reported on the outputs that finish its samples.
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    adapter: str | None = None  # the LoRA adapter it asked for (None: the base model)

    def tokens_arrived(self, n: int, now: float) -> float | None:
        """Records `n` new tokens at `now`; returns the gap since the previous ones (None for the first)."""
        gap = None if self.last_token_at is None else now - self.last_token_at
        if n:
            if self.ttft_s is None:
                self.ttft_s = now - self.started
            self.generated_tokens += n
            self.last_token_at = now
        return gap if n else None

    @property
    def total_s(self) -> float:
        return time.monotonic() - self.started

    def emit(self, log) -> None:
        """One line: info for OK, warning for the caller's own errors and cancellations, error otherwise."""
        fields = dict(
            request_id=self.request_id, engine_request_id=self.engine_request_id, peer=self.peer, rpc=self.rpc,
            status=self.status,
            prompt_tokens=self.prompt_tokens, generated_tokens=self.generated_tokens,
            ttft_ms=None if self.ttft_s is None else round(1e3 * self.ttft_s, 2),
            queue_ms=None if self.queue_time_s is None else round(1e3 * self.queue_time_s, 2),
            total_ms=round(1e3 * self.total_s, 2), finish_reason=self.finish_reason)
        if self.adapter is not None:
            fields["adapter"] = self.adapter
        if self.num_draft_tokens:  # the request speculated
            fields.update(num_draft_tokens=self.num_draft_tokens, num_accepted_tokens=self.num_accepted_tokens,
                          acceptance_rate=round(self.num_accepted_tokens / self.num_draft_tokens, 3))
        if self.error is not None:
            fields["error"] = self.error
        if self.status in ("OK",):
            log.info("request_done", **fields)
        elif self.status in ("INTERNAL", "UNKNOWN", "DATA_LOSS"):
            log.error("request_done", **fields)
        else:
            log.warning("request_done", **fields)
