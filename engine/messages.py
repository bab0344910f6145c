"""What crosses between an EngineClient and its EngineCore, typed and defined once, here, for both
sides: commands in (`AddRequest`, `AbortRequest`, `StopCore`), step results out (`StepResult`: the
step's `RequestOutput`s with the engine's counts), and what the engine process says when it ends
(`CoreDied`).

They are msgspec Structs: plain typed classes that the engine process encodes as MessagePack
arrays (`encode`) and the client decodes straight into them (`decode_result`, `decode_command`),
with no tuple form kept by hand beside them. A Struct builds faster than a dataclass, and the
wire costs less than hand-kept tuples.
On a thread the same objects are handed over without encoding.
"""

from __future__ import annotations

import bisect
import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec

from .sampling_params import SamplingParams

if TYPE_CHECKING:
    from pie.model.config import ModelConfig

    from .config import EngineConfig


@dataclass(slots=True, frozen=True)
class EngineInfo:
    """What the service reads about a loaded engine; fixed once it is built."""

    config: EngineConfig
    model_config: ModelConfig
    max_model_len: int  # context served (the model's, or less when configured)
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    device: str  # e.g. "cpu", "cuda:0"
    dtype_name: str  # weights/activations: "fp32", "bf16", "fp16"
    num_kv_blocks: int  # size of the KV pool


class RequestStatus(enum.IntEnum):
    """Ordered so that `status >= FINISHED_STOPPED` means finished."""

    WAITING = 0  # never scheduled yet
    RUNNING = 1  # holds KV blocks, scheduled each step
    PREEMPTED = 2  # blocks taken back; waits to be recomputed from scratch
    FINISHED_STOPPED = 3  # EOS, stop token id or stop string
    FINISHED_LENGTH = 4  # max_tokens reached or the context is full
    FINISHED_ABORTED = 5  # cancelled by the caller (RPC cancelled, deadline, shutdown)
    FINISHED_ERROR = 6  # an engine fault failed this request

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


class SampledToken(msgspec.Struct, array_like=True, gc=False):
    token_id: int
    logprob: float  # log-probability of token_id under the raw model distribution
    top: list[tuple[int, float]]  # top-n (token id, logprob), best first; empty unless asked


class RequestOutput(msgspec.Struct, array_like=True, gc=False):
    """What one step produced for one request (only requests that changed appear)."""

    request_id: str  # the engine request id (for n > 1, of the whole group)
    new_token_ids: list[int]  # tokens sampled this step (0 or 1; more in a step that verified proposals)
    new_text: str  # text now safe to emit (may be empty while a multi-byte char or stop string is pending)
    new_logprobs: list[SampledToken] = []  # per new token, when asked
    finished: bool = False
    status: RequestStatus = RequestStatus.RUNNING
    stop_reason: int | str | None = None  # stop token id or stop string that ended it
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    error: str | None = None  # set when status is FINISHED_ERROR
    out_of_memory: bool = False  # the failure was device memory: retryable, unlike an engine fault
    queue_time_s: float | None = None  # first_scheduled_time - arrival_time; on the first output only
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (their prefill skipped)
    index: int = 0  # which of the request's n samples this output belongs to (0 when n == 1)
    # Every sample of the request is done: the caller's stream ends here (with n > 1, `finished`
    # ends one sample only).
    all_finished: bool = False
    # On the first output of sample 0 when prompt logprobs were asked: entries 1..P-1, entry i the
    # prompt token i (token_id) with its raw logprob given tokens 0..i-1 and the top-n there.
    prompt_logprobs: list[SampledToken] | None = None
    # On the output that finishes a sample that speculated (engine/spec_decode/speculator.py): proposals
    # verified for it and how many of them were accepted.
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


# Upper bounds (seconds) of the step-duration histogram's buckets, +Inf last (EngineStats.step_buckets)
STEP_BUCKETS = (0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, float("inf"))
STEP_KINDS = ("decode", "prompt")  # decode-only steps; steps that carry prompt tokens


class StepTimes:
    """Engine steps by duration, cumulative: per kind (STEP_KINDS), how many took at most each
    STEP_BUCKETS bound (not cumulative across buckets: each step counts in one), and their sum. A
    step's duration is the time between two steps' tokens coming back while the engine was busy,
    the same sample the scheduler's stall bound learns from."""

    def __init__(self) -> None:
        self.counts = {kind: [0] * len(STEP_BUCKETS) for kind in STEP_KINDS}
        self.sums = dict.fromkeys(STEP_KINDS, 0.0)
        self.prompt_tokens = 0  # carried by the "prompt" steps, in all

    def observe(self, num_prompt_tokens: int, seconds: float) -> None:
        kind = "prompt" if num_prompt_tokens else "decode"
        self.counts[kind][bisect.bisect_left(STEP_BUCKETS, seconds)] += 1
        self.sums[kind] += seconds
        self.prompt_tokens += num_prompt_tokens


class AdapterState(msgspec.Struct, array_like=True, gc=False):
    """One loaded LoRA adapter as ListAdapters and the metrics see it (engine/scheduling/adapters.py)."""

    name: str
    path: str
    rank: int
    resident: bool  # holds a GPU slot now
    running: int  # requests running on it
    waiting: int  # requests waiting to run on it


class EngineStats(msgspec.Struct, array_like=True, gc=False):
    kv_blocks_total: int
    kv_blocks_free: int  # free blocks, counting cached ones that no request holds (evictable at once)
    requests_running: int
    requests_waiting: int
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache (cumulative)
    prefix_cache_hits: int = 0  # of those, tokens found cached (cumulative)
    num_preemptions: int = 0  # requests preempted (cumulative)
    kv_blocks_cached: int = 0  # free blocks still holding reusable cached content (part of kv_blocks_free)
    adapters: list[AdapterState] = []  # the loaded LoRA adapters (none without adapter slots)
    requests_waiting_by_priority: dict[int, int] = {}  # of requests_waiting, how many at each priority
    # Speculative decoding (cumulative; vLLM's spec_decode counters): verify rows that carried
    # proposals, proposals verified, accepted, and accepted at each proposal position (1st, 2nd, ...).
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = []
    # Steps by duration (StepTimes, cumulative): per kind, the count in each STEP_BUCKETS bucket and
    # the sum of their seconds.
    step_buckets: dict[str, list[int]] = {}
    step_seconds: dict[str, float] = {}
    step_prompt_tokens: int = 0  # prompt tokens those steps carried (cumulative)
    # Steps scheduled with running decodes but no stall bound (StallBound had no decode-step time
    # or no per-token cost yet): their prompt tokens were bounded by the token budget alone.
    steps_unbounded: int = 0
    # Steps the stall budget let past the bound (StallBudget, --decode-stall-share), cumulative.
    steps_stalled: int = 0
    # What the stall bound has learnt (StallBound; 0 until measured): what carrying any prompt
    # tokens adds to a step and what one prompt token adds, seconds; measured decode-only steps
    # over its model of them.
    stall_fixed_s: float = 0.0
    stall_prompt_token_s: float = 0.0
    stall_decode_ratio: float = 1.0
    # Host and disk tiers below the pool (engine/offload/; all 0 without --kv-host-gib): host rows
    # and those holding a block, disk blocks and bytes (held, and the budget), and cumulative, by
    # tier ("host", "disk"): tokens read back into the pool, bytes read and written, failures.
    kv_host_blocks_total: int = 0
    kv_host_blocks_used: int = 0
    kv_disk_blocks_used: int = 0
    kv_disk_bytes_total: int = 0
    kv_disk_bytes_used: int = 0
    kv_tier_hit_tokens: dict[str, int] = {}
    kv_tier_read_bytes: dict[str, int] = {}
    kv_tier_write_bytes: dict[str, int] = {}
    kv_tier_errors: dict[str, int] = {}
    kv_readbacks: int = 0  # read-backs that landed (cumulative)
    kv_readback_seconds: float = 0.0  # their time from lookup to joining the pool, summed


# ---- client -> core --------------------------------------------------------------------------------
class AddRequest(msgspec.Struct, tag=True, array_like=True):
    """Queue a request the client has validated (engine.limits.check_request)."""

    request_id: str  # minted by the client: the engine's own id, never the caller's
    prompt_token_ids: list[int]
    sampling: SamplingParams
    priority: int = 0  # lower is scheduled first
    streamed: bool = False  # its caller reads tokens as they come (the stall bound protects its decodes)
    adapter: str | None = None  # the LoRA adapter it runs on (engine/scheduling/adapters.py); None: the base model


class AbortRequest(msgspec.Struct, tag=True, array_like=True):
    """Stop a request within one step and free its blocks (nothing if it is unknown or done)."""

    request_id: str


class AdapterCommand(msgspec.Struct, tag=True, array_like=True):
    """Load a LoRA adapter from a PEFT folder under `name` (`path` given) or unload it (`path`
    None); answered by an AdapterReply in the next StepResult."""

    command_id: int  # minted by the client, echoed in the reply
    name: str
    path: str | None = None


class StopCore(msgspec.Struct, tag=True, array_like=True):
    """Stop the loop after its current step; what is left is aborted (the engine process exits)."""


Command = AddRequest | AbortRequest | AdapterCommand | StopCore


# ---- core -> client ---------------------------------------------------------------------------------
class AdapterReply(msgspec.Struct, array_like=True, gc=False):
    """How an AdapterCommand went: `error` None when done, else why not (`not_found`: no adapter
    of that name)."""

    command_id: int
    error: str | None = None
    not_found: bool = False


class StepResult(msgspec.Struct, tag=True, array_like=True, gc=False):
    """What the loop publishes after a step with news (and at least every heartbeat while busy)."""

    outputs: list[RequestOutput]
    stats: EngineStats  # the engine's counts after the step
    steps: int  # steps begun so far
    taken: int  # samples of AddRequests taken in so far (the client's queue accounting)
    adapter_replies: list[AdapterReply] = []  # of the AdapterCommands applied before the step


class CoreDied(msgspec.Struct, tag=True, array_like=True):
    """The engine process's loop failed; it exits after this."""

    message: str


CoreMessage = StepResult | CoreDied

_encoder = msgspec.msgpack.Encoder()
_command_decoder = msgspec.msgpack.Decoder(Command)
_result_decoder = msgspec.msgpack.Decoder(CoreMessage)


def encode(message: Command | CoreMessage) -> bytes:
    return _encoder.encode(message)


def decode_command(data: bytes) -> Command:
    return _command_decoder.decode(data)


def decode_result(data: bytes) -> CoreMessage:
    return _result_decoder.decode(data)


def merge(first: StepResult, later: StepResult) -> StepResult:
    """Two results queued one after the other as one: both steps' outputs, the later counts."""
    return StepResult(first.outputs + later.outputs, later.stats, later.steps, later.taken,
                      first.adapter_replies + later.adapter_replies)
