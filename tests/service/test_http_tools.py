"""service/http/tools.py: tool_choice's forced calls, without a server: the schema the output is
held to, the calls read back from it, the stream's deltas, and the errors that name the field."""

from __future__ import annotations

import json

import pytest

from pie.service.http.tools import forced_call
from pie.service.validation import FieldError

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "now"}}]  # no parameters: any object


def test_none_and_auto_force_nothing_but_check_the_tools() -> None:
    for choice in (None, "none", "auto"):
        assert forced_call(TOOLS, choice) is None
    assert forced_call(None, None) is None
    with pytest.raises(FieldError) as e:
        forced_call([{"type": "function", "function": {"name": ""}}], "auto")
    assert e.value.field == "tools[0].function.name"


def test_a_named_function_is_held_to_its_parameters() -> None:
    forced, schema = forced_call(TOOLS, {"type": "function", "function": {"name": "weather"}})
    assert schema == WEATHER
    [call] = forced.calls('{"city": "Oslo"}')
    assert call["type"] == "function" and call["function"] == {"name": "weather", "arguments": '{"city": "Oslo"}'}
    assert forced.finish_reason("stop", [call]) == "stop"  # a forced function ends as OpenAI's does
    assert forced_call(TOOLS, {"type": "function", "function": {"name": "now"}})[1] == {"type": "object"}


def test_required_is_an_array_of_calls_of_any_tool() -> None:
    forced, schema = forced_call(TOOLS, "required")
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    names = [item["properties"]["name"] for item in schema["items"]["anyOf"]]
    assert names == [{"const": "weather"}, {"const": "now"}]
    assert schema["items"]["anyOf"][0]["properties"]["parameters"] == WEATHER
    assert forced_call(TOOLS, "required", parallel=False)[1]["maxItems"] == 1
    one = forced_call(TOOLS[:1], "required")[1]
    assert one["items"]["properties"]["name"] == {"const": "weather"}  # one tool: no anyOf
    calls = forced.calls('[{"name": "weather", "parameters": {"city": "Oslo"}}, {"name": "now", "parameters": {}}]')
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("weather", {"city": "Oslo"}), ("now", {})]
    assert len({c["id"] for c in calls}) == 2
    assert forced.finish_reason("stop", calls) == "tool_calls"
    assert forced.calls('[{"name": "weather", "param') is None  # cut by max_tokens: no calls
    assert forced.finish_reason("length", None) == "length"


def test_stream_deltas() -> None:
    named, _ = forced_call(TOOLS, {"type": "function", "function": {"name": "weather"}})
    opening = named.opening()
    assert opening["role"] == "assistant" and opening["content"] is None
    [head] = opening["tool_calls"]
    assert head["index"] == 0 and head["function"] == {"name": "weather", "arguments": ""} and head["id"]
    assert named.delta({}, 0, '{"ci', False) == ({"tool_calls": [{"index": 0, "function": {"arguments": '{"ci'}}]},
                                                 True)
    required, _ = forced_call(TOOLS, "required")
    assert "tool_calls" not in required.opening()
    held: dict[int, str] = {}
    assert required.delta(held, 1, '[{"name": "now", ', False) == ({}, False)  # held until the choice ends
    delta, calls = required.delta(held, 1, '"parameters": {}}]', True)
    assert calls and [(c["index"], c["function"]["name"]) for c in delta["tool_calls"]] == [(0, "now")]
    assert held == {}
    assert required.delta(held, 0, '[{"na', True) == ({"content": '[{"na'}, False)  # cut: its text


@pytest.mark.parametrize("tools, choice, field", [
    (TOOLS, "sometimes", "tool_choice"),
    (None, "required", "tool_choice"),
    ([], {"type": "function", "function": {"name": "weather"}}, "tool_choice"),
    (TOOLS, {"type": "function"}, "tool_choice"),
    (TOOLS, {"type": "function", "function": {"name": "rain"}}, "tool_choice.function.name"),
    ([{"type": "retrieval"}], "required", "tools[0]"),
    ([TOOLS[0], TOOLS[0]], "required", "tools[1].function.name"),
    ([{"type": "function", "function": {"name": "f", "parameters": "none"}}], "required",
     "tools[0].function.parameters"),
])
def test_bad_choices_name_the_field(tools, choice, field) -> None:
    with pytest.raises(FieldError) as e:
        forced_call(tools, choice)
    assert e.value.field == field
