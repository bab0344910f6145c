"""asyncio client of the pie GenerateService (grpc.aio); the same API as Client, awaited."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import grpc
import grpc.aio

from pie.v1 import generate_pb2 as pb
from pie.v1 import generate_pb2_grpc as pb_grpc

from . import _convert
from ._channel import (
    DEFAULT_TARGET,
    ChannelOptions,
    Metadata,
    call_metadata,
    channel_options,
    compression_algorithm,
    resolve_target,
)
from .errors import from_rpc_error
from .types import Completion, Delta, ModelInfo, Tokenization

_DEFAULT: Any = object()


class AsyncClient:
    """asyncio twin of `Client`; create it inside the event loop that will use it.

        async with AsyncClient("127.0.0.1:50051") as client:
            completion = await client.generate("Once upon a time", max_tokens=32)
            async for delta in client.stream("Once upon a time", max_tokens=32):
                print(delta.text, end="", flush=True)

    Arguments and errors are those of `Client`.
    """

    def __init__(
        self,
        target: str | Sequence[str] = DEFAULT_TARGET,
        *,
        timeout: float | None = None,
        metadata: Metadata | None = None,
        token: str | None = None,
        tls: bool = False,
        credentials: grpc.ChannelCredentials | None = None,
        options: ChannelOptions = (),
        lb_policy: str | None = None,
        compression: str | None = None,
        retry: bool = True,
    ) -> None:
        channel_target, several = resolve_target(target)
        opts = channel_options(several, lb_policy, options, retry)
        algorithm = compression_algorithm(compression)
        if credentials is None and tls:
            credentials = grpc.ssl_channel_credentials()
        if credentials is not None:
            self._channel = grpc.aio.secure_channel(channel_target, credentials, options=opts, compression=algorithm)
        else:
            self._channel = grpc.aio.insecure_channel(channel_target, options=opts, compression=algorithm)
        self._stub = pb_grpc.GenerateServiceStub(self._channel)
        self.target = channel_target
        self.timeout = timeout
        self._metadata = list(metadata or ())
        if token is not None:  # the server's --auth-token-file check
            self._metadata.append(("authorization", f"Bearer {token}"))

    def _timeout(self, timeout: float | None) -> float | None:
        return self.timeout if timeout is _DEFAULT else timeout

    async def wait_ready(self, timeout: float | None = None) -> None:
        """Wait until the channel is connected; raise TimeoutError otherwise."""
        try:
            await asyncio.wait_for(self._channel.channel_ready(), timeout)
        except TimeoutError:
            raise TimeoutError(f"no server ready at {self.target} within {timeout} s") from None

    async def generate(
        self,
        prompt: str | Sequence[int] | pb.ChatInput,
        *,
        request_id: str | None = None,
        priority: int = 0,
        adapter: str | None = None,
        timeout: float | None = _DEFAULT,
        **sampling: Any,
    ) -> Completion:
        """Generate a whole completion; see `Client.generate`."""
        request = _convert.build_request(pb.GenerateRequest, prompt, request_id, sampling, priority, adapter)
        try:
            response = await self._stub.Generate(
                request, timeout=self._timeout(timeout), metadata=call_metadata(self._metadata, request_id)
            )
        except grpc.RpcError as error:
            raise from_rpc_error(error, request_id) from None
        return _convert.completion(response)

    def stream(
        self,
        prompt: str | Sequence[int] | pb.ChatInput,
        *,
        request_id: str | None = None,
        priority: int = 0,
        adapter: str | None = None,
        timeout: float | None = _DEFAULT,
        **sampling: Any,
    ) -> AsyncIterator[Delta]:
        """Generate a completion as deltas (`async for`); see `Client.stream`."""
        request = _convert.build_request(pb.GenerateStreamRequest, prompt, request_id, sampling, priority, adapter)
        return self._stream(request, request_id, self._timeout(timeout))

    async def _stream(
        self, request: pb.GenerateStreamRequest, request_id: str | None, timeout: float | None
    ) -> AsyncIterator[Delta]:
        call = self._stub.GenerateStream(request, timeout=timeout, metadata=call_metadata(self._metadata, request_id))
        try:
            async for response in call:
                yield _convert.delta(response)
        except grpc.RpcError as error:
            raise from_rpc_error(error, request_id) from None
        finally:
            call.cancel()  # no-op once the stream ended; stops it when the caller left early

    async def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Any] | str | None = None,
        add_generation_prompt: bool | None = None,
        continue_final_message: bool = False,
        template_kwargs: Mapping[str, Any] | None = None,
        request_id: str | None = None,
        timeout: float | None = _DEFAULT,
        **sampling: Any,
    ) -> Completion:
        """Generate the answer to a conversation; see `Client.chat`."""
        chat = _convert.chat_input(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                   continue_final_message=continue_final_message, template_kwargs=template_kwargs)
        return await self.generate(chat, request_id=request_id, timeout=timeout, **sampling)

    def chat_stream(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Any] | str | None = None,
        add_generation_prompt: bool | None = None,
        continue_final_message: bool = False,
        template_kwargs: Mapping[str, Any] | None = None,
        request_id: str | None = None,
        timeout: float | None = _DEFAULT,
        **sampling: Any,
    ) -> AsyncIterator[Delta]:
        """The answer to a conversation as deltas: arguments as for `chat`, deltas as for `stream`."""
        chat = _convert.chat_input(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                   continue_final_message=continue_final_message, template_kwargs=template_kwargs)
        return self.stream(chat, request_id=request_id, timeout=timeout, **sampling)

    async def tokenize(
        self, text: str, *, add_special_tokens: bool = True, timeout: float | None = _DEFAULT
    ) -> Tokenization:
        """Token ids (and their text pieces) of `text`."""
        request = pb.TokenizeRequest(text=text, add_special_tokens=add_special_tokens)
        try:
            response = await self._stub.Tokenize(request, timeout=self._timeout(timeout), metadata=self._metadata)
        except grpc.RpcError as error:
            raise from_rpc_error(error) from None
        return _convert.tokenization(response)

    async def detokenize(
        self, token_ids: Sequence[int], *, skip_special_tokens: bool = True, timeout: float | None = _DEFAULT
    ) -> str:
        """The text of `token_ids`; see `Client.detokenize`."""
        request = _convert.detokenize_request(token_ids, skip_special_tokens)
        try:
            response = await self._stub.Detokenize(request, timeout=self._timeout(timeout), metadata=self._metadata)
        except grpc.RpcError as error:
            raise from_rpc_error(error) from None
        return response.text

    async def abort(self, request_ids: str | Sequence[str], *, timeout: float | None = _DEFAULT) -> list[str]:
        """Abort this caller's in-flight calls by request id; see `Client.abort`."""
        request = _convert.abort_request(request_ids)
        try:
            response = await self._stub.Abort(request, timeout=self._timeout(timeout), metadata=self._metadata)
        except grpc.RpcError as error:
            raise from_rpc_error(error) from None
        return list(response.aborted_request_ids)

    async def tokenize_chat(
        self,
        messages: Sequence[Mapping[str, Any]] | pb.ChatInput,
        *,
        tools: Sequence[Any] | str | None = None,
        add_generation_prompt: bool | None = None,
        continue_final_message: bool = False,
        template_kwargs: Mapping[str, Any] | None = None,
        timeout: float | None = _DEFAULT,
    ) -> Tokenization:
        """The token ids the model sees for a conversation (arguments as for `chat`), with the
        rendered text in `rendered_text`. `messages` may be a pb.ChatInput built already."""
        chat = messages if isinstance(messages, pb.ChatInput) else _convert.chat_input(
            messages, tools=tools, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, template_kwargs=template_kwargs)
        try:
            response = await self._stub.Tokenize(pb.TokenizeRequest(chat=chat), timeout=self._timeout(timeout),
                                           metadata=self._metadata)
        except grpc.RpcError as error:
            raise from_rpc_error(error) from None
        return _convert.tokenization(response)

    async def model_info(self, *, timeout: float | None = _DEFAULT) -> ModelInfo:
        """The served model and the server's current load."""
        try:
            response = await self._stub.GetModelInfo(
                pb.GetModelInfoRequest(), timeout=self._timeout(timeout), metadata=self._metadata
            )
        except grpc.RpcError as error:
            raise from_rpc_error(error) from None
        return _convert.model_info(response)

    async def close(self) -> None:
        """Close the channel; calls in flight are cancelled."""
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()
