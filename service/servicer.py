"""GenerateService: thin async methods; protobuf conversion happens here and nowhere else."""

from __future__ import annotations

import asyncio
import functools
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import grpc
import structlog

from pie.engine.client.engine_client import EngineClient, RequestStream
from pie.engine.config import usable_cores
from pie.engine.errors import EngineDeadError, PromptError, QueueFullError, RequestAbortedError
from pie.engine.messages import EngineStats, RequestOutput, RequestStatus, SampledToken
from pie.engine.sampling_params import SamplingParams, SamplingParamsError, StructuredOutputParams
from pie.engine.validation import prompt_too_long
from pie.model.chat_template import ChatTemplateError, ChatTemplates, NoChatTemplate
from pie.model.tokenizer import Tokenizer, TooManyTokens
from pie.service.aborts import InFlight, caller_of
from pie.service.errors import ServiceError, invalid_argument, send_error
from pie.service.logging import RequestSummary
from pie.service.memory import release_free_memory
from pie.service.metrics import ServiceMetrics
from pie.service.validation import (
    ChatPrompt,
    FieldError,
    Limits,
    abort_ids_from_proto,
    chat_from_proto,
    detokenize_ids_from_proto,
    prompt_from_proto,
    qualify,
    request_id_from,
    sampling_from_proto,
)
from pie.v1 import generate_pb2 as pb
from pie.v1 import generate_pb2_grpc

log = structlog.get_logger(__name__)

# Texts up to this many characters are tokenized on the event loop (~1 ms at most); longer ones on
# a worker thread, with the GIL released (model.Tokenizer.encode), so the loop keeps serving.
INLINE_TOKENIZE_CHARS = 2048
# Conversations with more characters than this are rendered with their chat template on a worker
# thread (a template loops over every message in Python: ~1 ms per few KB).
INLINE_RENDER_CHARS = 8192
# After tokenizing a text this long the worker hands freed heap pages back (service/memory.py).
RELEASE_MEMORY_CHARS = 65536
# A unary answer with more logprob entries than this is assembled on a worker thread: building
# the messages is Python work the loop would otherwise do in one piece (4,096 entries take ~3 ms
# on this 2-core machine; 16 samples x 2,048 tokens x 21 entries would take ~0.5 s).
INLINE_LOGPROB_ENTRIES = 4096
# Detokenize answers up to this many ids on the event loop; longer ones on a worker thread.
INLINE_DETOKENIZE_IDS = 4096
# A caller whose RPC ends within this many seconds of its deadline is counted as DEADLINE_EXCEEDED
# (the client's own timer fires a little before the server's).
DEADLINE_SLACK_S = 0.05

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["GenerateService"].full_name

_FINISH = {
    RequestStatus.FINISHED_STOPPED: pb.FINISH_REASON_STOP,
    RequestStatus.FINISHED_LENGTH: pb.FINISH_REASON_LENGTH,
    RequestStatus.FINISHED_ABORTED: pb.FINISH_REASON_ABORT,
}
_FINISH_LABEL = {  # the summary line's and vllm:request_success's finished_reason
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


def _by_index(outputs: list[RequestOutput]) -> dict[int, list[RequestOutput]]:
    """Outputs grouped by choice index (n > 1), each group in arrival order."""
    groups: dict[int, list[RequestOutput]] = {}
    for o in outputs:
        groups.setdefault(o.index, []).append(o)
    return groups


def _cached(outputs: list[RequestOutput]) -> int:
    """Prompt tokens served from the prefix cache (reported on a request's first outputs)."""
    return max((o.num_cached_tokens for o in outputs), default=0)


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
        # Callers are told apart by bearer token when the server requires one, else by connection
        # (service/aborts.py): whose requests an Abort call may end.
        self.auth = auth
        self.in_flight = InFlight()
        # The model's chat templates (set with the engine client), or why chats cannot be served.
        self.chat_templates: ChatTemplates | None = None
        self.chat_template_problem = "the model is still loading"
        self.draining = False
        # Set by the server's stop when it lets gRPC cut what still runs (its grace is over): an
        # RPC cancelled from then on was ended by the shutdown, not by its caller.
        self.shutting_down = False
        # Long tokenizations and large answers run here. One core is left to the event loop: with
        # every core busy tokenizing, the loop waited for a CPU (health checks' p99 38-47 ms with
        # 2 workers on 2 cores while 24 prompts of 1M characters arrived).
        workers = max(1, min(4, usable_cores() - 1))
        self._workers = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="servicer-worker")
        # Long tokenizations wait their turn here, on the loop: a burst of long prompts queues
        # coroutines, not executor jobs, so a caller that cancels while it waits costs nothing.
        self._tokenize_slots = asyncio.Semaphore(workers)

    def close(self) -> None:
        """Lets the worker threads go (after the server stopped)."""
        self._workers.shutdown(wait=False, cancel_futures=True)

    # ---- helpers -------------------------------------------------------------------------
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

    @staticmethod
    def _request_id(request, context: grpc.aio.ServicerContext) -> str:
        metadata = {k: v for k, v in (context.invocation_metadata() or ()) if isinstance(v, str)}
        return request_id_from(request, metadata, lambda: uuid.uuid4().hex)

    async def _off_loop(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._workers, fn, *args)

    async def _encode(self, client: EngineClient, text: str, add_special_tokens: bool = True,
                      max_tokens: int | None = None) -> list[int]:
        encode = functools.partial(client.tokenizer.encode, text, add_special_tokens, max_tokens=max_tokens)
        if len(text) <= INLINE_TOKENIZE_CHARS:
            return encode()
        async with self._tokenize_slots:
            return await self._off_loop(_encode_and_release, encode, len(text) >= RELEASE_MEMORY_CHARS)

    async def _render(self, chat: ChatPrompt, field: str = "chat") -> str:
        """The conversation rendered with the model's chat template (on a worker thread when long)."""
        templates = self.chat_templates
        if templates is None:
            raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION, f"{field}: {self.chat_template_problem}",
                               reason="NO_CHAT_TEMPLATE")
        render = functools.partial(templates.render, chat.messages, tools=chat.tools,
                                   add_generation_prompt=chat.add_generation_prompt,
                                   continue_final_message=chat.continue_final_message, extra=chat.extra)
        try:
            return render() if chat.chars <= INLINE_RENDER_CHARS else await self._off_loop(render)
        except ChatTemplateError as e:
            raise invalid_argument(f"{field}.messages", f"the model's chat template refused the conversation: {e}") \
                from None
        except NoChatTemplate as e:
            raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION, f"{field}: {e}", reason="NO_CHAT_TEMPLATE") from None
        except ValueError as e:  # a conversation no template can render (continue_final_message without text)
            raise invalid_argument(field, str(e)) from None

    async def _prompt_ids(self, client: EngineClient, text: str, field: str, *, add_special_tokens: bool) -> list[int]:
        max_len = client.info.max_model_len
        try:  # a prompt must leave room for one token: longer ones are refused uncounted
            ids = await self._encode(client, text, add_special_tokens, max_tokens=max_len - 1)
        except TooManyTokens as e:
            raise invalid_argument(field, prompt_too_long(e.count, max_len, at_least=e.at_least).message,
                                   "PROMPT_TOO_LONG") from None
        if not ids:
            raise FieldError(field, "tokenizes to no tokens")
        return ids

    async def _check_structured(self, client: EngineClient, params: StructuredOutputParams) -> None:
        """Refuses a constraint that does not compile, with the compiler's message (compiled off
        the event loop the first time, answered from the cache after)."""
        try:
            if client.structured_known(params):
                client.check_structured(params)
            else:
                await self._off_loop(client.check_structured, params)
        except SamplingParamsError as e:
            raise invalid_argument(qualify(e.field), e.message) from None

    async def _submit(self, request, rid: str) -> tuple[EngineClient, list[int], SamplingParams, RequestStream]:
        client = self._ready_client()
        prompt = prompt_from_proto(request, self.limits)
        sampling = sampling_from_proto(request.sampling, max_model_len=client.info.max_model_len)
        if isinstance(prompt, ChatPrompt):
            # The template writes the special tokens (BOS included): none are added when tokenizing.
            prompt = await self._prompt_ids(client, await self._render(prompt), "chat", add_special_tokens=False)
        elif isinstance(prompt, str):
            prompt = await self._prompt_ids(client, prompt, "prompt", add_special_tokens=True)
        if sampling.structured is not None:
            await self._check_structured(client, sampling.structured)
        client = self._ready_client()  # it may have stopped while the prompt was prepared
        try:
            stream = client.submit(prompt, sampling, caller_id=rid, priority=request.priority)
        except PromptError as e:
            raise invalid_argument(qualify(e.field), e.message, e.reason) from e
        except SamplingParamsError as e:
            raise invalid_argument(qualify(e.field), e.message) from e
        except QueueFullError as e:
            raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"server is at capacity: {e}",
                               reason="QUEUE_FULL", retry_after_s=1.0) from e
        except EngineDeadError as e:
            raise ServiceError(grpc.StatusCode.UNAVAILABLE, str(e), reason="ENGINE_STOPPED") from e
        return client, prompt, sampling, stream

    @staticmethod
    def _prompt_logprobs(prompt: list[int], entries: list[SampledToken], tokenizer: Tokenizer) -> list[pb.PromptLogprob]:
        """One entry per prompt token: the first with no logprob, then each one's given those before."""
        text = tokenizer.token_text
        first = pb.PromptLogprob(token_id=prompt[0], token=text(prompt[0]))
        return [first] + [pb.PromptLogprob(token_id=e.token_id, logprob=e.logprob, token=text(e.token_id),
                                           top_logprobs=[pb.TopLogprob(token_id=t, logprob=lp, token=text(t))
                                                         for t, lp in e.top])
                          for e in entries]

    async def _prompt_logprob_messages(self, prompt: list[int], entries: list[SampledToken],
                                       sampling: SamplingParams, tokenizer: Tokenizer) -> list[pb.PromptLogprob]:
        """`_prompt_logprobs`, on a worker thread when there are many (a long prompt's take as long
        to build as the answer's logprobs do)."""
        if len(entries) * (1 + (sampling.prompt_logprobs or 0)) > INLINE_LOGPROB_ENTRIES:
            return await self._off_loop(self._prompt_logprobs, prompt, entries, tokenizer)
        return self._prompt_logprobs(prompt, entries, tokenizer)

    @staticmethod
    def _aborted(rid: str) -> ServiceError:
        return ServiceError(grpc.StatusCode.CANCELLED, f"request {rid} was aborted by an Abort call of its caller",
                            reason="REQUEST_ABORTED")

    @staticmethod
    def _logprobs(outputs: list[RequestOutput], tokenizer: Tokenizer) -> list[pb.TokenLogprob]:
        text = tokenizer.token_text
        return [pb.TokenLogprob(token_id=s.token_id, logprob=s.logprob, token=text(s.token_id),
                                top_logprobs=[pb.TopLogprob(token_id=t, logprob=lp, token=text(t)) for t, lp in s.top])
                for o in outputs for s in o.new_logprobs]

    @staticmethod
    def _gone_code(context) -> grpc.StatusCode:
        """Why an RPC ended before its answer: its deadline, or the caller cancelling it."""
        remaining = context.time_remaining()
        if remaining is not None and remaining <= DEADLINE_SLACK_S:
            return grpc.StatusCode.DEADLINE_EXCEEDED
        return grpc.StatusCode.CANCELLED

    def _gone(self, context, s: RequestSummary) -> None:
        if self.shutting_down:  # the caller gets UNAVAILABLE from gRPC; the reason is DRAINING's
            self._end(s, grpc.StatusCode.UNAVAILABLE, "server shutting down (DRAINING): the grace period ended first")
            return
        code = self._gone_code(context)
        self._end(s, code, "the deadline passed" if code == grpc.StatusCode.DEADLINE_EXCEEDED
                  else "cancelled by the caller")

    def _observe(self, s: RequestSummary, batch: list[RequestOutput]) -> None:
        """Times one hand-off of outputs: TTFT, inter-token gaps (split over its tokens), queue time;
        counts its speculative proposals for the summary line."""
        first = s.ttft_s is None
        n = sum(len(o.new_token_ids) for o in batch)
        gap = s.tokens_arrived(n, time.monotonic())
        if first and s.ttft_s is not None:
            self.metrics.first_token(s.ttft_s)
        if gap is not None:
            self.metrics.token_gap(gap, n)
        for o in batch:  # on the output that finishes a sample that speculated
            s.num_draft_tokens += o.num_draft_tokens
            s.num_accepted_tokens += o.num_accepted_tokens
        if s.queue_time_s is None:
            q = next((o.queue_time_s for o in batch if o.queue_time_s is not None), None)
            if q is not None:
                s.queue_time_s = q
                self.metrics.queued(q)

    def _end(self, s: RequestSummary, code: grpc.StatusCode, error: str | None = None) -> None:
        """Where every generation RPC ends, once: its summary log line and its metrics."""
        s.status, s.error, s.ended = code.name, error, True
        self.metrics.request_finished(
            rpc=s.rpc, code=s.status, prompt_tokens=s.prompt_tokens, generated_tokens=s.generated_tokens,
            finished_reason=s.finish_reason, e2e_s=s.total_s if s.finish_reason is not None else None)
        s.emit(log)

    def _fail(self, s: RequestSummary, err: ServiceError) -> ServiceError:
        """Ends the RPC's summary with `err` (the error to raise next: the RPC's wrapper sends it)."""
        self._end(s, err.code, err.message)
        return err

    def _refuse(self, context, s: RequestSummary, err: ServiceError | FieldError) -> None:
        """A generation RPC ends with `err`: its summary line (unless written) and its status."""
        if isinstance(err, FieldError):
            err = invalid_argument(err.field, err.description)
        if not s.ended:
            self._end(s, err.code, err.message)
        send_error(context, err, s.request_id)

    @staticmethod
    def _failure(client: EngineClient, rid: str, failed: RequestOutput) -> ServiceError:
        """The status a caller gets for an engine-side failure (`failed` has FINISHED_ERROR)."""
        if client.dead is not None:  # hung, stalled or crashed: try another replica
            return ServiceError(grpc.StatusCode.UNAVAILABLE,
                                f"the engine stopped while serving request {rid} ({client.dead}); "
                                "search the server log for this id", reason="ENGINE_STOPPED")
        if failed.out_of_memory:
            return ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"out of device memory while serving request {rid}; retry later",
                                reason="OUT_OF_MEMORY", retry_after_s=1.0)
        return ServiceError(grpc.StatusCode.INTERNAL,
                            f"engine fault while serving request {rid}; search the server log for this id",
                            reason="ENGINE_FAULT")

    # ---- RPCs ----------------------------------------------------------------------------
    # The RPCs end with an error by raising ServiceError (or FieldError); their wrappers turn it
    # into the call's status (`send_error`), never `context.abort`.
    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> pb.GenerateResponse:
        s = RequestSummary("Generate", context.peer())
        try:
            return await self._generate(request, context, s)
        except (ServiceError, FieldError) as e:
            self._refuse(context, s, e)
            return None  # type: ignore[return-value]  # the status set above is what the caller gets

    async def _generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext,
                        s: RequestSummary) -> pb.GenerateResponse:
        s.request_id = rid = self._request_id(request, context)
        client, prompt, sampling, stream = await self._submit(request, rid)
        s.prompt_tokens = len(prompt)
        s.engine_request_id = stream.engine_id
        outputs: list[RequestOutput] = []
        finished = False
        caller = caller_of(context, self.auth)
        try:  # from here on the engine holds the request: every way out must abort it
            self.in_flight.add(caller, client, stream)
            await context.send_initial_metadata((("x-request-id", rid),))
            while not finished:
                batch = await stream.next_batch()
                self._observe(s, batch)
                outputs.extend(batch)
                finished = batch[-1].all_finished
        except RequestAbortedError:
            raise self._fail(s, self._aborted(rid)) from None
        finally:
            self.in_flight.remove(caller, stream)
            if not finished:  # the caller went away (cancel or deadline), or aborted it
                client.abort(stream)
                if not s.ended:
                    self._gone(context, s)
        failed = next((o for o in outputs if o.status == RequestStatus.FINISHED_ERROR), None)
        if failed is not None:
            log.error("request_failed", request_id=rid, engine_request_id=stream.engine_id, error=failed.error)
            raise self._fail(s, self._failure(client, rid, failed))
        groups = sorted(_by_index(outputs).items())
        tokenizer = client.tokenizer if sampling.logprobs else None
        if sampling.logprobs and len(outputs) * (1 + sampling.logprobs) > INLINE_LOGPROB_ENTRIES:
            choices = await self._off_loop(self._choices, groups, tokenizer)
        else:
            choices = self._choices(groups, tokenizer)
        first = choices[0]
        completion = sum(len(c.token_ids) for c in choices)
        entries = next((o.prompt_logprobs for o in outputs if o.prompt_logprobs is not None), None)
        prompt_logprobs = [] if entries is None else await self._prompt_logprob_messages(
            prompt, entries, sampling, client.tokenizer)
        s.finish_reason = _FINISH_LABEL.get(_by_index(outputs)[0][-1].status)
        self._end(s, grpc.StatusCode.OK)
        return pb.GenerateResponse(
            request_id=rid, text=first.text, token_ids=first.token_ids, finish_reason=first.finish_reason,
            stop_reason=first.stop_reason, logprobs=first.logprobs,
            usage=pb.Usage(prompt_tokens=len(prompt), completion_tokens=completion,
                           total_tokens=len(prompt) + completion, cached_prompt_tokens=_cached(outputs)),
            choices=choices if sampling.n > 1 else [], prompt_logprobs=prompt_logprobs,
        )

    def _choices(self, groups: list[tuple[int, list[RequestOutput]]], tokenizer: Tokenizer | None) -> list[pb.Choice]:
        """The answer's choices; with a tokenizer, their logprobs too."""
        return [self._choice(i, outs, tokenizer) for i, outs in groups]

    def _choice(self, index: int, outputs: list[RequestOutput], tokenizer: Tokenizer | None) -> pb.Choice:
        """One sample's whole answer from its outputs (in order; the last one finished it)."""
        last = outputs[-1]
        return pb.Choice(
            index=index, text="".join(o.new_text for o in outputs),
            token_ids=[t for o in outputs for t in o.new_token_ids],
            finish_reason=_FINISH.get(last.status, pb.FINISH_REASON_UNSPECIFIED),
            stop_reason="" if last.stop_reason is None else str(last.stop_reason),
            logprobs=self._logprobs(outputs, tokenizer) if tokenizer is not None else [])

    async def GenerateStream(self, request: pb.GenerateStreamRequest, context: grpc.aio.ServicerContext):
        s = RequestSummary("GenerateStream", context.peer())
        messages = self._generate_stream(request, context, s)
        try:
            async for message in messages:
                yield message
        except (ServiceError, FieldError) as e:
            self._refuse(context, s, e)
        finally:
            # Closed here, not whenever it is collected: a cancelled call's request is aborted (its
            # KV blocks freed) and its summary written at once.
            await messages.aclose()

    async def _generate_stream(self, request: pb.GenerateStreamRequest, context: grpc.aio.ServicerContext,
                               s: RequestSummary):
        s.request_id = rid = self._request_id(request, context)
        client, prompt, sampling, stream = await self._submit(request, rid)
        s.prompt_tokens = len(prompt)
        s.engine_request_id = stream.engine_id
        finished = False
        cached = 0
        asked_prompt_logprobs = sampling.prompt_logprobs is not None
        caller = caller_of(context, self.auth)
        try:  # from here on the engine holds the request: every way out must abort it
            self.in_flight.add(caller, client, stream)
            await context.send_initial_metadata((("x-request-id", rid),))
            while not finished:
                batch = await stream.next_batch()
                if s.ttft_s is not None:  # the first token goes out at once
                    while (not batch[-1].all_finished
                           and sum(len(o.new_token_ids) for o in batch) < self.stream_interval * sampling.n
                           and not any(o.status == RequestStatus.FINISHED_ERROR for o in batch)):
                        batch += await stream.next_batch()
                finished = batch[-1].all_finished
                failed = next((o for o in batch if o.status == RequestStatus.FINISHED_ERROR), None)
                if failed is not None:
                    log.error("request_failed", request_id=rid, engine_request_id=stream.engine_id,
                              error=failed.error)
                    raise self._fail(s, self._failure(client, rid, failed))
                self._observe(s, batch)
                cached = max(cached, _cached(batch))
                # One message per choice present in this hand-off (one message when n == 1).
                groups = sorted(_by_index(batch).items())
                for j, (index, outs) in enumerate(groups):
                    last = outs[-1]
                    msg = pb.GenerateStreamResponse(
                        request_id=rid, index=index, text="".join(o.new_text for o in outs),
                        token_ids=[t for o in outs for t in o.new_token_ids],
                        logprobs=self._logprobs(outs, client.tokenizer) if sampling.logprobs else [])
                    if asked_prompt_logprobs:  # on the message with choice 0's first token
                        entries = next((o.prompt_logprobs for o in outs if o.prompt_logprobs is not None), None)
                        if entries is not None:
                            msg.prompt_logprobs.extend(await self._prompt_logprob_messages(
                                prompt, entries, sampling, client.tokenizer))
                    if last.finished:
                        msg.finish_reason = _FINISH.get(last.status, pb.FINISH_REASON_UNSPECIFIED)
                        msg.stop_reason = "" if last.stop_reason is None else str(last.stop_reason)
                        if index == 0:
                            s.finish_reason = _FINISH_LABEL.get(last.status)
                    if finished and j == len(groups) - 1:
                        n_generated = s.generated_tokens
                        msg.usage.CopyFrom(pb.Usage(prompt_tokens=len(prompt), completion_tokens=n_generated,
                                                    total_tokens=len(prompt) + n_generated,
                                                    cached_prompt_tokens=cached))
                    yield msg
            self._end(s, grpc.StatusCode.OK)
        except RequestAbortedError:
            raise self._fail(s, self._aborted(rid)) from None
        finally:
            self.in_flight.remove(caller, stream)
            if not finished:
                client.abort(stream)
            if not s.ended:  # the caller went away (cancel or deadline) before the last message
                self._gone(context, s)

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
            ids = await self._encode(client, rendered, False)
        else:
            if len(request.text) > self.limits.max_prompt_chars:
                raise invalid_argument("text", f"is longer than {self.limits.max_prompt_chars} characters")
            add = request.add_special_tokens if request.HasField("add_special_tokens") else True
            ids = await self._encode(client, request.text, add)
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
        text = decode() if len(ids) <= INLINE_DETOKENIZE_IDS else await self._off_loop(decode)
        return pb.DetokenizeResponse(text=text)


def _speculative(method: str, k: int, stats: EngineStats) -> pb.SpeculativeDecoding:
    """GetModelInfo's account of speculative decoding: its settings, the engine's cumulative counts,
    and what they come to (vLLM's acceptance rate and mean acceptance length)."""
    drafts, proposed, accepted = stats.spec_num_drafts, stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens
    return pb.SpeculativeDecoding(
        method=method, num_speculative_tokens=k, num_drafts=drafts, num_draft_tokens=proposed,
        num_accepted_tokens=accepted, acceptance_rate=accepted / proposed if proposed else 0.0,
        mean_acceptance_length=1 + accepted / drafts if drafts else 0.0)


def _encode_and_release(encode, release: bool) -> list[int]:
    """On a worker thread: `encode()`, then (for a long text) the heap pages it freed go back to the
    OS, refused or not (service/memory.py)."""
    try:
        return encode()
    finally:
        if release:
            release_free_memory()
