"""service/validation.py for chats and structured output, without a server: what a ChatInput and a
StructuredOutput become, and every refusal named by its field."""

from __future__ import annotations

import json

import pytest

from pie.engine.errors import RequestError
from pie.engine.sampling_params import StructuredOutputParams
from pie.service.validation import (
    ChatPrompt,
    Limits,
    chat_from_proto,
    prompt_from_proto,
    qualify,
    sampling_from_proto,
    structured_from_proto,
)
from pie.v1 import generate_pb2 as pb


def test_a_chat_becomes_the_messages_a_template_reads():
    calls = [{"type": "function", "function": {"name": "f", "arguments": {"x": 1}}}]
    chat = pb.ChatInput(messages=[
        pb.ChatMessage(role="system", content="Be brief."),
        pb.ChatMessage(role="user", content="", name="ann"),  # an empty content is still content
        pb.ChatMessage(role="assistant", tool_calls_json=json.dumps(calls), reasoning_content="Ask f."),
        pb.ChatMessage(role="tool", content="42", tool_call_id="c1"),
    ], tools_json='[{"type": "function"}]', template_kwargs_json='{"enable_thinking": false}')
    prompt = chat_from_proto(chat, Limits())
    assert prompt.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "", "name": "ann"},
        {"role": "assistant", "reasoning_content": "Ask f.", "tool_calls": calls},
        {"role": "tool", "content": "42", "tool_call_id": "c1"},
    ]
    assert prompt.tools == [{"type": "function"}] and prompt.extra == {"enable_thinking": False}
    assert prompt.add_generation_prompt and not prompt.continue_final_message
    assert prompt.chars == len("Be brief.") + len("ann") + len("Ask f.") + len(json.dumps(calls)) + len("42") + len("c1") + \
        len(chat.tools_json) + len(chat.template_kwargs_json)
    request = pb.GenerateRequest(chat=chat)
    assert isinstance(prompt_from_proto(request, Limits()), ChatPrompt)


@pytest.mark.parametrize(("set_prompt", "continue_final", "want"), [
    (None, False, True), (None, True, False), (False, False, False), (True, False, True), (False, True, False)])
def test_add_generation_prompt_defaults(set_prompt, continue_final, want):
    chat = pb.ChatInput(messages=[pb.ChatMessage(role="user", content="x")], continue_final_message=continue_final)
    if set_prompt is not None:
        chat.add_generation_prompt = set_prompt
    assert chat_from_proto(chat, Limits()).add_generation_prompt is want


@pytest.mark.parametrize(("chat", "field"), [
    (pb.ChatInput(), "chat.messages"),
    (pb.ChatInput(messages=[pb.ChatMessage(content="x")]), "chat.messages[0].role"),
    (pb.ChatInput(messages=[pb.ChatMessage(role="r" * 65, content="x")]), "chat.messages[0].role"),
    (pb.ChatInput(messages=[pb.ChatMessage(role="user", tool_calls_json="{}")]), "chat.messages[0].tool_calls_json"),
    (pb.ChatInput(messages=[pb.ChatMessage(role="user")], tools_json="[1"), "chat.tools_json"),
    (pb.ChatInput(messages=[pb.ChatMessage(role="user")], template_kwargs_json="[]"), "chat.template_kwargs_json"),
    (pb.ChatInput(messages=[pb.ChatMessage(role="user")], template_kwargs_json='{"tools": []}'),
     "chat.template_kwargs_json"),
    (pb.ChatInput(messages=[pb.ChatMessage(role="user")], continue_final_message=True, add_generation_prompt=True),
     "chat.add_generation_prompt"),
    (pb.ChatInput(messages=[pb.ChatMessage(role="user", content="x" * 101)]), "chat"),
])
def test_bad_chats_are_named_by_their_field(chat, field):
    with pytest.raises(RequestError) as err:
        chat_from_proto(chat, Limits(max_prompt_chars=100))
    assert err.value.field == field


def test_structured_outputs_from_the_contract():
    assert structured_from_proto(pb.StructuredOutput(json_schema="{}")) == StructuredOutputParams("json_schema", "{}")
    assert structured_from_proto(pb.StructuredOutput(choice=pb.ChoiceList(choices=["a", "b"]))) == \
        StructuredOutputParams("choice", choices=("a", "b"))
    assert structured_from_proto(pb.StructuredOutput(json_object=True)) == StructuredOutputParams("json_object")
    assert structured_from_proto(pb.StructuredOutput(json_object=False)) is None  # the same as unset
    with pytest.raises(RequestError) as err:
        structured_from_proto(pb.StructuredOutput())
    assert err.value.field == "sampling.structured"
    sampling = sampling_from_proto(pb.SamplingParams(structured=pb.StructuredOutput(regex="[a-z]+")), max_model_len=64)
    assert sampling.structured == StructuredOutputParams("regex", "[a-z]+")
    assert sampling_from_proto(pb.SamplingParams(), max_model_len=64).structured is None
    with pytest.raises(RequestError) as err:
        sampling_from_proto(pb.SamplingParams(structured=pb.StructuredOutput(regex="")), max_model_len=64)
    assert qualify(err.value.field) == "sampling.structured.regex"
