"""The HTTP door (`pie serve --http-port`) through the real `openai` Python client, against a live
server on the bundled model: every endpoint streaming and not, structured output parsed by the
client, errors raised as the SDK's own exception classes, the same tokens as the gRPC door for the
same seeded request, and a storm of disconnecting streams leaving no KV block behind."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.error
import urllib.request
from typing import Literal

import openai
import pytest
from pydantic import BaseModel

from pie.engine.config import EngineConfig
from pie.service.server import BackgroundServer, ServerConfig
from pie_client import Client

# slow: starts servers on the bundled model
pytestmark = pytest.mark.slow

PROMPT = "Once upon a time, there was a little girl named Lily."
KEY = "sk-test-key"


@pytest.fixture(scope="module")
def server():
    with BackgroundServer(ServerConfig(port=0, http_port=0, grace_s=2, auth_tokens=(KEY,), tool_call_parser="hermes"),
                          EngineConfig(device="cpu", num_kv_blocks=128, max_num_seqs=32)) as s:
        yield s


@pytest.fixture(scope="module")
def api(server):
    return openai.OpenAI(base_url=f"{server.http_url}/v1", api_key=KEY, max_retries=0, timeout=60)


def _free(server) -> bool:
    bm = server.core.block_manager
    return bm.num_free_blocks == bm.num_total_blocks


def _settle(server, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not _free(server) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _free(server), "KV blocks leaked"


def test_models_names_the_served_model(api):
    models = api.models.list().data
    assert [m.id for m in models] == ["stories-7m"]


def test_completions_whole_and_streamed_agree_and_match_grpc(server, api):
    whole = api.completions.create(model="stories-7m", prompt=PROMPT, max_tokens=24, temperature=0.8, seed=7)
    choice = whole.choices[0]
    assert choice.finish_reason == "length" and whole.usage.completion_tokens == 24
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + 24
    chunks = list(api.completions.create(model="stories-7m", prompt=PROMPT, max_tokens=24, temperature=0.8, seed=7,
                                         stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    with Client(server.address, timeout=60, token=KEY) as grpc_client:  # the other door, same request
        assert grpc_client.generate(PROMPT, max_tokens=24, temperature=0.8, seed=7).text == choice.text


def test_only_streamed_answers_are_marked_streamed(server, api, monkeypatch):
    """The engine learns which requests are read as they come (the stall bound protects those
    decodes alone): gRPC's GenerateStream and HTTP's stream=true are, unary Generate and HTTP's whole
    answers are not."""
    seen: list[bool] = []
    add_request = server.core.add_request

    def recording(*args, streamed: bool = False, **kw):
        seen.append(streamed)
        return add_request(*args, streamed=streamed, **kw)

    monkeypatch.setattr(server.core, "add_request", recording)
    with Client(server.address, timeout=60, token=KEY) as grpc_client:
        grpc_client.generate(PROMPT, max_tokens=2)
        list(grpc_client.stream(PROMPT, max_tokens=2))
    api.completions.create(model="stories-7m", prompt=PROMPT, max_tokens=2)
    list(api.completions.create(model="stories-7m", prompt=PROMPT, max_tokens=2, stream=True))
    messages = [{"role": "user", "content": "Hi."}]
    api.chat.completions.create(model="stories-7m", messages=messages, max_tokens=2)
    list(api.chat.completions.create(model="stories-7m", messages=messages, max_tokens=2, stream=True))
    assert seen == [False, True, False, True, False, True]


def test_chat_whole_and_streamed_agree(api):
    messages = [{"role": "user", "content": "Tell me a story about a cat."}]
    whole = api.chat.completions.create(model="stories-7m", messages=messages, max_completion_tokens=16,
                                        temperature=0)
    msg = whole.choices[0].message
    assert msg.role == "assistant" and msg.content and whole.choices[0].finish_reason == "length"
    chunks = list(api.chat.completions.create(model="stories-7m", messages=messages, max_tokens=16, temperature=0,
                                              stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == msg.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_n_seed_stop_and_logprobs(api):
    kw = dict(model="stories-7m", prompt=PROMPT, max_tokens=12, temperature=1.0, seed=11)
    two = api.completions.create(n=2, **kw)
    assert sorted(c.index for c in two.choices) == [0, 1] and two.usage.completion_tokens == 24
    assert api.completions.create(n=2, **kw).choices[1].text == next(c for c in two.choices if c.index == 1).text
    first = two.choices[0].text.split()[1]
    stopped = api.completions.create(stop=[first], n=1, **kw).choices[0]
    assert stopped.finish_reason == "stop" and first not in stopped.text
    lp = api.completions.create(logprobs=3, **kw).choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 12
    assert all(len(t) <= 3 and v <= 0 for t, v in zip(lp.top_logprobs, lp.token_logprobs))
    chat = api.chat.completions.create(model="stories-7m", messages=[{"role": "user", "content": "Hi"}],
                                       max_tokens=6, temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == 6 and all(len(c.top_logprobs) == 2 for c in content)
    assert "".join(c.token for c in content).strip() == chat.choices[0].message.content.strip()


class Pet(BaseModel):  # finite: a tiny model's greedy text would fill any free-form string to max_tokens
    kind: Literal["cat", "dog", "bird"]
    legs: Literal[2, 4]


def test_structured_output_parsed_by_the_client(api):
    parsed = api.chat.completions.parse(model="stories-7m", messages=[{"role": "user", "content": "A pet as JSON."}],
                                        response_format=Pet, max_tokens=64, temperature=0)
    pet = parsed.choices[0].message.parsed
    assert isinstance(pet, Pet)
    obj = api.chat.completions.create(model="stories-7m", messages=[{"role": "user", "content": "JSON please"}],
                                      response_format={"type": "json_object"}, max_tokens=16, temperature=0)
    assert obj.choices[0].message.content.startswith("{")  # an object from its first token (may run to the length)
    regex = api.completions.create(model="stories-7m", prompt=PROMPT, max_tokens=8, temperature=1.0, seed=3,
                                   extra_body={"guided_regex": "(yes|no)!"})
    assert regex.choices[0].text in ("yes!", "no!")
    choice = api.completions.create(model="stories-7m", prompt=PROMPT, max_tokens=8,
                                    extra_body={"guided_choice": ["cat", "dog"]})
    assert choice.choices[0].text in ("cat", "dog")


def test_errors_are_the_sdks_exception_classes(server, api):
    with pytest.raises(openai.BadRequestError) as bad:
        api.completions.create(model="stories-7m", prompt=PROMPT, temperature=-1)
    assert bad.value.body["param"] == "temperature" and "must be >= 0" in bad.value.body["message"]
    with pytest.raises(openai.BadRequestError) as too_long:
        api.completions.create(model="stories-7m", prompt=[1] * 5000, max_tokens=4)
    assert too_long.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as schema:
        api.chat.completions.create(model="stories-7m", messages=[{"role": "user", "content": "x"}],
                                    extra_body={"guided_regex": "(unclosed"})
    assert schema.value.body["param"] == "guided_regex"  # named as sent (not response_format)
    # a chat's length limit is named as the request sent it (the contract's max_tokens is both)
    for name in ("max_tokens", "max_completion_tokens"):
        with pytest.raises(openai.BadRequestError) as zero:
            api.chat.completions.create(model="stories-7m", messages=[{"role": "user", "content": "x"}], **{name: 0})
        assert zero.value.body["param"] == name and zero.value.body["message"].startswith(f"{name}: must be >= 1")
        with pytest.raises(openai.BadRequestError) as long:
            api.chat.completions.create(model="stories-7m", messages=[{"role": "user", "content": "x"}],
                                        **{name: 10**6})
        assert long.value.body["param"] == name, long.value.body
    with pytest.raises(openai.BadRequestError) as forms:  # a union field named once (not `prompt.str`)
        api.completions.create(model="stories-7m", prompt=[1.5, 2])  # type: ignore[arg-type]
    assert forms.value.body["param"] == "prompt" and "matches none of its forms" in forms.value.body["message"]
    for raw, said in ((b"{not json", "the body is not valid JSON"), (b"", "the body must be a JSON object")):
        sent = urllib.request.Request(f"{server.http_url}/v1/completions", data=raw, method="POST",
                                      headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
        with pytest.raises(urllib.error.HTTPError) as not_read:
            urllib.request.urlopen(sent, timeout=30)
        error = json.loads(not_read.value.read())["error"]
        assert not_read.value.code == 400 and error["param"] is None and error["message"].startswith(said), error
    with pytest.raises(openai.NotFoundError):
        api.completions.create(model="gpt-4", prompt=PROMPT)
    stranger = openai.OpenAI(base_url=f"{server.http_url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        stranger.models.list()
    with urllib.request.urlopen(f"{server.http_url}/health") as health:  # open without a key, as gRPC health is
        assert health.status == 200
    with urllib.request.urlopen(f"{server.http_url}/metrics") as metrics:
        assert "vllm:num_requests_running" in metrics.read().decode()
    with urllib.request.urlopen(f"{server.http_url}/openapi.json") as schema:  # what /docs draws
        assert {"/v1/completions", "/v1/chat/completions", "/v1/models"} <= set(json.load(schema)["paths"])


def test_a_full_queue_is_429_with_retry_after():
    """The engine held (its steps wait on a gate): requests pile up in its queue until the bound
    refuses one, as the gRPC door's QUEUE_FULL does."""
    cfg = EngineConfig(device="cpu", num_kv_blocks=64, max_num_seqs=1, max_waiting=2)
    with BackgroundServer(ServerConfig(port=0, http_port=0, grace_s=2), cfg) as s:
        api = openai.OpenAI(base_url=f"{s.http_url}/v1", api_key="none", max_retries=0, timeout=60)
        gate = threading.Event()
        original = s.core.step
        s.core.step = lambda: (gate.wait(30), original())[1]
        streams = []
        try:
            with pytest.raises(openai.RateLimitError) as full:
                for _ in range(16):
                    streams.append(api.completions.create(model="stories-7m", prompt=PROMPT, max_tokens=2, stream=True))
            assert full.value.response.headers["retry-after"] == "1" and len(streams) >= 2
            assert full.value.body["code"] == "rate_limit_exceeded"
        finally:
            gate.set()
            s.core.step = original
        for stream in streams:
            assert "".join(c.choices[0].text for c in stream if c.choices)  # the queued ones are served
        _settle(s)


def test_a_disconnect_storm_leaves_no_block_behind(server):
    async def storm() -> None:
        async with openai.AsyncOpenAI(base_url=f"{server.http_url}/v1", api_key=KEY, max_retries=0) as api:
            async def one(i: int) -> None:
                stream = await api.chat.completions.create(
                    model="stories-7m", messages=[{"role": "user", "content": f"Story {i}"}], max_tokens=200,
                    temperature=1.0, seed=i, stream=True, extra_body={"ignore_eos": True})
                async for _ in stream:
                    if i % 3 == 0:
                        break  # the caller goes away mid-stream
                await stream.close()

            async def impatient(i: int) -> None:  # a whole answer whose caller gives up
                with pytest.raises(openai.APITimeoutError):
                    await api.with_options(timeout=0.3).completions.create(
                        model="stories-7m", prompt=PROMPT, max_tokens=300, extra_body={"ignore_eos": True})

            await asyncio.gather(*[one(i) for i in range(24)], *[impatient(i) for i in range(4)])

    asyncio.run(storm())
    _settle(server)


def test_503_while_loading_and_while_draining():
    """The door opens before the model is loaded and stays open while the server drains: both
    times it answers 503 (openai's InternalServerError), and /health says so to balancers."""
    s = BackgroundServer(ServerConfig(port=0, http_port=0, grace_s=2), EngineConfig(device="cpu", num_kv_blocks=64))
    s._thread.start()
    try:
        s._call(s.pie.start(), 60)  # bound and serving, the engine not loaded yet
        url = f"http://127.0.0.1:{s.pie.http.port}"
        api = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=30)
        with pytest.raises(openai.InternalServerError) as loading:
            api.completions.create(model="stories-7m", prompt=PROMPT, max_tokens=2)
        # the gRPC door's MODEL_LOADING, and its RetryInfo (5 s)
        assert loading.value.status_code == 503 and loading.value.response.headers["retry-after"] == "5"
        assert loading.value.body["code"] == "model_loading"
        with pytest.raises(urllib.error.HTTPError) as health:
            urllib.request.urlopen(f"{url}/health")
        assert health.value.code == 503
        s._call(s.pie.load(), 600)
        assert api.completions.create(model="stories-7m", prompt=PROMPT, max_tokens=2).choices[0].text
        s.pie.admission.draining = True  # what stop() sets first
        with pytest.raises(openai.InternalServerError):
            api.completions.create(model="stories-7m", prompt=PROMPT, max_tokens=2)
    finally:
        s.stop()


def test_a_list_of_prompts_with_echo(api):
    """Prompt i's samples are choices i x n .. i x n + n - 1; echo puts each prompt before its text."""
    out = api.completions.create(model="stories-7m", prompt=["Once upon a time", "One day"], n=2, max_tokens=4,
                                 temperature=0, echo=True)
    texts = {c.index: c.text for c in out.choices}
    assert sorted(texts) == [0, 1, 2, 3] and out.usage.completion_tokens == 16
    assert texts[0] == texts[1] and texts[0].startswith("Once upon a time") and len(texts[0]) > len("Once upon a time")
    assert texts[2].startswith("One day")
    alone = api.completions.create(model="stories-7m", prompt="One day", max_tokens=4, temperature=0)
    assert texts[2] == "One day" + alone.choices[0].text
    streamed: dict[int, str] = {}
    for chunk in api.completions.create(model="stories-7m", prompt=["Once upon a time", "One day"], max_tokens=4,
                                        temperature=0, echo=True, stream=True):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert streamed == {0: texts[0], 1: texts[2]}


def test_openai_defaults_for_length_and_logprobs_zero(api):
    """A chat without max_tokens may run until the context is full (a completion's default stays
    16, as OpenAI's); logprobs: 0 still reports each token's own logprob."""
    models = api.models.list().data
    chat = api.chat.completions.create(model="stories-7m", messages=[{"role": "user", "content": "Hi"}],
                                       temperature=0, extra_body={"ignore_eos": True})
    assert chat.choices[0].finish_reason == "length"
    assert chat.usage.prompt_tokens + chat.usage.completion_tokens == models[0].model_extra["max_model_len"]
    assert api.completions.create(model="stories-7m", prompt=PROMPT, temperature=0,
                                  extra_body={"ignore_eos": True}).usage.completion_tokens == 16
    lp = api.completions.create(model="stories-7m", prompt=PROMPT, max_tokens=5, logprobs=0).choices[0].logprobs
    assert len(lp.token_logprobs) == 5 and all(v <= 0 for v in lp.token_logprobs) and lp.top_logprobs == [{}] * 5


PICK = {"type": "function", "function": {"name": "pick", "description": "Pick a colour", "parameters": {
    "type": "object", "properties": {"colour": {"enum": ["red", "blue"]}, "shade": {"type": "integer", "minimum": 0,
                                                                                    "maximum": 9}},
    "required": ["colour", "shade"], "additionalProperties": False}}}
SIZE = {"type": "function", "function": {"name": "size", "parameters": {
    "type": "object", "properties": {"big": {"type": "boolean"}}, "required": ["big"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "Pick a colour."}]


def _streamed_calls(api, **kw) -> tuple[dict[int, dict], str | None]:
    """The tool calls of a streamed chat, put together from their deltas as a client does."""
    calls: dict[int, dict] = {}
    finish = None
    for chunk in api.chat.completions.create(model="stories-7m", messages=ASK, stream=True, **kw):
        choice = chunk.choices[0]
        assert not choice.delta.content  # a forced call streams no text
        for d in choice.delta.tool_calls or []:
            call = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
            call["id"] = d.id or call["id"]
            if d.function is not None:
                call["name"] = d.function.name or call["name"]
                call["arguments"] += d.function.arguments or ""
        finish = choice.finish_reason or finish
    return calls, finish


def test_a_named_tool_choice_calls_it(api):
    """A function named by tool_choice: the output is its arguments, held to its parameters'
    schema, and the answer is a tool call with finish_reason "stop" (as OpenAI's); streamed, the
    call opens the choice and its arguments follow as deltas, to the same text."""
    choice = {"type": "function", "function": {"name": "pick"}}
    whole = api.chat.completions.create(model="stories-7m", messages=ASK, tools=[PICK, SIZE], tool_choice=choice,
                                        max_tokens=32, temperature=0).choices[0]
    assert whole.finish_reason == "stop" and whole.message.content is None
    [call] = whole.message.tool_calls
    assert call.type == "function" and call.function.name == "pick" and call.id.startswith("call_")
    arguments = json.loads(call.function.arguments)
    assert arguments["colour"] in ("red", "blue") and 0 <= arguments["shade"] <= 9
    calls, finish = _streamed_calls(api, tools=[PICK, SIZE], tool_choice=choice, max_tokens=32, temperature=0)
    assert finish == "stop" and list(calls) == [0]
    assert calls[0]["name"] == "pick" and calls[0]["arguments"] == call.function.arguments


def test_tool_choice_required_calls_one_of_the_tools(api):
    """"required": calls of any of the tools (one with parallel_tool_calls false), finish_reason
    "tool_calls"; the client's pydantic helper parses the arguments; streamed, the calls come
    whole at the end. Cut by max_tokens, the unfinished JSON stays the content."""
    for seed in range(3):
        whole = api.chat.completions.create(model="stories-7m", messages=ASK, tools=[PICK, SIZE], tool_choice="required",
                                            parallel_tool_calls=False, max_tokens=64, seed=seed).choices[0]
        assert whole.finish_reason == "tool_calls" and whole.message.content is None
        [call] = whole.message.tool_calls
        arguments = json.loads(call.function.arguments)
        assert (call.function.name, set(arguments)) in (("pick", {"colour", "shade"}), ("size", {"big"}))
    calls, finish = _streamed_calls(api, tools=[PICK, SIZE], tool_choice="required", parallel_tool_calls=False,
                                    max_tokens=64, temperature=0)
    assert finish == "tool_calls" and list(calls) == [0] and calls[0]["id"] and calls[0]["name"] in ("pick", "size")
    cut = api.chat.completions.create(model="stories-7m", messages=ASK, tools=[PICK, SIZE], tool_choice="required",
                                      max_tokens=3, temperature=0).choices[0]
    assert cut.finish_reason == "length" and cut.message.tool_calls is None and cut.message.content.startswith("[{")

    class Pick(BaseModel):
        colour: Literal["red", "blue"]
        dark: bool

    parsed = api.chat.completions.parse(model="stories-7m", messages=ASK, tools=[openai.pydantic_function_tool(Pick)],
                                        tool_choice={"type": "function", "function": {"name": "Pick"}},
                                        max_tokens=64, temperature=0).choices[0]
    assert isinstance(parsed.message.tool_calls[0].function.parsed_arguments, Pick)


def test_tool_choice_errors_name_the_field(api):
    def refused(**kw) -> str:
        with pytest.raises(openai.BadRequestError) as e:
            api.chat.completions.create(model="stories-7m", messages=ASK, max_tokens=4, **kw)
        return e.value.body["param"]

    assert refused(tools=[PICK], tool_choice={"type": "function", "function": {"name": "paint"}}) \
        == "tool_choice.function.name"
    assert refused(tool_choice="required") == "tool_choice"  # no tools to call
    assert refused(tools=[PICK], tool_choice="always") == "tool_choice"
    assert refused(tools=[PICK], tool_choice="required", response_format={"type": "json_object"}) == "tool_choice"
    assert refused(tools=[{"type": "function", "function": {"parameters": {}}}]) == "tools[0].function.name"
    assert refused(tools=[PICK, PICK], tool_choice="required") == "tools[1].function.name"
    unique = {"type": "function", "function": {"name": "f", "parameters": {"type": "array", "uniqueItems": True}}}
    assert refused(tools=[unique], tool_choice="required") == "tools"  # a schema the matcher cannot hold to


def test_auto_tool_calls_are_read_out_of_the_text(api):
    """tool_choice "auto" with --tool-call-parser hermes: a <tool_call> block in the model's text
    (here held to one by guided_regex: the bundled model knows no tools) comes back as tool_calls,
    the text around it as content, whole and streamed alike; without tools the text stays text."""
    block = r'<tool_call>\n\{"name": "pick", "arguments": \{"colour": "(red|blue)", "shade": [0-9]\}\}\n</tool_call>'
    kw = dict(model="stories-7m", messages=ASK, max_tokens=64, temperature=0, extra_body={"guided_regex": "Ok\\. " + block})
    whole = api.chat.completions.create(tools=[PICK, SIZE], **kw).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content == "Ok."
    [call] = whole.message.tool_calls
    assert call.function.name == "pick" and json.loads(call.function.arguments)["colour"] in ("red", "blue")
    content, calls, finish = "", [], None
    for chunk in api.chat.completions.create(tools=[PICK, SIZE], stream=True, **kw):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        calls += delta.tool_calls or []
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and content.strip() == "Ok."
    assert [(c.index, c.function.name, c.function.arguments) for c in calls] == [(0, "pick", call.function.arguments)]
    plain = api.chat.completions.create(**kw).choices[0]  # no tools: nothing is read as a call
    assert plain.message.tool_calls is None and plain.message.content.startswith("Ok. <tool_call>")


def test_echo_with_logprobs_scores_the_prompt(server, api):
    """An evaluation harness's loglikelihood call: echo, logprobs and max_tokens 0 give each prompt
    token's logprob (the first none), as the gRPC door's prompt_logprobs, and nothing generated;
    with max_tokens > 0 the generated tokens' follow. Streamed, it is refused with the field named."""
    scored = api.completions.create(model="stories-7m", prompt=PROMPT, max_tokens=0, echo=True, logprobs=2)
    choice = scored.choices[0]
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert scored.usage.completion_tokens == 0 and scored.usage.total_tokens == scored.usage.prompt_tokens
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == scored.usage.prompt_tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and lp.text_offset[0] == 0
    assert all(len(top) == 2 for top in lp.top_logprobs[1:]) and lp.text_offset == sorted(lp.text_offset)
    with Client(server.address, timeout=60, token=KEY) as grpc_client:
        reference = grpc_client.generate(PROMPT, max_tokens=1, prompt_logprobs=2).prompt_logprobs
    assert lp.token_logprobs == [p.logprob for p in reference]
    assert lp.tokens == [p.token for p in reference]
    more = api.completions.create(model="stories-7m", prompt=PROMPT, max_tokens=3, echo=True, logprobs=1,
                                  temperature=0).choices[0]
    assert more.logprobs.token_logprobs[:len(reference)] == lp.token_logprobs and len(more.logprobs.tokens) == len(
        reference) + 3
    assert more.text.startswith(PROMPT) and more.logprobs.text_offset[len(reference)] == len(PROMPT)
    for kw in (dict(max_tokens=0), dict(max_tokens=0, echo=True, stream=True), dict(echo=True, logprobs=1, stream=True)):
        with pytest.raises(openai.BadRequestError) as e:
            api.completions.create(model="stories-7m", prompt=PROMPT, **kw)
        assert e.value.body["param"] in ("max_tokens", "stream")
