"""service/http/tools.py: tool_choice's forced calls, without a server: the schema the output is
held to, the calls read back from it, the stream's deltas, and the errors that name the field."""

from __future__ import annotations

import json

import pytest

from pie.engine.errors import RequestError
from pie.service.http.tools import forced_call

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "now"}}]  # no parameters: any object


def test_none_and_auto_force_nothing_but_check_the_tools() -> None:
    for choice in (None, "none", "auto"):
        assert forced_call(TOOLS, choice) is None
    assert forced_call(None, None) is None
    with pytest.raises(RequestError) as e:
        forced_call([{"type": "function", "function": {"name": ""}}], "auto")
    assert e.value.field == "tools[0].function.name"


def test_a_named_function_is_held_to_its_parameters() -> None:
    forced, schema = forced_call(TOOLS, {"type": "function", "function": {"name": "weather"}})
    assert schema == WEATHER
    [call] = forced.calls('{"city": "Oslo"}')
    assert call["type"] == "function" and call["function"] == {"name": "weather", "arguments": '{"city": "Oslo"}'}
    assert forced.finish_reason("stop", True) == "stop"  # a forced function ends as OpenAI's does
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
    assert forced.finish_reason("stop", True) == "tool_calls"
    assert forced.calls('[{"name": "weather", "param') is None  # cut by max_tokens: no calls
    assert forced.finish_reason("length", False) == "length"


def test_stream_deltas() -> None:
    named, _ = forced_call(TOOLS, {"type": "function", "function": {"name": "weather"}})
    opening = named.opening()
    assert opening["role"] == "assistant" and opening["content"] is None
    [head] = opening["tool_calls"]
    assert head["index"] == 0 and head["function"] == {"name": "weather", "arguments": ""} and head["id"]
    assert named.delta(0, '{"ci', False) == ({"tool_calls": [{"index": 0, "function": {"arguments": '{"ci'}}]},
                                                 True)
    required, _ = forced_call(TOOLS, "required")
    assert "tool_calls" not in required.opening()
    assert required.delta(1, '[{"name": "now", ', False) == ({}, False)  # held until the choice ends
    delta, calls = required.delta(1, '"parameters": {}}]', True)
    assert calls and [(c["index"], c["function"]["name"]) for c in delta["tool_calls"]] == [(0, "now")]
    assert required.delta(1, '[{"na', True) == ({"content": '[{"na'}, False)  # nothing left held; cut: its text


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
    with pytest.raises(RequestError) as e:
        forced_call(tools, choice)
    assert e.value.field == field


# ---- "auto": calls read out of the model's text -------------------------------------------------------
from pie.service.http.tool_parsers import ToolParser  # noqa: E402

HERMES = ('I will look.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
          '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>')


def _stream(parser: ToolParser, text: str, cuts: list[int]) -> tuple[str, list[dict], bool]:
    """`text` fed in pieces cut at `cuts`: the content and calls that come out, and the last flag."""
    content, calls, made = "", [], False
    pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)], strict=True)]
    for i, piece in enumerate(pieces):
        delta, made = parser.feed(0, piece, i == len(pieces) - 1)
        content += delta.get("content", "")
        calls += delta.get("tool_calls", [])
    return content, calls, made


def test_hermes_calls_whole_and_streamed() -> None:
    parser = ToolParser("hermes")
    content, calls = parser.parse(HERMES)
    assert content == "I will look."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("weather", {"city": "Oslo"}), ("now", {})]
    assert parser.parse("No tools today.") == ("No tools today.", None)
    assert parser.parse('<tool_call>\n{"name": "weather", "argu') == ('<tool_call>\n{"name": "weather", "argu', None)
    for cuts in ([], [1, 5, 13, 14, 20, 30, 60, 90], list(range(1, len(HERMES)))):  # every character alone, too
        content, streamed, made = _stream(ToolParser("hermes"), HERMES, cuts)
        assert content.strip() == "I will look." and made
        assert [c["index"] for c in streamed] == [0, 1]
        assert [c["function"] for c in streamed] == [c["function"] for c in calls]
    # a block cut by max_tokens, and text that only looks like a tag's start, come out as text
    cut = 'Sure <tool_call>\n{"name": "weath'
    assert _stream(ToolParser("hermes"), cut, [3, 7, 12]) == (cut, [], False)
    unclosed = '<tool_call>\n{"name": "now", "arguments": {}}'  # the model stopped before closing the block
    assert parser.parse(unclosed)[1][0]["function"]["name"] == "now"
    assert _stream(ToolParser("hermes"), unclosed, [4, 20])[1][0]["function"]["name"] == "now"
    assert _stream(ToolParser("hermes"), "a <tool b", [3, 6]) == ("a <tool b", [], False)


def test_llama3_json_calls_whole_and_streamed() -> None:
    parser = ToolParser("llama3_json")
    text = '{"name": "weather", "parameters": {"city": "Oslo"}}'
    content, [call] = parser.parse(text)
    assert content is None and call["function"] == {"name": "weather", "arguments": '{"city": "Oslo"}'}
    assert parser.parse("<|python_tag|>" + text)[1][0]["function"]["name"] == "weather"
    assert parser.parse("It is sunny.") == ("It is sunny.", None)
    assert parser.parse('{"not": "a call"}') == ('{"not": "a call"}', None)
    content, streamed, made = _stream(ToolParser("llama3_json"), text, [1, 10, 30])
    assert content == "" and made and streamed[0]["function"] == call["function"] and streamed[0]["index"] == 0
    assert _stream(ToolParser("llama3_json"), "It is sunny.", [2, 5]) == ("It is sunny.", [], False)
    with pytest.raises(ValueError, match="tool call parser"):
        ToolParser("xml")
