"""Admission: the one way a generation request gets into the engine, whichever door it came
through (gRPC, or HTTP read into the same contract message by service/http/requests.py).

`Admission` holds what admitting needs and what both doors share: the engine client once the
model is loaded, the chat templates, the request limits, the worker threads for long prompts, the
metrics, the in-flight table Abort calls search, and whether the server is draining. `admit`
validates a pie.v1 request, renders and tokenizes its prompt, checks its structured output, and
submits it; every refusal is a RequestError (a field at fault) or a ServiceError (a status), which
each door maps once (service/errors.py `status_of`, service/http/errors.py `http_error`).
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc
import structlog

from pie.engine.client.engine_client import EngineClient, RequestStream
from pie.engine.errors import EngineDeadError, QueueFullError, RequestError
from pie.engine.messages import AdapterState
from pie.engine.sampling_params import SamplingParams
from pie.engine.scheduling.adapters import AdapterNotFoundError
from pie.model.chat_template import ChatTemplates
from pie.model.lora import AdapterError
from pie.v1 import generate_pb2 as pb

from .aborts import InFlight
from .errors import ServiceError
from .metrics import ServiceMetrics
from .prompts import check_structured, prompt_ids, render
from .validation import ChatPrompt, Limits, prompt_from_proto, qualify, sampling_from_proto
from .workers import Workers

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class Admitted:
    """A request the engine accepted, and what its answer needs."""

    request_id: str  # the caller's (request field, x-request-id header, or minted)
    client: EngineClient  # the engine that holds it
    prompt: list[int]  # the prompt's token ids (a text or chat tokenized)
    sampling: SamplingParams
    stream: RequestStream  # its outputs, as the engine delivers them


class Admission:
    """What both doors hold: the server's state as admission sees it, and `admit`."""

    def __init__(self, *, model_name: str, limits: Limits | None = None, metrics: ServiceMetrics | None = None,
                 auth: bool = False) -> None:
        self.model_name = model_name
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
        # Set by the server's stop when it lets gRPC cut what still runs (its grace is over): a
        # request cancelled from then on was ended by the shutdown, not by its caller.
        self.shutting_down = False
        # Long tokenizations and large answers run on these threads.
        self.workers = Workers()

    @property
    def ready(self) -> bool:
        """Serving: the model is loaded and the server is not draining."""
        return self.engine_client is not None and not self.draining

    def close(self) -> None:
        """Lets the worker threads go (after the server stopped)."""
        self.workers.close()

    def ready_client(self) -> EngineClient:
        """The engine client, or the ServiceError that says why there is none to serve with."""
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

    async def render(self, chat: ChatPrompt, field: str = "chat") -> str:
        return await render(self.workers, self.chat_templates, self.chat_template_problem, chat, field)

    async def admit(self, request: pb.GenerateRequest | pb.GenerateStreamRequest, request_id: str, *,
                    streamed: bool, to_context: bool = False) -> Admitted:
        """A generation request validated, its prompt made token ids, and submitted to the engine.
        `streamed`: its tokens are read as they come (the engine bounds the stalls of such decodes
        only). `to_context`: the request may generate until the context is full (OpenAI's chat
        without max_tokens), not the contract's default of 16 tokens. Raises ServiceError, or a
        RequestError naming its field by the contract's path (`sampling.top_p`)."""
        try:
            return await self._admit(request, request_id, streamed, to_context)
        except RequestError as e:  # the engine's names (`top_p`) become the contract's, here only
            raise RequestError(qualify(e.field), e.message, e.reason) from None

    async def _admit(self, request: pb.GenerateRequest | pb.GenerateStreamRequest, request_id: str,
                     streamed: bool, to_context: bool) -> Admitted:
        client = self.ready_client()
        prompt = prompt_from_proto(request, self.limits)
        sampling = sampling_from_proto(request.sampling, max_model_len=client.info.max_model_len)
        if isinstance(prompt, ChatPrompt):
            # The template writes the special tokens (BOS included): none are added when tokenizing.
            prompt = await prompt_ids(self.workers, client, await self.render(prompt), "chat",
                                      add_special_tokens=False)
        elif isinstance(prompt, str):
            prompt = await prompt_ids(self.workers, client, prompt, "prompt", add_special_tokens=True)
        if to_context:
            sampling.max_tokens = max(1, client.info.max_model_len - len(prompt))
        if sampling.structured is not None:
            await check_structured(self.workers, client, sampling.structured)
        client = self.ready_client()  # it may have stopped while the prompt was prepared
        try:
            stream = client.submit(prompt, sampling, caller_id=request_id, priority=request.priority,
                                   streamed=streamed, adapter=request.adapter or None)
        except AdapterNotFoundError as e:
            raise adapter_error(e, "adapter") from None
        except QueueFullError as e:
            raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"server is at capacity: {e}",
                               reason="QUEUE_FULL", retry_after_s=1.0) from e
        except EngineDeadError as e:
            raise ServiceError(grpc.StatusCode.UNAVAILABLE, str(e), reason="ENGINE_STOPPED") from e
        return Admitted(request_id, client, prompt, sampling, stream)

    # ---- LoRA adapters (both doors' load, unload and list) ----------------------------------------
    async def load_adapter(self, name: str, path: str) -> AdapterState:
        """Loads a PEFT adapter folder under `name`; ServiceError naming it when it cannot."""
        client = self.ready_client()
        if not name:
            raise RequestError("name", "must not be empty")
        if not path:
            raise RequestError("path", "must name the adapter's folder")
        try:
            await client.load_adapter(name, path)
        except AdapterError as e:
            raise adapter_error(e, "path") from None
        log.info("adapter_loaded", adapter=name, path=path)
        return next((a for a in self.adapters() if a.name == name), AdapterState(name, path, 0, False, 0, 0))

    async def unload_adapter(self, name: str) -> None:
        try:
            await self.ready_client().unload_adapter(name)
        except AdapterError as e:
            raise adapter_error(e, "name") from None
        log.info("adapter_unloaded", adapter=name)

    def adapters(self) -> list[AdapterState]:
        """The loaded adapters (those being unloaded left out), as of the engine's latest step."""
        client = self.ready_client()
        names = set(client.adapter_names)
        return [a for a in client.stats().adapters if a.name in names]


def adapter_error(err: AdapterError, field: str) -> ServiceError:
    """An adapter's refusal as a status naming it: NOT_FOUND for an unknown name, else INVALID_ARGUMENT."""
    if isinstance(err, AdapterNotFoundError):
        return ServiceError(grpc.StatusCode.NOT_FOUND, str(err), reason="ADAPTER_NOT_FOUND", field=field)
    return ServiceError(grpc.StatusCode.INVALID_ARGUMENT, str(err), reason="ADAPTER_INVALID", field=field)
