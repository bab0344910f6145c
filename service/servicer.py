"""GenerateService: thin async methods; protobuf conversion happens here and nowhere else.

Generate and GenerateStream run the one lifecycle every door shares (service/generation.py, with
the admission of service/admission.py): the stream yields a message per hand-off of outputs
(service/answers.py), the unary call collects the same hand-offs into one answer. Every refusal
leaves through `refusals`, the door's one mapping to a status."""

from __future__ import annotations

import contextlib
import functools
import uuid
from collections.abc import Coroutine
from types import TracebackType
from typing import Any, TypeVar

import grpc
import structlog

from pie.engine.errors import RequestError
from pie.engine.messages import AdapterState, EngineStats, RequestOutput
from pie.v1 import generate_pb2 as pb
from pie.v1 import generate_pb2_grpc

from .aborts import caller_of
from .admission import Admission
from .answers import stream_messages, unary_response
from .errors import ServiceError, send_error
from .generation import generation
from .logging import RequestSummary
from .prompts import encode
from .validation import abort_ids_from_proto, chat_from_proto, detokenize_ids_from_proto

log = structlog.get_logger(__name__)

# Detokenize answers up to this many ids on the event loop; longer ones on a worker thread.
INLINE_DETOKENIZE_IDS = 4096
# A caller whose RPC ends within this many seconds of its deadline is counted as DEADLINE_EXCEEDED
# (the client's own timer fires a little before the server's).
DEADLINE_SLACK_S = 0.05

T = TypeVar("T")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["GenerateService"].full_name


class RpcChannel:
    """A gRPC call as the lifecycle's Channel (service/generation.py)."""

    def __init__(self, context: grpc.aio.ServicerContext, auth: bool) -> None:
        self.context = context
        self.caller = caller_of(context, auth)
        self.headers = {k: v for k, v in (context.invocation_metadata() or ()) if isinstance(v, str)}

    def mint_id(self) -> str:
        return uuid.uuid4().hex

    async def announce(self, request_id: str) -> None:
        await self.context.send_initial_metadata((("x-request-id", request_id),))

    def gone(self) -> tuple[grpc.StatusCode, str]:
        remaining = self.context.time_remaining()
        if remaining is not None and remaining <= DEADLINE_SLACK_S:
            return grpc.StatusCode.DEADLINE_EXCEEDED, "the deadline passed"
        return grpc.StatusCode.CANCELLED, "cancelled by the caller"


class refusals:  # noqa: N801  (used as a `with` statement's function)
    """The gRPC door's one exit for a refusal: a RequestError or ServiceError raised inside the
    `with` becomes the call's status (`send_error`, with the request id `s` has by then), and the
    method goes on after the block (it returns None: the status is the answer)."""

    def __init__(self, context: grpc.aio.ServicerContext, s: RequestSummary | None = None) -> None:
        self.context, self.summary = context, s

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None) -> bool:
        if not isinstance(err, RequestError | ServiceError):
            return False
        send_error(self.context, err, None if self.summary is None else self.summary.request_id)
        return True


async def _answered(context: grpc.aio.ServicerContext, work: Coroutine[Any, Any, T]) -> T:
    """`work`'s answer; for a refusal, None with the call's status set (which is then the answer)."""
    with refusals(context):
        return await work
    return None  # type: ignore[return-value]


class GenerateServicer(generate_pb2_grpc.GenerateServiceServicer):
    """The gRPC door: protobuf in and out, over the admission and lifecycle the HTTP door shares."""

    def __init__(self, admission: Admission, *, stream_interval: int = 1) -> None:
        if stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, got {stream_interval}")
        self.admission = admission
        self.model_name = admission.model_name
        # After its first token, a stream message waits for this many new tokens per sample (or
        # the end): fewer, larger messages when the event loop is the bottleneck (hundreds of streams).
        self.stream_interval = stream_interval
        self.workers = admission.workers

    # ---- RPCs ----------------------------------------------------------------------------
    # The RPCs end with an error by raising RequestError or ServiceError inside `refusals`, which
    # turns it into the call's status (`send_error`), never `context.abort`.
    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> pb.GenerateResponse:
        s = RequestSummary("Generate", context.peer())
        outputs: list[RequestOutput] = []
        response: pb.GenerateResponse | None = None
        # The response headers (x-request-id) go out with the answer, not at admission: until then a
        # call cut by its replica's end (UNAVAILABLE, or a reset connection) has had no answer begun,
        # which lets a client's retry policy or a balancer send it to another replica.
        with refusals(context, s):
            async with generation(self.admission, request, s, RpcChannel(context, self.admission.auth),
                                  streamed=False) as g, contextlib.aclosing(g.handoffs()) as handoffs:
                async for handoff in handoffs:
                    outputs += handoff.outputs
                    if handoff.last:  # assembled before the lifecycle ends: the summary's time includes it
                        response = await unary_response(handoff, outputs, self.workers)
                        await context.send_initial_metadata((("x-request-id", handoff.admitted.request_id),))
        return response  # type: ignore[return-value]  # None when refused: the status set is the answer

    async def GenerateStream(self, request: pb.GenerateStreamRequest, context: grpc.aio.ServicerContext):
        s = RequestSummary("GenerateStream", context.peer())
        # Closed on the way out, not whenever it is collected: a cancelled call's request is
        # aborted (its KV blocks freed) and its summary written at once.
        with refusals(context, s):
            async with generation(self.admission, request, s, RpcChannel(context, self.admission.auth),
                                  streamed=True) as g, \
                    contextlib.aclosing(g.handoffs(self.stream_interval)) as handoffs:
                async for handoff in handoffs:
                    for message in await stream_messages(handoff, s, self.workers):
                        yield message

    async def Tokenize(self, request: pb.TokenizeRequest, context) -> pb.TokenizeResponse:
        return await _answered(context, self._tokenize(request))

    async def _tokenize(self, request: pb.TokenizeRequest) -> pb.TokenizeResponse:
        client = self.admission.ready_client()
        rendered = ""
        if request.HasField("chat"):
            if request.text:
                raise RequestError("text", "set text or chat, not both")
            if request.HasField("add_special_tokens"):
                raise RequestError("add_special_tokens", "is not used with chat (the template writes them)")
            chat = chat_from_proto(request.chat, self.admission.limits)
            rendered = await self.admission.render(chat)
            ids = await encode(self.workers, client, rendered, False)
        else:
            limit = self.admission.limits.max_prompt_chars
            if len(request.text) > limit:
                raise RequestError("text", f"is longer than {limit} characters")
            add = request.add_special_tokens if request.HasField("add_special_tokens") else True
            ids = await encode(self.workers, client, request.text, add)
        tok = client.tokenizer  # each token's text on its own, as logprobs give it (not its vocabulary spelling)
        return pb.TokenizeResponse(token_ids=ids, tokens=[tok.token_text(i) for i in ids], count=len(ids),
                                   rendered_text=rendered)

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context) -> pb.GetModelInfoResponse:
        return await _answered(context, self._model_info())

    async def _model_info(self) -> pb.GetModelInfoResponse:
        client = self.admission.ready_client()
        info = client.info
        mc, cfg = info.model_config, info.config
        stats = client.stats()
        resp = pb.GetModelInfoResponse(
            model_name=self.model_name, architecture=mc.architecture, model_type=mc.model_type,
            max_model_len=info.max_model_len, vocab_size=info.vocab_size, eos_token_ids=list(info.eos_token_ids),
            kv_cache_dtype=cfg.kv_cache_dtype, block_size=cfg.block_size, device=info.device,
            dtype=info.dtype_name, logprobs_mode=cfg.logprobs_mode,
            load=pb.ModelLoad(
                kv_blocks_total=stats.kv_blocks_total, kv_blocks_free=stats.kv_blocks_free,
                kv_blocks_cached=stats.kv_blocks_cached,
                requests_waiting_by_priority=stats.requests_waiting_by_priority,
                requests_running=stats.requests_running, requests_waiting=stats.requests_waiting,
                max_num_seqs=cfg.max_num_seqs, max_waiting=cfg.max_waiting))
        if client.tokenizer.bos_token_id is not None:
            resp.bos_token_id = client.tokenizer.bos_token_id
        if cfg.speculative is not None:
            resp.speculative.CopyFrom(_speculative(cfg.speculative, cfg.num_speculative_tokens, stats))
        return resp

    async def Abort(self, request: pb.AbortRequest, context) -> pb.AbortResponse:
        """Ends the caller's in-flight requests under the ids it names (service/aborts.py). Needs no
        loaded engine: before there is one, nothing is in flight."""
        with refusals(context):
            ids = abort_ids_from_proto(request)
            found = self.admission.in_flight.abort(caller_of(context, self.admission.auth), ids)
            if found:
                log.info("requests_aborted", request_ids=found, peer=context.peer())
            return pb.AbortResponse(aborted_request_ids=found)
        return None  # type: ignore[return-value]  # refused: the status set is the answer

    async def LoadAdapter(self, request: pb.LoadAdapterRequest, context) -> pb.LoadAdapterResponse:
        return await _answered(context, self._load_adapter(request))

    async def _load_adapter(self, request: pb.LoadAdapterRequest) -> pb.LoadAdapterResponse:
        return pb.LoadAdapterResponse(adapter=_adapter(await self.admission.load_adapter(request.name, request.path)))

    async def UnloadAdapter(self, request: pb.UnloadAdapterRequest, context) -> pb.UnloadAdapterResponse:
        return await _answered(context, self._unload_adapter(request))

    async def _unload_adapter(self, request: pb.UnloadAdapterRequest) -> pb.UnloadAdapterResponse:
        await self.admission.unload_adapter(request.name)
        return pb.UnloadAdapterResponse()

    async def ListAdapters(self, request: pb.ListAdaptersRequest, context) -> pb.ListAdaptersResponse:
        return await _answered(context, self._list_adapters())

    async def _list_adapters(self) -> pb.ListAdaptersResponse:
        cfg = self.admission.ready_client().info.config
        return pb.ListAdaptersResponse(adapters=[_adapter(a) for a in self.admission.adapters()],
                                       max_loras=cfg.max_loras, max_lora_rank=cfg.max_lora_rank)

    async def Detokenize(self, request: pb.DetokenizeRequest, context) -> pb.DetokenizeResponse:
        return await _answered(context, self._detokenize(request))

    async def _detokenize(self, request: pb.DetokenizeRequest) -> pb.DetokenizeResponse:
        client = self.admission.ready_client()
        ids = detokenize_ids_from_proto(request, self.admission.limits, vocab_size=client.info.vocab_size)
        skip = request.skip_special_tokens if request.HasField("skip_special_tokens") else True
        decode = functools.partial(client.tokenizer.decode, ids, skip)
        text = decode() if len(ids) <= INLINE_DETOKENIZE_IDS else await self.workers.run(decode)
        return pb.DetokenizeResponse(text=text)


def _speculative(method: str, k: int, stats: EngineStats) -> pb.SpeculativeDecoding:
    """GetModelInfo's account of speculative decoding: its settings, the engine's cumulative counts,
    and what they come to (vLLM's acceptance rate and mean acceptance length)."""
    drafts, proposed, accepted = stats.spec_num_drafts, stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens
    return pb.SpeculativeDecoding(
        method=method, num_speculative_tokens=k, num_drafts=drafts, num_draft_tokens=proposed,
        num_accepted_tokens=accepted, acceptance_rate=accepted / proposed if proposed else 0.0,
        mean_acceptance_length=1 + accepted / drafts if drafts else 0.0)


def _adapter(a: AdapterState) -> pb.Adapter:
    return pb.Adapter(name=a.name, path=a.path, rank=a.rank, resident=a.resident, requests_running=a.running,
                      requests_waiting=a.waiting)
