"""pie_client against an in-process fake GenerateService on a loopback port."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import grpc
import pytest

import pie_client
from pie.v1 import generate_pb2 as pb
from pie_client import _convert, cli
from pie_client._channel import resolve_target
from tests.clients.fake_service import RETRY_SECONDS, FakeGenerateService, start


@pytest.fixture
def client(fake: tuple[FakeGenerateService, str]) -> Iterator[pie_client.Client]:
    with pie_client.Client(fake[1], timeout=10) as c:
        yield c


def test_generate_round_trip(client: pie_client.Client, fake: tuple[FakeGenerateService, str]) -> None:
    servicer = fake[0]
    done = client.generate("Hi there", request_id="req-42", max_tokens=5, temperature=0.5, top_p=0.9, stop="\n", logprobs=1)
    assert done == pie_client.Completion(
        request_id="req-42",
        text="Hello!",
        token_ids=[1, 2, 3],
        finish_reason="stop",
        stop_reason="\n",
        prompt_tokens=4,
        completion_tokens=3,
        logprobs=[
            pie_client.TokenLogprob(t, -0.5, "x", [pie_client.TopLogprob(9, -1.0, "")]) for t in (1, 2, 3)
        ],
    )
    assert done.total_tokens == 7
    sent = servicer.requests[-1]
    assert servicer.metadata[-1]["x-request-id"] == "req-42"
    assert sent.prompt == "Hi there" and sent.request_id == "req-42"
    assert sent.sampling.max_tokens == 5 and sent.sampling.temperature == 0.5
    assert sent.sampling.HasField("top_p") and not sent.sampling.HasField("repetition_penalty")
    assert list(sent.sampling.stop) == ["\n"]


def test_generate_with_token_ids(client: pie_client.Client, fake: tuple[FakeGenerateService, str]) -> None:
    client.generate([5, 6, 7], stop_token_ids=[2], seed=3)
    sent = fake[0].requests[-1]
    assert sent.WhichOneof("prompt_input") == "prompt_token_ids"
    assert list(sent.prompt_token_ids.ids) == [5, 6, 7]
    assert list(sent.sampling.stop_token_ids) == [2] and sent.sampling.seed == 3
    assert "x-request-id" not in fake[0].metadata[-1]  # none chosen: the server makes one
    client.generate([])
    assert fake[0].requests[-1].WhichOneof("prompt_input") == "prompt_token_ids"  # the server rejects it, not us


def test_unknown_sampling_keyword_raises_type_error(client: pie_client.Client) -> None:
    with pytest.raises(TypeError, match="max_new_tokens"):
        client.generate("hi", max_new_tokens=5)
    with pytest.raises(TypeError, match="prompt"):
        client.generate(b"bytes")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("prompt", "sampling", "error", "message"),
    [
        ("hi", {"max_tokens": -5}, ValueError, "max_tokens: must be >= 1, got -5 (leave it out for the server's default, 16)"),
        ("hi", {"max_tokens": 0}, ValueError, "max_tokens: must be >= 1, got 0 (leave it out for the server's default, 16)"),
        ("hi", {"n": 0}, ValueError, "n: must be >= 1, got 0 (leave it out for the default, 1)"),
        ("hi", {"top_k": 2**32}, ValueError, "top_k: must be <= 4294967295, got 4294967296"),
        ("hi", {"seed": -1}, ValueError, "seed: must be >= 0, got -1"),
        ("hi", {"temperature": 1e39}, ValueError, "temperature: must fit a 32-bit float (magnitude below 3.4e38), got 1e+39"),
        ("hi", {"stop_token_ids": [2, -1]}, ValueError, "stop_token_ids[1]: must be >= 0, got -1"),
        ([5, -1], {}, ValueError, "prompt_token_ids[1]: must be >= 0, got -1"),
        ("hi", {"max_tokens": "3"}, TypeError, "max_tokens: cannot be '3' ("),
        ("hi", {"stop": [1]}, TypeError, "stop: cannot be [1] ("),
        ("hi", {"stop": 1.5}, TypeError, "stop: expected a list, got float"),
        ("hi", {"logit_bias": {-1: 1.0}}, ValueError, "logit_bias: key -1 must be >= 0, got -1"),
        ("hi", {"logit_bias": {2**32: 1.0}}, ValueError, "logit_bias: key 4294967296 must be <= 4294967295"),
        ("hi", {"logit_bias": {5: 1e39}}, ValueError, "logit_bias[5]: must fit a 32-bit float"),
        ("hi", {"logit_bias": [5]}, TypeError, "logit_bias: expected a mapping (token id -> bias), got list"),
        ("hi", {"logit_bias": {5: "x"}}, TypeError, "logit_bias: cannot be {5: 'x'} ("),
        ("hi", {"min_tokens": -1}, ValueError, "min_tokens: must be >= 0, got -1"),
        ("hi", {"prompt_logprobs": -1}, ValueError, "prompt_logprobs: must be >= 0, got -1"),
    ],
)
def test_a_value_the_request_cannot_carry_is_refused_by_field_name(
    client: pie_client.Client, fake: tuple[FakeGenerateService, str], prompt: str | list[int],
    sampling: dict[str, object], error: type[Exception], message: str,
) -> None:
    sent = len(fake[0].requests)
    for call in (client.generate, client.stream):
        with pytest.raises(error) as caught:
            call(prompt, **sampling)
        assert str(caught.value).startswith(message)
    assert len(fake[0].requests) == sent  # refused before sending


def test_zeros_that_mean_zero_are_sent(client: pie_client.Client, fake: tuple[FakeGenerateService, str]) -> None:
    client.generate("hi", seed=0, top_k=0, logprobs=0, temperature=0.0, max_tokens=None)
    sent = fake[0].requests[-1].sampling
    assert sent.HasField("seed") and sent.seed == 0 and sent.max_tokens == 0  # max_tokens unset: the default


def test_new_options_are_sent_and_prompt_logprobs_read(
    client: pie_client.Client, fake: tuple[FakeGenerateService, str]
) -> None:
    done = client.generate("hi", logit_bias={5: -100, 7: 2.5}, min_tokens=2, prompt_logprobs=0)
    sent = fake[0].requests[-1].sampling
    assert dict(sent.logit_bias) == {5: -100.0, 7: 2.5} and sent.min_tokens == 2
    assert sent.HasField("prompt_logprobs") and sent.prompt_logprobs == 0  # 0 is sent: the prompt tokens' own
    assert done.prompt_logprobs == [pie_client.PromptLogprob(1, "<s>", None),
                                    pie_client.PromptLogprob(72, "H", -3.5)]
    assert client.generate("hi").prompt_logprobs == [] and not fake[0].requests[-1].sampling.HasField("prompt_logprobs")
    deltas = list(client.stream("hi", prompt_logprobs=1))
    assert deltas[0].prompt_logprobs[1].top_logprobs == [pie_client.TopLogprob(8, -0.25, "y")]
    assert all(d.prompt_logprobs == [] for d in deltas[1:])


def test_detokenize_and_abort(client: pie_client.Client, fake: tuple[FakeGenerateService, str]) -> None:
    assert client.detokenize([1, 72, 105]) == "Hi"
    assert client.detokenize((1, 72), skip_special_tokens=False) == "<s>H"
    assert client.abort("live-1") == ["live-1"]
    assert list(fake[0].requests[-1].request_ids) == ["live-1"]
    assert client.abort(["gone", "live-2"]) == ["live-2"]
    sent = len(fake[0].requests)
    with pytest.raises(ValueError, match=r"^token_ids\[1\]: must be >= 0, got -3"):
        client.detokenize([1, -3])
    with pytest.raises(TypeError, match="token_ids must be a sequence of ints"):
        client.detokenize("12")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"request_ids\[0\]: expected a str"):
        client.abort([7])  # type: ignore[list-item]
    assert len(fake[0].requests) == sent  # refused before sending


def test_stream_yields_deltas_and_a_final_summary(client: pie_client.Client) -> None:
    deltas = list(client.stream("Hi", request_id="s-1", max_tokens=4))
    assert "".join(d.text for d in deltas) == "Hello!"
    assert [d.token_ids for d in deltas] == [[1, 2], [3], [4]]
    assert [d.finish_reason for d in deltas] == [None, None, "length"]
    assert [d.usage for d in deltas[:-1]] == [None, None]
    assert deltas[-1].usage == pie_client.Usage(prompt_tokens=2, completion_tokens=4, total_tokens=6)
    assert {d.request_id for d in deltas} == {"s-1"}


def test_leaving_a_stream_early_cancels_the_rpc(client: pie_client.Client, fake: tuple[FakeGenerateService, str]) -> None:
    fake[0].stream_cancelled.clear()
    stream = client.stream("forever")
    assert next(stream).text == "tick"
    stream.close()
    assert fake[0].stream_cancelled.wait(5)


def test_tokenize_and_model_info(client: pie_client.Client) -> None:
    tokens = client.tokenize("ab")
    assert (tokens.token_ids, tokens.tokens, len(tokens)) == ([1, 97, 98], ["<s>", "a", "b"], 3)
    assert client.tokenize("ab", add_special_tokens=False).token_ids == [97, 98]
    info = client.model_info()
    assert info.model_name == "fake" and info.architecture == "LlamaForCausalLM"
    assert info.eos_token_ids == [2] and info.bos_token_id is None
    assert info.load == pie_client.ModelLoad(100, 90, 1, 0, 8, 64) and info.logprobs_mode == "raw"
    assert info.speculative is None  # the server does not speculate


def test_model_info_of_a_speculating_server() -> None:
    response = pb.GetModelInfoResponse(model_name="m", speculative=pb.SpeculativeDecoding(
        method="ngram", num_speculative_tokens=4, num_drafts=8, num_draft_tokens=32, num_accepted_tokens=20,
        acceptance_rate=0.625, mean_acceptance_length=3.5))  # exact in float32
    info = _convert.model_info(response)
    assert info.speculative == pie_client.SpeculativeDecoding("ngram", 4, 8, 32, 20, 0.625, 3.5)


def test_invalid_argument_carries_field_violations(client: pie_client.Client) -> None:
    with pytest.raises(pie_client.InvalidArgument) as caught:
        client.generate("invalid", request_id="bad-1")
    error = caught.value
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details == "invalid sampling parameters"
    assert error.request_id == "bad-1"
    assert error.field_violations == [("sampling.top_p", "must be in (0, 1]")]
    assert "sampling.top_p" in str(error)
    with pytest.raises(pie_client.InvalidArgument):
        list(client.stream("invalid"))


def test_an_error_says_a_field_violation_once() -> None:
    code = grpc.StatusCode.INVALID_ARGUMENT
    violation = ("sampling.top_p", "must be in (0, 1]")
    said = pie_client.InvalidArgument(code, "sampling.top_p: must be in (0, 1]", request_id="r-1",
                                      field_violations=[violation])  # pie's server: the message names the field
    assert str(said) == "INVALID_ARGUMENT: sampling.top_p: must be in (0, 1] [request_id=r-1]"
    unsaid = pie_client.InvalidArgument(code, "invalid sampling parameters", field_violations=[violation])
    assert str(unsaid) == "INVALID_ARGUMENT: invalid sampling parameters (sampling.top_p: must be in (0, 1])"
    other = pie_client.InvalidArgument(code, "sampling.top_p: bad", field_violations=[violation])
    assert str(other) == "INVALID_ARGUMENT: sampling.top_p: bad (sampling.top_p: must be in (0, 1])"


def test_resource_exhausted_has_retry_after(client: pie_client.Client) -> None:
    with pytest.raises(pie_client.ResourceExhausted) as caught:
        client.generate("full")
    assert caught.value.retry_after == pytest.approx(RETRY_SECONDS)
    assert caught.value.request_id == "srv-1"  # from the trailer


def test_unreachable_server_is_unavailable() -> None:
    server, _, address = start("gone")
    server.stop(None)  # the port is now closed
    with pie_client.Client(address, timeout=5) as client, pytest.raises(pie_client.Unavailable):
        client.model_info()


class _Error(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode) -> None:
        self._code = code

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return "boom"


@pytest.mark.parametrize(
    ("code", "cls"),
    [
        (grpc.StatusCode.DEADLINE_EXCEEDED, pie_client.DeadlineExceeded),
        (grpc.StatusCode.CANCELLED, pie_client.Cancelled),
        (grpc.StatusCode.INTERNAL, pie_client.InternalError),
        (grpc.StatusCode.UNAUTHENTICATED, pie_client.Unauthenticated),
        (grpc.StatusCode.UNAVAILABLE, pie_client.Unavailable),
        (grpc.StatusCode.FAILED_PRECONDITION, pie_client.FailedPrecondition),
        (grpc.StatusCode.ABORTED, pie_client.PieError),
    ],
)
def test_error_classes_by_code(code: grpc.StatusCode, cls: type[pie_client.PieError]) -> None:
    error = pie_client.from_rpc_error(_Error(code), request_id="mine")
    assert type(error) is cls
    assert (error.code, error.details, error.request_id, error.field_violations) == (code, "boom", "mine", [])


def test_several_addresses_are_balanced_round_robin() -> None:
    (server_a, _, address_a), (server_b, _, address_b) = start("a"), start("b")
    try:
        with pie_client.Client([address_a, address_b], timeout=5) as client:
            assert client.target.startswith("ipv4:127.0.0.1:")
            seen: set[str] = set()
            for _ in range(200):  # until both answered; round_robin alternates once both connect
                seen.add(client.model_info().model_name)
                if seen == {"a", "b"}:
                    break
            assert seen == {"a", "b"}
    finally:
        server_a.stop(None)
        server_b.stop(None)


def test_resolve_target() -> None:
    assert resolve_target("dns:///pie:50051") == ("dns:///pie:50051", False)
    assert resolve_target(["10.0.0.1:1"]) == ("10.0.0.1:1", False)
    assert resolve_target(["10.0.0.1:1", "10.0.0.2:2"]) == ("ipv4:10.0.0.1:1,10.0.0.2:2", True)
    assert resolve_target(["[::1]:1", "[::1]:2"]) == ("ipv6:[::1]:1,[::1]:2", True)
    with pytest.raises(ValueError, match="dns:///"):
        resolve_target(["pie-a:1", "pie-b:1"])
    with pytest.raises(ValueError, match="host:port"):
        resolve_target(["10.0.0.1", "10.0.0.2:1"])


def test_async_client(fake: tuple[FakeGenerateService, str]) -> None:
    servicer, address = fake

    async def scenario() -> None:
        async with pie_client.AsyncClient(address, timeout=10) as client:
            await client.wait_ready(5)
            done = await client.generate("Hi", request_id="a-1", max_tokens=3)
            assert (done.text, done.finish_reason, done.request_id) == ("Hello!", "stop", "a-1")
            assert servicer.metadata[-1]["x-request-id"] == "a-1"
            deltas = [d async for d in client.stream("Hi")]
            assert "".join(d.text for d in deltas) == "Hello!"
            assert deltas[-1].finish_reason == "length" and deltas[-1].usage is not None
            assert (await client.tokenize("a")).token_ids == [1, 97]
            assert (await client.model_info()).model_name == "fake"
            assert await client.detokenize([1, 72]) == "H"
            assert await client.abort(["live-a", "b"]) == ["live-a"]
            with pytest.raises(pie_client.InvalidArgument) as caught:
                await client.generate("invalid")
            assert caught.value.field_violations == [("sampling.top_p", "must be in (0, 1]")]
            with pytest.raises(pie_client.ResourceExhausted):
                async for _ in client.stream("full"):
                    pass
            with pytest.raises(TypeError):
                await client.generate("hi", temprature=1.0)
            with pytest.raises(ValueError, match=r"^max_tokens: must be >= 1"):
                await client.generate("hi", max_tokens=0)
            with pytest.raises(ValueError, match=r"^n: must be >= 1"):
                client.stream("hi", n=0)
            done = await client.chat([{"role": "user", "content": "Hi"}], structured={"regex": "[a-z]+"})
            assert done.text == "Hello!" and servicer.requests[-1].chat.messages[0].content == "Hi"
            assert servicer.requests[-1].sampling.structured.regex == "[a-z]+"
            deltas = [d async for d in client.chat_stream([{"role": "user", "content": "Hi"}], add_generation_prompt=False)]
            assert "".join(d.text for d in deltas) == "Hello!"
            assert servicer.requests[-1].chat.HasField("add_generation_prompt")
            await client.tokenize_chat([{"role": "user", "content": "Hi"}])
            assert servicer.requests[-1].chat.messages[0].role == "user"

    asyncio.run(scenario())


def test_chat_builds_the_conversation(client: pie_client.Client, fake: tuple[FakeGenerateService, str]) -> None:
    servicer = fake[0]
    calls = [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    done = client.chat(
        [{"role": "system", "content": "Be brief."},
         {"role": "user", "content": "Weather?", "name": "ann"},
         {"role": "assistant", "tool_calls": calls, "content": None, "reasoning_content": "Look it up."},
         {"role": "tool", "tool_call_id": "call_1", "content": "21 C"}],
        tools=tools, template_kwargs={"enable_thinking": False}, max_tokens=7, request_id="chat-1")
    assert done.text == "Hello!" and done.request_id == "chat-1"
    sent = servicer.requests[-1]
    assert sent.WhichOneof("prompt_input") == "chat" and sent.sampling.max_tokens == 7
    m = sent.chat.messages
    assert [x.role for x in m] == ["system", "user", "assistant", "tool"]
    assert m[1].name == "ann" and not m[0].HasField("name")
    assert not m[2].HasField("content") and json.loads(m[2].tool_calls_json) == calls  # None: left out
    assert m[2].reasoning_content == "Look it up." and not m[1].HasField("reasoning_content")
    assert m[3].tool_call_id == "call_1"
    assert json.loads(sent.chat.tools_json) == tools
    assert json.loads(sent.chat.template_kwargs_json) == {"enable_thinking": False}
    assert not sent.chat.HasField("add_generation_prompt") and not sent.chat.continue_final_message
    assert "".join(d.text for d in client.chat_stream([{"role": "user", "content": "x"}], continue_final_message=True))
    assert servicer.requests[-1].chat.continue_final_message
    with pytest.raises(TypeError, match=r"messages\[0\]: unknown key\(s\) text"):
        client.chat([{"role": "user", "text": "x"}])
    with pytest.raises(TypeError, match="expected a list of dicts"):
        client.chat("hello")  # type: ignore[arg-type]


@pytest.mark.parametrize(("structured", "kind", "value"), [
    ({"json_schema": {"type": "object"}}, "json_schema", '{"type": "object"}'),
    ({"json_schema": '{"type": "string"}'}, "json_schema", '{"type": "string"}'),
    ({"regex": "[0-9]+"}, "regex", "[0-9]+"),
    ({"choice": ["yes", "no"]}, "choice", ["yes", "no"]),
    ({"grammar": "start: \"a\""}, "grammar", "start: \"a\""),
    ({"json_object": True}, "json_object", True),
    (pb.StructuredOutput(regex="x"), "regex", "x"),
])
def test_structured_on_every_call(client: pie_client.Client, fake: tuple[FakeGenerateService, str],
                                  structured, kind: str, value) -> None:
    servicer = fake[0]
    for call in (lambda: client.generate("Hi", structured=structured),
                 lambda: "".join(d.text for d in client.stream("Hi", structured=structured)),
                 lambda: client.chat([{"role": "user", "content": "Hi"}], structured=structured)):
        call()
        sent = servicer.requests[-1].sampling.structured
        assert sent.WhichOneof("kind") == kind
        got = list(sent.choice.choices) if kind == "choice" else getattr(sent, kind)
        assert got == value


@pytest.mark.parametrize(("structured", "error"), [
    ({"yaml": "x"}, "unknown kind 'yaml'"),
    ({"regex": "a", "choice": ["b"]}, "expected a dict with one of"),
    ({"regex": 3}, "structured.regex: expected a str"),
    ({"choice": ["a", 1]}, "structured.choice: expected a list of str"),
])
def test_structured_that_cannot_be_sent_raises_type_error(client: pie_client.Client, structured, error: str) -> None:
    with pytest.raises(TypeError, match=error):
        client.generate("Hi", structured=structured)


def test_cli_streams_text(fake: tuple[FakeGenerateService, str], capsys: pytest.CaptureFixture[str]) -> None:
    status = cli.main(["--address", fake[1], "generate", "Hi", "--max-tokens", "4", "--stop", "x", "--seed", "1"])
    out, err = capsys.readouterr()
    assert status == 0
    assert out == "Hello!\n"
    assert "finish_reason=length" in err and "completion_tokens=4" in err
    sent = fake[0].requests[-1]
    assert isinstance(sent, pb.GenerateStreamRequest)
    assert (sent.sampling.max_tokens, list(sent.sampling.stop), sent.sampling.seed) == (4, ["x"], 1)


def test_cli_unary_info_tokenize(fake: tuple[FakeGenerateService, str], capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--address", fake[1], "generate", "1 2", "--token-ids", "--no-stream"]) == 0
    out, err = capsys.readouterr()
    assert out == "Hello!\n" and "stop_reason='\\n'" in err
    assert list(fake[0].requests[-1].prompt_token_ids.ids) == [1, 2]

    assert cli.main(["--address", fake[1], "info"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["model_name"] == "fake" and info["load"]["max_waiting"] == 64

    assert cli.main(["--address", fake[1], "tokenize", "a", "--no-special-tokens"]) == 0
    assert json.loads(capsys.readouterr().out) == {"token_ids": [97], "tokens": ["a"], "count": 1}


def test_cli_error_is_one_line(fake: tuple[FakeGenerateService, str], capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--address", fake[1], "generate", "invalid"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("pie-client: INVALID_ARGUMENT")
