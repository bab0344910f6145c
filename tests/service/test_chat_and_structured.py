"""Chat and structured output end to end: real servers on loopback ports (the engine on a thread,
and once in its own process), called through the bundled client.

A chat is rendered with the model's template exactly as transformers renders it (Tokenize returns
the ids apply_chat_template gives); generation ends at the model's end-of-turn ids; seeded samples
at temperature 1 validate against their JSON schema, fullmatch their regex or equal a choice; bad
inputs get INVALID_ARGUMENT naming the field and the compiler's or template's message, a model
without a template FAILED_PRECONDITION; --chat-template replaces the model's template."""

from __future__ import annotations

import json
import re
from pathlib import Path

import grpc
import jsonschema
import pytest

from pie.engine.config import EngineConfig
from pie.engine.errors import StartupError
from pie.service.server import BackgroundServer, ServerConfig
from pie.service.startup import check_startup
from pie_client import Client, FailedPrecondition, InvalidArgument
from tests.chat_templates import CONVERSATIONS, STYLES, WEATHER_TOOL, make_chat_model_dir
from tests.helpers import make_hf_model_dir

pytestmark = pytest.mark.slow

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 10}, "temperature": {"type": "integer", "minimum": -50,
                                                                                 "maximum": 60},
                   "sky": {"enum": ["clear", "cloudy", "rain"]}},
    "required": ["city", "temperature", "sky"],
    "additionalProperties": False,
}
MONTH = r"(January|February|March|April|May|June|July|August|September|October|November|December) [1-9][0-9]?"


def _config(model_dir: Path, **kw) -> EngineConfig:
    return EngineConfig(**{**dict(model=str(model_dir), device="cpu", kv_cache_dtype="fp32", num_kv_blocks=256,
                                  max_num_seqs=16, max_num_batched_tokens=512), **kw})


@pytest.fixture(scope="module")
def chatml_dir(tmp_path_factory):
    return make_chat_model_dir(tmp_path_factory.mktemp("chatml"), "chatml")


@pytest.fixture(scope="module")
def server(chatml_dir):
    with BackgroundServer(ServerConfig(port=0, grace_s=2), _config(chatml_dir)) as s:
        yield s


@pytest.fixture()
def client(server):
    with Client(server.address, timeout=120) as c:
        yield c


def test_tokenize_chat_equals_transformers(client, chatml_dir):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(chatml_dir))
    for name, messages in CONVERSATIONS.items():
        for tools in (None, [WEATHER_TOOL]):
            got = client.tokenize_chat(messages, tools=tools)
            want = hf.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True)
            assert got.token_ids == list(want["input_ids"]), name
            assert got.rendered_text == hf.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                                               tokenize=False)
    plain = client.tokenize_chat(CONVERSATIONS["one turn"], add_generation_prompt=False)
    assert not plain.rendered_text.endswith("<|im_start|>assistant\n")


def test_a_chat_generates_from_the_rendered_prompt(client):
    messages = CONVERSATIONS["system and turns"]
    ids = client.tokenize_chat(messages).token_ids
    chat = client.chat(messages, max_tokens=12, temperature=0.0, ignore_eos=True)
    same = client.generate(ids, max_tokens=12, temperature=0.0, ignore_eos=True)
    assert chat.prompt_tokens == len(ids) and chat.token_ids == same.token_ids and chat.text == same.text
    streamed = list(client.chat_stream(messages, max_tokens=12, temperature=0.0, ignore_eos=True))
    assert [t for d in streamed for t in d.token_ids] == chat.token_ids


def test_generation_ends_at_the_end_of_turn_ids(client):
    """Where the constraint ("a" or "ab") may end, every end-of-turn id of generation_config.json is
    allowed: samples that take one end there (STOP, not in the text, and no stop reason: an
    end-of-sequence id is none, generate.proto)."""
    style = STYLES["chatml"]
    info = client.model_info()
    assert sorted(info.eos_token_ids) == sorted(style.end_of_turn_ids)
    choices = [c for seed in (5, 6) for c in client.chat(CONVERSATIONS["one turn"], max_tokens=8, temperature=1.0,
                                                         n=16, seed=seed, structured={"regex": "a|ab"}).choices]
    ended_by_eos = [c for c in choices if c.token_ids[-1] in style.end_of_turn_ids]
    # After "a" the mask allows "b" and the two end-of-turn ids: some of 32 samples take one.
    assert ended_by_eos, "no sample took an end-of-turn id (32 samples at temperature 1)"
    for c in choices:
        assert c.finish_reason == "stop" and c.text in ("a", "ab")
    for c in ended_by_eos:
        assert c.text == "a" and c.stop_reason == ""


def test_seeded_samples_validate_against_their_schema(client, rng):
    seed = rng.randrange(2**31)
    done = client.chat([{"role": "user", "content": "The weather in Paris, as JSON."}], max_tokens=400,
                       temperature=1.0, n=8, seed=seed, structured={"json_schema": SCHEMA})
    assert len(done.choices) == 8
    for c in done.choices:
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), SCHEMA)
    # The stream gives the same samples, token for token.
    streamed: dict[int, list[int]] = {}
    for d in client.chat_stream([{"role": "user", "content": "The weather in Paris, as JSON."}], max_tokens=400,
                                temperature=1.0, n=8, seed=seed, structured={"json_schema": SCHEMA}):
        streamed.setdefault(d.index, []).extend(d.token_ids)
    assert streamed == {c.index: c.token_ids for c in done.choices}


def test_regex_and_choice_through_the_server(client, rng):
    dates = client.generate("Today is", max_tokens=40, temperature=1.0, n=8, seed=rng.randrange(2**31),
                            structured={"regex": MONTH})
    for c in dates.choices:
        assert c.finish_reason == "stop" and re.fullmatch(MONTH, c.text), c.text
    options = ["yes", "no", "maybe later"]
    picked = client.chat(CONVERSATIONS["one turn"], max_tokens=20, temperature=1.0, n=8, seed=rng.randrange(2**31),
                         structured={"choice": options})
    assert all(c.text in options and c.finish_reason == "stop" for c in picked.choices)
    cut = client.generate("Today is", max_tokens=1, temperature=1.0, structured={"regex": MONTH})
    assert cut.finish_reason == "length" and not re.fullmatch(MONTH, cut.text)


@pytest.mark.parametrize(("structured", "field", "message"), [
    ({"json_schema": '{"type": "object", "properties": {"a": {"type": "nope"}}}'}, "sampling.structured.json_schema",
     "nope"),
    ({"json_schema": "{not json"}, "sampling.structured.json_schema", "is not JSON"),
    ({"regex": "(unclosed"}, "sampling.structured.regex", "unclosed group"),
    ({"grammar": "start: undefined_rule"}, "sampling.structured.grammar", "undefined_rule"),
    ({"choice": []}, "sampling.structured.choice", "choices"),
])
def test_constraints_that_do_not_compile_name_the_field(client, structured, field, message):
    for call in (lambda: client.generate("x", structured=structured),
                 lambda: list(client.chat_stream([{"role": "user", "content": "x"}], structured=structured))):
        with pytest.raises(InvalidArgument) as err:
            call()
        assert err.value.reason == "INVALID_FIELD"
        assert [f for f, _ in err.value.field_violations] == [field]
        assert message in err.value.field_violations[0][1]


@pytest.mark.parametrize(("messages", "kw", "field", "message"), [
    ([], {}, "chat.messages", "at least one message"),
    ([{"role": "", "content": "x"}], {}, "chat.messages[0].role", "must not be empty"),
    ([{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": "{oops"}], {},
     "chat.messages[1].tool_calls_json", "is not JSON"),
    ([{"role": "user", "content": "x"}], {"tools": "{}"}, "chat.tools_json", "must be a JSON array"),
    ([{"role": "user", "content": "x"}], {"template_kwargs": {"messages": 1}}, "chat.template_kwargs_json",
     "may not set messages"),
    ([{"role": "user", "content": "x"}], {"continue_final_message": True, "add_generation_prompt": True},
     "chat.add_generation_prompt", "cannot be true with continue_final_message"),
    ([{"role": "user", "content": "x"}, {"role": "assistant", "content": "{{ raise_exception('no') }}"}], {},
     None, None),  # content is data, never template code: renders
])
def test_bad_chats_name_the_field(client, messages, kw, field, message):
    if field is None:
        assert "raise_exception" in client.tokenize_chat(messages, **kw).rendered_text
        return
    with pytest.raises(InvalidArgument) as err:
        client.chat(messages, max_tokens=2, **kw)
    assert [f for f, _ in err.value.field_violations] == [field], err.value
    assert message in err.value.field_violations[0][1]
    with pytest.raises(InvalidArgument):
        client.tokenize_chat(messages, **kw)


def test_tokenize_takes_text_or_chat_not_both(server):
    from pie.v1 import generate_pb2 as pb
    from pie.v1 import generate_pb2_grpc as pb_grpc

    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.GenerateServiceStub(channel)
        chat = pb.ChatInput(messages=[pb.ChatMessage(role="user", content="x")])
        with pytest.raises(grpc.RpcError) as err:
            stub.Tokenize(pb.TokenizeRequest(text="x", chat=chat))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "text or chat" in err.value.details()


@pytest.fixture(scope="module")
def mistral_server(tmp_path_factory):
    model_dir = make_chat_model_dir(tmp_path_factory.mktemp("mistral"), "mistral")
    with BackgroundServer(ServerConfig(port=0, grace_s=2), _config(model_dir, num_kv_blocks=64)) as s:
        yield s


def test_a_template_that_refuses_the_conversation(mistral_server):
    with Client(mistral_server.address, timeout=60) as client:
        with pytest.raises(InvalidArgument) as err:
            client.chat(CONVERSATIONS["system and turns"], max_tokens=2)
        assert [f for f, _ in err.value.field_violations] == ["chat.messages"]
        assert "Conversation roles must alternate user/assistant/user/assistant/..." in err.value.details
        # Mistral's template writes <s> itself: the prompt starts with exactly one BOS.
        ids = client.tokenize_chat([{"role": "user", "content": "Hi"}]).token_ids
        assert ids[0] == STYLES["mistral"].token_id("<s>") and ids.count(ids[0]) == 1


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    return make_hf_model_dir(tmp_path_factory.mktemp("base"), "llama")


def test_no_template_is_a_failed_precondition_and_chat_template_replaces_it(base_dir, tmp_path):
    with BackgroundServer(ServerConfig(port=0, grace_s=2), _config(base_dir, num_kv_blocks=64)) as s, \
            Client(s.address, timeout=60) as client:
        for call in (lambda: client.chat([{"role": "user", "content": "x"}]),
                     lambda: client.tokenize_chat([{"role": "user", "content": "x"}])):
            with pytest.raises(FailedPrecondition) as err:
                call()
            assert err.value.reason == "NO_CHAT_TEMPLATE" and "no chat template" in err.value.details
        assert client.generate("free text still works", max_tokens=2).completion_tokens == 2
    template = tmp_path / "chat.jinja"
    template.write_text("{{ bos_token }}{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}")
    with BackgroundServer(ServerConfig(port=0, grace_s=2, chat_template=str(template)),
                          _config(base_dir, num_kv_blocks=64)) as s, Client(s.address, timeout=60) as client:
        got = client.tokenize_chat([{"role": "user", "content": "hello"}])
        assert got.rendered_text == "<s>[user] hello\n"
        assert got.token_ids == s.core.tokenizer.encode("<s>[user] hello\n", add_special_tokens=False)
        assert client.chat([{"role": "user", "content": "hello"}], max_tokens=3).prompt_tokens == len(got.token_ids)


def test_chat_template_flag_is_checked_at_start(base_dir, tmp_path):
    cfg = _config(base_dir)
    with pytest.raises(StartupError, match="--chat-template .*missing.jinja: no such file"):
        check_startup(cfg, host="127.0.0.1", ports={}, chat_template=str(tmp_path / "missing.jinja"))
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}{{ m")
    with pytest.raises(StartupError, match="--chat-template .*broken.jinja: does not compile"):
        check_startup(cfg, host="127.0.0.1", ports={}, chat_template=str(broken))


def test_with_the_engine_in_its_own_process(chatml_dir, rng):
    """The parent compiles constraints with its own compiler (refusals come from there); the
    engine process compiles them again and masks its samples."""
    with BackgroundServer(ServerConfig(port=0, grace_s=2, engine_process=True), _config(chatml_dir)) as s, \
            Client(s.address, timeout=120) as client:
        with pytest.raises(InvalidArgument) as err:
            client.generate("x", structured={"regex": "(unclosed"})
        assert [f for f, _ in err.value.field_violations] == ["sampling.structured.regex"]
        done = client.chat([{"role": "user", "content": "Weather?"}], max_tokens=400, temperature=1.0, n=4,
                           seed=rng.randrange(2**31), structured={"json_schema": SCHEMA})
        for c in done.choices:
            assert c.finish_reason == "stop"
            jsonschema.validate(json.loads(c.text), SCHEMA)
