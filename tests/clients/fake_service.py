"""An in-process fake GenerateService on a loopback port, for tests of pie_client and its CLI."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent import futures

import grpc
from google.rpc import error_details_pb2, status_pb2

from pie.v1 import generate_pb2 as pb
from pie.v1 import generate_pb2_grpc as pb_grpc

RETRY_SECONDS = 1.5


class FakeGenerateService(pb_grpc.GenerateServiceServicer):
    """Canned answers; prompts "invalid" and "full" fail, "forever" streams one message and waits
    until cancelled, "ticks" streams messages until cancelled (then sets `ticks_cancelled`)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.requests: list[object] = []
        self.metadata: list[dict[str, str]] = []
        self.stream_cancelled = threading.Event()
        self.ticks_cancelled = threading.Event()

    def _record(self, request: object, context: grpc.ServicerContext) -> str:
        metadata = dict(context.invocation_metadata())
        self.requests.append(request)
        self.metadata.append(metadata)
        return getattr(request, "request_id", "") or metadata.get("x-request-id") or "srv-1"

    @staticmethod
    def _fail(context: grpc.ServicerContext, request_id: str, prompt: str) -> None:
        """Abort like the real service does, with google.rpc details in the trailer."""
        if prompt == "invalid":
            code, message = grpc.StatusCode.INVALID_ARGUMENT, "invalid sampling parameters"
            detail = error_details_pb2.BadRequest(
                field_violations=[
                    error_details_pb2.BadRequest.FieldViolation(field="sampling.top_p", description="must be in (0, 1]")
                ]
            )
        elif prompt == "full":
            code, message = grpc.StatusCode.RESOURCE_EXHAUSTED, "waiting queue is full"
            detail = error_details_pb2.RetryInfo()
            detail.retry_delay.FromNanoseconds(int(RETRY_SECONDS * 1e9))
        else:
            return
        status = status_pb2.Status(code=code.value[0], message=message)
        status.details.add().Pack(detail)
        context.set_trailing_metadata(
            (("grpc-status-details-bin", status.SerializeToString()), ("x-request-id", request_id))
        )
        context.abort(code, message)

    def Generate(self, request: pb.GenerateRequest, context: grpc.ServicerContext) -> pb.GenerateResponse:
        request_id = self._record(request, context)
        self._fail(context, request_id, request.prompt)
        logprobs = [
            pb.TokenLogprob(token_id=t, logprob=-0.5, token="x", top_logprobs=[pb.TopLogprob(token_id=9, logprob=-1.0)])
            for t in (1, 2, 3)
        ] if request.sampling.logprobs else []
        return pb.GenerateResponse(
            request_id=request_id,
            text="Hello!",
            token_ids=[1, 2, 3],
            finish_reason=pb.FINISH_REASON_STOP,
            stop_reason="\n",
            usage=pb.Usage(prompt_tokens=4, completion_tokens=3, total_tokens=7),
            logprobs=logprobs,
            prompt_logprobs=self._prompt_logprobs(request.sampling),
        )

    @staticmethod
    def _prompt_logprobs(sampling: pb.SamplingParams) -> list[pb.PromptLogprob]:
        if not sampling.HasField("prompt_logprobs"):
            return []
        top = [pb.TopLogprob(token_id=8, logprob=-0.25, token="y")][:sampling.prompt_logprobs]
        return [pb.PromptLogprob(token_id=1, token="<s>"),
                pb.PromptLogprob(token_id=72, logprob=-3.5, token="H", top_logprobs=top)]

    def GenerateStream(
        self, request: pb.GenerateStreamRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.GenerateStreamResponse]:
        request_id = self._record(request, context)
        self._fail(context, request_id, request.prompt)
        if request.prompt == "forever":
            context.add_callback(self.stream_cancelled.set)
            yield pb.GenerateStreamResponse(request_id=request_id, text="tick", token_ids=[7])
            self.stream_cancelled.wait(10)
            return
        if request.prompt == "ticks":  # gRPC stops taking messages once the call is cancelled
            ended = threading.Event()
            context.add_callback(lambda: ended.is_set() or self.ticks_cancelled.set())
            for _ in range(10_000):  # 10 s at most
                yield pb.GenerateStreamResponse(request_id=request_id, text="tick ", token_ids=[7])
                threading.Event().wait(0.001)
            ended.set()
            return
        yield pb.GenerateStreamResponse(request_id=request_id, text="Hel", token_ids=[1, 2],
                                        prompt_logprobs=self._prompt_logprobs(request.sampling))
        yield pb.GenerateStreamResponse(request_id=request_id, text="lo", token_ids=[3])
        yield pb.GenerateStreamResponse(
            request_id=request_id,
            text="!",
            token_ids=[4],
            finish_reason=pb.FINISH_REASON_LENGTH,
            usage=pb.Usage(prompt_tokens=2, completion_tokens=4, total_tokens=6),
        )

    def Tokenize(self, request: pb.TokenizeRequest, context: grpc.ServicerContext) -> pb.TokenizeResponse:
        self._record(request, context)
        add_bos = request.add_special_tokens if request.HasField("add_special_tokens") else True
        ids = ([1] if add_bos else []) + [ord(c) for c in request.text]
        tokens = (["<s>"] if add_bos else []) + list(request.text)
        return pb.TokenizeResponse(token_ids=ids, tokens=tokens, count=len(ids))

    def Detokenize(self, request: pb.DetokenizeRequest, context: grpc.ServicerContext) -> pb.DetokenizeResponse:
        self._record(request, context)
        skip = request.skip_special_tokens if request.HasField("skip_special_tokens") else True
        return pb.DetokenizeResponse(text="".join("" if t == 1 and skip else "<s>" if t == 1 else chr(t)
                                                  for t in request.token_ids))

    def Abort(self, request: pb.AbortRequest, context: grpc.ServicerContext) -> pb.AbortResponse:
        """Finds the ids that start with "live"."""
        self._record(request, context)
        return pb.AbortResponse(aborted_request_ids=[r for r in request.request_ids if r.startswith("live")])

    def GetModelInfo(self, request: pb.GetModelInfoRequest, context: grpc.ServicerContext) -> pb.GetModelInfoResponse:
        self._record(request, context)
        return pb.GetModelInfoResponse(
            model_name=self.name,
            architecture="LlamaForCausalLM",
            model_type="llama",
            max_model_len=2048,
            vocab_size=32000,
            eos_token_ids=[2],
            kv_cache_dtype="int8",
            block_size=16,
            device="cpu",
            dtype="fp32",
            logprobs_mode="raw",
            load=pb.ModelLoad(kv_blocks_total=100, kv_blocks_free=90, requests_running=1, max_num_seqs=8, max_waiting=64),
        )


def start(name: str) -> tuple[grpc.Server, FakeGenerateService, str]:
    servicer = FakeGenerateService(name)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    pb_grpc.add_GenerateServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, servicer, f"127.0.0.1:{port}"

