"""Blocking client of the pie GenerateService."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import grpc

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

# Marks "use the client's default timeout", since None already means "no deadline".
_DEFAULT: Any = object()


class Client:
    """Talks to one pie server, or balances over several (round_robin).

        with Client("127.0.0.1:50051") as client:
            print(client.generate("Once upon a time", max_tokens=32, temperature=0.8).text)
            for delta in client.stream("Once upon a time", max_tokens=32):
                print(delta.text, end="", flush=True)

    Args:
        target: one gRPC target ("host:port", "dns:///name:port", ...) or a list of "ip:port"
            addresses to balance over.
        timeout: default deadline of every call in seconds (for a stream: the whole stream);
            None means no deadline. Each method takes `timeout=` to override it.
        metadata: (key, value) pairs sent with every call.
        token: bearer token for a server started with --auth-token-file (sent as
            "authorization: Bearer TOKEN").
        credentials: channel credentials for TLS; `tls=True` uses the system roots.
        options: extra gRPC channel options.
        lb_policy: load-balancing policy; defaults to round_robin when several addresses are given.
        compression: "gzip" (or "deflate") compresses every request; the server accepts either,
            and answers compressed when started with --compression. None sends them plain.
        retry: True (the default) retries a call that fails UNAVAILABLE before the server answered
            anything (a replica down, loading or draining; a balancer that had no replica for it):
            at most 4 attempts in all, a random pause of up to 0.1 s doubling to at most 1 s between
            them, all within the call's deadline (gRPC's retryPolicy in the channel's service config,
            `pie_client._channel.RETRY_POLICY`; a `grpc.service_config` in `options` replaces it).
            A stream that has begun (the server admitted it) is never replayed; a unary call is,
            until its answer arrives. False sends every call once.

    Every method raises a `PieError` subclass when the RPC fails.
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
            self._channel = grpc.secure_channel(channel_target, credentials, options=opts, compression=algorithm)
        else:
            self._channel = grpc.insecure_channel(channel_target, options=opts, compression=algorithm)
        self._stub = pb_grpc.GenerateServiceStub(self._channel)
        self.target = channel_target
        self.timeout = timeout
        self._metadata = list(metadata or ())
        if token is not None:  # the server's --auth-token-file check
            self._metadata.append(("authorization", f"Bearer {token}"))

    def _timeout(self, timeout: float | None) -> float | None:
        return self.timeout if timeout is _DEFAULT else timeout

    def wait_ready(self, timeout: float | None = None) -> None:
        """Block until the channel is connected; raise TimeoutError otherwise."""
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            raise TimeoutError(f"no server ready at {self.target} within {timeout} s") from None

    def generate(
        self,
        prompt: str | Sequence[int] | pb.ChatInput,
        *,
        request_id: str | None = None,
        priority: int = 0,
        adapter: str | None = None,
        timeout: float | None = _DEFAULT,
        **sampling: Any,
    ) -> Completion:
        """Generate a whole completion of a text prompt or a list of token ids (or a pb.ChatInput:
        `chat` builds one).

        `sampling` takes SamplingParams field names (max_tokens, temperature, top_k, top_p, ...);
        an unknown name raises TypeError. `structured` constrains the output: {"json_schema":
        schema}, {"regex": "..."}, {"choice": [...]}, {"grammar": "<Lark>"} or {"json_object": True}.
        `request_id` is sent as `x-request-id`. `priority`: lower is scheduled first (0 by default;
        requests of one priority in arrival order). `adapter`: a LoRA adapter the server has loaded,
        by name (None: the base model; an unknown name raises NotFound).
        """
        request = _convert.build_request(pb.GenerateRequest, prompt, request_id, sampling, priority, adapter)
        try:
            response = self._stub.Generate(
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
    ) -> Iterator[Delta]:
        """Generate a completion as it is made: deltas whose texts join into the whole answer.

        The last delta carries finish_reason, stop_reason and usage. Leaving the loop early (or
        closing the iterator) cancels the RPC, which frees the request on the server.
        """
        request = _convert.build_request(pb.GenerateStreamRequest, prompt, request_id, sampling, priority, adapter)
        return self._stream(request, request_id, self._timeout(timeout))

    def _stream(self, request: pb.GenerateStreamRequest, request_id: str | None, timeout: float | None) -> Iterator[Delta]:
        call = self._stub.GenerateStream(request, timeout=timeout, metadata=call_metadata(self._metadata, request_id))
        try:
            for response in call:
                yield _convert.delta(response)
        except grpc.RpcError as error:
            raise from_rpc_error(error, request_id) from None
        finally:
            call.cancel()  # no-op once the stream ended; stops it when the caller left early

    def chat(
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
        """Generate the answer to a conversation, rendered with the served model's chat template.

            client.chat([{"role": "user", "content": "Name a color."}], max_tokens=16,
                        structured={"choice": ["red", "green", "blue"]})

        `messages`: dicts with "role" and optionally "content", "name", "tool_call_id" and
        "tool_calls" (a list of tool calls); `tools`: tool definitions (JSON schemas of functions);
        `add_generation_prompt`: None means the server's default (True, or False when continuing);
        `continue_final_message`: the model continues the last message; `template_kwargs`: further
        variables for the template. `sampling` as for `generate` (structured= included).
        """
        chat = _convert.chat_input(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                   continue_final_message=continue_final_message, template_kwargs=template_kwargs)
        return self.generate(chat, request_id=request_id, timeout=timeout, **sampling)

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
    ) -> Iterator[Delta]:
        """The answer to a conversation as deltas: arguments as for `chat`, deltas as for `stream`."""
        chat = _convert.chat_input(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                   continue_final_message=continue_final_message, template_kwargs=template_kwargs)
        return self.stream(chat, request_id=request_id, timeout=timeout, **sampling)

    def tokenize(self, text: str, *, add_special_tokens: bool = True, timeout: float | None = _DEFAULT) -> Tokenization:
        """Token ids (and their text pieces) of `text` under the served model's tokenizer."""
        request = pb.TokenizeRequest(text=text, add_special_tokens=add_special_tokens)
        try:
            response = self._stub.Tokenize(request, timeout=self._timeout(timeout), metadata=self._metadata)
        except grpc.RpcError as error:
            raise from_rpc_error(error) from None
        return _convert.tokenization(response)

    def detokenize(
        self, token_ids: Sequence[int], *, skip_special_tokens: bool = True, timeout: float | None = _DEFAULT
    ) -> str:
        """The text of `token_ids` under the served model's tokenizer (the inverse of `tokenize`)."""
        request = _convert.detokenize_request(token_ids, skip_special_tokens)
        try:
            response = self._stub.Detokenize(request, timeout=self._timeout(timeout), metadata=self._metadata)
        except grpc.RpcError as error:
            raise from_rpc_error(error) from None
        return response.text

    def abort(self, request_ids: str | Sequence[str], *, timeout: float | None = _DEFAULT) -> list[str]:
        """Abort this caller's in-flight generate/stream calls by the request ids given to them.

        Returns the ids that named one (aborted now: their calls raise `Cancelled`, reason
        "REQUEST_ABORTED"); an id not returned was unknown, finished or another caller's. A caller is
        its token on a server with --auth-token-file; without tokens every caller is one, so any
        client, in any process, may abort a request by its id (docs/clients.md, "pie-client").
        """
        request = _convert.abort_request(request_ids)
        try:
            response = self._stub.Abort(request, timeout=self._timeout(timeout), metadata=self._metadata)
        except grpc.RpcError as error:
            raise from_rpc_error(error) from None
        return list(response.aborted_request_ids)

    def tokenize_chat(
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
            response = self._stub.Tokenize(pb.TokenizeRequest(chat=chat), timeout=self._timeout(timeout),
                                           metadata=self._metadata)
        except grpc.RpcError as error:
            raise from_rpc_error(error) from None
        return _convert.tokenization(response)

    def model_info(self, *, timeout: float | None = _DEFAULT) -> ModelInfo:
        """The served model and the server's current load."""
        try:
            response = self._stub.GetModelInfo(
                pb.GetModelInfoRequest(), timeout=self._timeout(timeout), metadata=self._metadata
            )
        except grpc.RpcError as error:
            raise from_rpc_error(error) from None
        return _convert.model_info(response)

    def close(self) -> None:
        """Close the channel; calls in flight are cancelled."""
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
