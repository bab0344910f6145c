"""GenerateService: thin async methods; protobuf conversion happens here and nowhere else."""

from __future__ import annotations

import time
import uuid

import grpc
import structlog

from engine.engine import PromptError, RequestOutput
from engine.engine_thread import AsyncEngine, EngineDeadError, QueueFullError
from engine.request import RequestStatus
from engine.sampling_params import SamplingParamsError
from pie.v1 import generate_pb2 as pb
from pie.v1 import generate_pb2_grpc
from service.errors import ServiceError, invalid_argument
from service.validation import FieldError, Limits, prompt_from_proto, qualify, request_id_from, sampling_from_proto

log = structlog.get_logger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["GenerateService"].full_name

_FINISH = {
    RequestStatus.FINISHED_STOPPED: pb.FINISH_REASON_STOP,
    RequestStatus.FINISHED_LENGTH: pb.FINISH_REASON_LENGTH,
    RequestStatus.FINISHED_ABORTED: pb.FINISH_REASON_ABORT,
}


class GenerateServicer(generate_pb2_grpc.GenerateServiceServicer):
    def __init__(self, *, model_name: str, limits: Limits | None = None) -> None:
        self.model_name = model_name
        self.limits = limits or Limits()
        self.engine: AsyncEngine | None = None  # set once the model is loaded
        self.draining = False

    # ---- helpers -------------------------------------------------------------------------
    def _ready_engine(self) -> AsyncEngine:
        if self.draining:
            raise ServiceError(grpc.StatusCode.UNAVAILABLE, "the server is shutting down")
        if self.engine is None:
            raise ServiceError(grpc.StatusCode.UNAVAILABLE, "the model is still loading")
        if self.engine.dead is not None:
            raise ServiceError(grpc.StatusCode.UNAVAILABLE, "the engine has stopped")
        return self.engine

    @staticmethod
    def _request_id(request, context: grpc.aio.ServicerContext) -> str:
        metadata = {k: v for k, v in (context.invocation_metadata() or ()) if isinstance(v, str)}
        return request_id_from(request, metadata, lambda: uuid.uuid4().hex)

    def _submit(self, request, rid: str):
        engine = self._ready_engine()
        core = engine.engine
        prompt = prompt_from_proto(request, core.tokenizer, self.limits)
        sampling = sampling_from_proto(request.sampling, max_model_len=core.max_model_len)
        try:
            stream = engine.submit(rid, prompt, sampling)
        except (PromptError, SamplingParamsError) as e:
            raise invalid_argument(qualify(e.field), e.message) from e
        except QueueFullError as e:
            raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"server is at capacity: {e}",
                               retry_after_s=1.0) from e
        except EngineDeadError as e:
            raise ServiceError(grpc.StatusCode.UNAVAILABLE, str(e)) from e
        return prompt, sampling, stream

    async def _abort(self, context, err: ServiceError, rid: str | None) -> None:
        await context.abort(err.code, err.message, trailing_metadata=err.trailing_metadata(rid))

    def _logprobs(self, outputs: list[RequestOutput]) -> list[pb.TokenLogprob]:
        tok = self.engine.engine.tokenizer
        result = []
        for o in outputs:
            for s in o.new_logprobs:
                result.append(pb.TokenLogprob(
                    token_id=s.token_id, logprob=s.logprob, token=tok.decode([s.token_id], skip_special_tokens=False),
                    top_logprobs=[pb.TopLogprob(token_id=t, logprob=lp, token=tok.decode([t], skip_special_tokens=False))
                                  for t, lp in s.top]))
        return result

    @staticmethod
    def _final_error(last: RequestOutput, rid: str) -> ServiceError | None:
        if last.status == RequestStatus.FINISHED_ERROR:
            return ServiceError(grpc.StatusCode.INTERNAL,
                                f"engine fault while serving request {rid}; search the server log for this id")
        return None

    # ---- RPCs ----------------------------------------------------------------------------
    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> pb.GenerateResponse:
        rid = None
        try:
            rid = self._request_id(request, context)
            prompt, sampling, stream = self._submit(request, rid)
        except FieldError as e:
            return await self._abort(context, invalid_argument(e.field, e.description), rid)
        except ServiceError as e:
            return await self._abort(context, e, rid)
        await context.send_initial_metadata((("x-request-id", rid),))
        started = time.monotonic()
        outputs: list[RequestOutput] = []
        finished = False
        try:
            while not finished:
                batch = await stream.next_batch()
                outputs.extend(batch)
                finished = batch[-1].finished
        finally:
            if not finished:
                self.engine.abort(rid)
                log.info("request_cancelled", request_id=rid, rpc="Generate")
        last = outputs[-1]
        err = self._final_error(last, rid)
        if err is not None:
            log.error("request_failed", request_id=rid, error=last.error)
            return await self._abort(context, err, rid)
        token_ids = [t for o in outputs for t in o.new_token_ids]
        log.info("request_done", request_id=rid, rpc="Generate", prompt_tokens=len(prompt),
                 generated_tokens=len(token_ids), finish_reason=last.status.name,
                 total_ms=round(1e3 * (time.monotonic() - started), 2))
        return pb.GenerateResponse(
            request_id=rid, text="".join(o.new_text for o in outputs), token_ids=token_ids,
            finish_reason=_FINISH.get(last.status, pb.FINISH_REASON_UNSPECIFIED),
            stop_reason="" if last.stop_reason is None else str(last.stop_reason),
            usage=pb.Usage(prompt_tokens=len(prompt), completion_tokens=len(token_ids),
                           total_tokens=len(prompt) + len(token_ids)),
            logprobs=self._logprobs(outputs) if sampling.logprobs else [],
        )

    async def GenerateStream(self, request: pb.GenerateStreamRequest, context: grpc.aio.ServicerContext):
        rid = None
        try:
            rid = self._request_id(request, context)
            prompt, sampling, stream = self._submit(request, rid)
        except FieldError as e:
            await self._abort(context, invalid_argument(e.field, e.description), rid)
            return
        except ServiceError as e:
            await self._abort(context, e, rid)
            return
        await context.send_initial_metadata((("x-request-id", rid),))
        started = time.monotonic()
        first_token_s = None
        n_generated = 0
        finished = False
        try:
            while not finished:
                batch = await stream.next_batch()
                last = batch[-1]
                finished = last.finished
                if finished and (err := self._final_error(last, rid)) is not None:
                    log.error("request_failed", request_id=rid, error=last.error)
                    await self._abort(context, err, rid)
                    return
                token_ids = [t for o in batch for t in o.new_token_ids]
                n_generated += len(token_ids)
                if first_token_s is None and token_ids:
                    first_token_s = time.monotonic() - started
                msg = pb.GenerateStreamResponse(
                    request_id=rid, text="".join(o.new_text for o in batch), token_ids=token_ids,
                    logprobs=self._logprobs(batch) if sampling.logprobs else [])
                if finished:
                    msg.finish_reason = _FINISH.get(last.status, pb.FINISH_REASON_UNSPECIFIED)
                    msg.stop_reason = "" if last.stop_reason is None else str(last.stop_reason)
                    msg.usage.CopyFrom(pb.Usage(prompt_tokens=len(prompt), completion_tokens=n_generated,
                                                total_tokens=len(prompt) + n_generated))
                yield msg
        finally:
            if not finished:
                self.engine.abort(rid)
                log.info("request_cancelled", request_id=rid, rpc="GenerateStream", generated_tokens=n_generated)
            else:
                log.info("request_done", request_id=rid, rpc="GenerateStream", prompt_tokens=len(prompt),
                         generated_tokens=n_generated,
                         ttft_ms=None if first_token_s is None else round(1e3 * first_token_s, 2),
                         total_ms=round(1e3 * (time.monotonic() - started), 2))

    async def Tokenize(self, request: pb.TokenizeRequest, context) -> pb.TokenizeResponse:
        try:
            engine = self._ready_engine()
        except ServiceError as e:
            return await self._abort(context, e, None)
        if len(request.text) > self.limits.max_prompt_chars:
            return await self._abort(context, invalid_argument(
                "text", f"is longer than {self.limits.max_prompt_chars} characters"), None)
        tok = engine.engine.tokenizer
        add = request.add_special_tokens if request.HasField("add_special_tokens") else True
        ids = tok.encode(request.text, add_special_tokens=add)
        return pb.TokenizeResponse(token_ids=ids, tokens=[tok.id_to_token(i) or "" for i in ids], count=len(ids))

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context) -> pb.GetModelInfoResponse:
        try:
            engine = self._ready_engine()
        except ServiceError as e:
            return await self._abort(context, e, None)
        core = engine.engine
        mc = core.model_config
        stats = core.stats()
        resp = pb.GetModelInfoResponse(
            model_name=self.model_name, architecture=mc.architecture, model_type=mc.model_type,
            max_model_len=core.max_model_len, vocab_size=core.vocab_size, eos_token_ids=list(core.eos_token_ids),
            kv_cache_dtype=core.config.kv_cache_dtype, block_size=core.config.block_size,
            device=str(core.device), dtype=core.dtype_name,
            load=pb.ModelLoad(
                kv_blocks_total=stats.kv_blocks_total, kv_blocks_free=stats.kv_blocks_free,
                requests_running=stats.requests_running,
                requests_waiting=stats.requests_waiting + engine.num_queued,
                max_num_seqs=core.config.max_num_seqs, max_waiting=core.config.max_waiting))
        if core.tokenizer.bos_token_id is not None:
            resp.bos_token_id = core.tokenizer.bos_token_id
        return resp
