"""GenerateService: thin async methods; protobuf conversion happens here and nowhere else.

Generate and GenerateStream share one lifecycle (service/generation.py): the stream yields a
message per hand-off of outputs (service/answers.py), the unary call collects the same hand-offs
into one answer."""

from __future__ import annotations

import contextlib
import functools

import grpc
import structlog

from pie.engine.client.engine_client import EngineClient
from pie.engine.errors import EngineDeadError, PromptError, QueueFullError
from pie.engine.messages import EngineStats, RequestOutput
from pie.engine.sampling_params import SamplingParamsError
from pie.model.chat_template import ChatTemplates
from pie.service.aborts import InFlight, caller_of
from pie.service.answers import stream_messages, unary_response
from pie.service.errors import ServiceError, invalid_argument, send_error
from pie.service.generation import Admitted, generation
from pie.service.logging import RequestSummary
from pie.service.metrics import ServiceMetrics
from pie.service.prompts import check_structured, encode, prompt_ids, render
from pie.service.validation import (
    ChatPrompt,
    FieldError,
    Limits,
    abort_ids_from_proto,
    chat_from_proto,
    detokenize_ids_from_proto,
    prompt_from_proto,
    qualify,
    sampling_from_proto,
)
from pie.service.workers import Workers
from pie.v1 import generate_pb2 as pb
from pie.v1 import generate_pb2_grpc

log = structlog.get_logger(__name__)

# Detokenize answers up to this many ids on the event loop; longer ones on a worker thread.
INLINE_DETOKENIZE_IDS = 4096

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["GenerateService"].full_name


class GenerateServicer(generate_pb2_grpc.GenerateServiceServicer):
    def __init__(self, *, model_name: str, limits: Limits | None = None, metrics: ServiceMetrics | None = None,
                 stream_interval: int = 1, auth: bool = False) -> None:
        if stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, got {stream_interval}")
        self.model_name = model_name
        # After its first token, a stream message waits for this many new tokens per sample (or
        # the end): fewer, larger messages when the event loop is the bottleneck (hundreds of streams).
        self.stream_interval = stream_interval
        self.limits = limits or Limits()
        self.metrics = metrics or ServiceMetrics(model_name)
        self.engine_client: EngineClient | None = None  # set once the model is loaded
        # Callers are told apart by bearer token when the server requires one, else all are one
        # anonymous caller (service/aborts.py): whose requests an Abort call may end.
        self.auth = auth
        self.in_flight = InFlight()
        # The model's chat templates (set with the engine client), or why chats cannot be served.
        self.chat_templates: ChatTemplates | None = None
        self.chat_template_problem = "the model is still loading"
        self.draining = False
        # Set by the server's stop when it lets gRPC cut what still runs (its grace is over): an
        # RPC cancelled from then on was ended by the shutdown, not by its caller.
        self.shutting_down = False
        # Long tokenizations and large answers run on these threads.
        self.workers = Workers()

    def close(self) -> None:
        """Lets the worker threads go (after the server stopped)."""
        self.workers.close()

    def _ready_client(self) -> EngineClient:
        # A dead engine first: the server is then shutting down because of it, and the caller
        # gets the cause the log records, not "shutting down".
        if self.engine_client is not None and self.engine_client.dead is not None:
            raise ServiceError(grpc.StatusCode.UNAVAILABLE, f"the engine has stopped: {self.engine_client.dead}",
                               reason="ENGINE_STOPPED")
        if self.draining:
            raise ServiceError(grpc.StatusCode.UNAVAILABLE, "the server is shutting down", reason="DRAINING")
        if self.engine_client is None:
            raise ServiceError(grpc.StatusCode.UNAVAILABLE, "the model is still loading", reason="MODEL_LOADING",
                               retry_after_s=5.0)
        return self.engine_client

    async def _render(self, chat: ChatPrompt, field: str = "chat") -> str:
        return await render(self.workers, self.chat_templates, self.chat_template_problem, chat, field)

    async def admit(self, request: pb.GenerateRequest | pb.GenerateStreamRequest, request_id: str, *,
                    streamed: bool, to_context: bool = False) -> Admitted:
        """A generation request validated, its prompt made token ids, and submitted to the engine
        (the lifecycle's first step, service/generation.py); raises ServiceError or FieldError.
        `streamed`: its tokens are read as they come (the engine bounds the stalls of such decodes
        only). `to_context`: the request may generate until the context is full (OpenAI's chat without
        max_tokens), not the contract's default of 16 tokens."""
        client = self._ready_client()
        prompt = prompt_from_proto(request, self.limits)
        sampling = sampling_from_proto(request.sampling, max_model_len=client.info.max_model_len)
        if isinstance(prompt, ChatPrompt):
            # The template writes the special tokens (BOS included): none are added when tokenizing.
            prompt = await prompt_ids(self.workers, client, await self._render(prompt), "chat",
                                      add_special_tokens=False)
        elif isinstance(prompt, str):
            prompt = await prompt_ids(self.workers, client, prompt, "prompt", add_special_tokens=True)
        if to_context:
            sampling.max_tokens = max(1, client.info.max_model_len - len(prompt))
        if sampling.structured is not None:
            await check_structured(self.workers, client, sampling.structured)
        client = self._ready_client()  # it may have stopped while the prompt was prepared
        try:
            stream = client.submit(prompt, sampling, caller_id=request_id, priority=request.priority,
                                   streamed=streamed)
        except PromptError as e:
            raise invalid_argument(qualify(e.field), e.message, e.reason) from e
        except SamplingParamsError as e:
            raise invalid_argument(qualify(e.field), e.message) from e
        except QueueFullError as e:
            raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"server is at capacity: {e}",
                               reason="QUEUE_FULL", retry_after_s=1.0) from e
        except EngineDeadError as e:
            raise ServiceError(grpc.StatusCode.UNAVAILABLE, str(e), reason="ENGINE_STOPPED") from e
        return Admitted(request_id, client, prompt, sampling, stream)

    # ---- RPCs ----------------------------------------------------------------------------
    # The RPCs end with an error by raising ServiceError (or FieldError); their wrappers turn it
    # into the call's status (`send_error`), never `context.abort`. Generate and GenerateStream
    # leave that to their lifecycle (service/generation.py).
    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> pb.GenerateResponse:
        s = RequestSummary("Generate", context.peer())
        outputs: list[RequestOutput] = []
        response: pb.GenerateResponse | None = None
        # The response headers (x-request-id) go out with the answer, not at admission: until then a
        # call cut by its replica's end (UNAVAILABLE, or a reset connection) has had no answer begun,
        # which lets a client's retry policy or a balancer send it to another replica.
        async with contextlib.aclosing(generation(self, request, context, s, streamed=False)) as handoffs:
            async for handoff in handoffs:
                outputs += handoff.outputs
                if handoff.last:  # assembled before the lifecycle ends: the summary's time includes it
                    response = await unary_response(handoff, outputs, s, self.workers)
                    await context.send_initial_metadata((("x-request-id", handoff.admitted.request_id),))
        return response  # type: ignore[return-value]  # None when refused: the status set is the answer

    async def GenerateStream(self, request: pb.GenerateStreamRequest, context: grpc.aio.ServicerContext):
        s = RequestSummary("GenerateStream", context.peer())
        # Closed on the way out, not whenever it is collected: a cancelled call's request is
        # aborted (its KV blocks freed) and its summary written at once.
        async with contextlib.aclosing(generation(self, request, context, s, interval=self.stream_interval)) \
                as handoffs:
            async for handoff in handoffs:
                for message in await stream_messages(handoff, s, self.workers):
                    yield message

    async def Tokenize(self, request: pb.TokenizeRequest, context) -> pb.TokenizeResponse:
        try:
            return await self._tokenize(request)
        except ServiceError as e:
            send_error(context, e, None)
            return None  # type: ignore[return-value]

    async def _tokenize(self, request: pb.TokenizeRequest) -> pb.TokenizeResponse:
        client = self._ready_client()
        rendered = ""
        if request.HasField("chat"):
            if request.text:
                raise invalid_argument("text", "set text or chat, not both")
            if request.HasField("add_special_tokens"):
                raise invalid_argument("add_special_tokens", "is not used with chat (the template writes them)")
            try:
                chat = chat_from_proto(request.chat, self.limits)
            except FieldError as e:
                raise invalid_argument(e.field, e.description) from None
            rendered = await self._render(chat)
            ids = await encode(self.workers, client, rendered, False)
        else:
            if len(request.text) > self.limits.max_prompt_chars:
                raise invalid_argument("text", f"is longer than {self.limits.max_prompt_chars} characters")
            add = request.add_special_tokens if request.HasField("add_special_tokens") else True
            ids = await encode(self.workers, client, request.text, add)
        tok = client.tokenizer  # each token's text on its own, as logprobs give it (not its vocabulary spelling)
        return pb.TokenizeResponse(token_ids=ids, tokens=[tok.token_text(i) for i in ids], count=len(ids),
                                   rendered_text=rendered)

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context) -> pb.GetModelInfoResponse:
        try:
            client = self._ready_client()
        except ServiceError as e:
            send_error(context, e, None)
            return None  # type: ignore[return-value]
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
        try:
            ids = abort_ids_from_proto(request)
        except FieldError as e:
            send_error(context, invalid_argument(e.field, e.description), None)
            return None  # type: ignore[return-value]
        found = self.in_flight.abort(caller_of(context, self.auth), ids)
        if found:
            log.info("requests_aborted", request_ids=found, peer=context.peer())
        return pb.AbortResponse(aborted_request_ids=found)

    async def Detokenize(self, request: pb.DetokenizeRequest, context) -> pb.DetokenizeResponse:
        try:
            return await self._detokenize(request)
        except ServiceError as e:
            send_error(context, e, None)
            return None  # type: ignore[return-value]
        except FieldError as e:
            send_error(context, invalid_argument(e.field, e.description), None)
            return None  # type: ignore[return-value]

    async def _detokenize(self, request: pb.DetokenizeRequest) -> pb.DetokenizeResponse:
        client = self._ready_client()
        ids = detokenize_ids_from_proto(request, self.limits, vocab_size=client.info.vocab_size)
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
