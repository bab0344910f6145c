"""OpenAI's `tool_choice` over the tools a chat hands its template.

- "none": the template is told of no tools, and the answer is text.
- "auto" (the default with tools): the template gets the tools and the answer is the model's text,
  a tool call in whatever format the model writes them (no parser: formats differ by family).
- "required", or a function by name ({"type": "function", "function": {"name": ...}}): the output
  is constrained by structured output (the engine's llguidance matcher) to JSON that calls the tools,
  so any model answers with a call, and the answer carries it as `tool_calls` (`content` null).
  A named function's output is its arguments object, its `parameters` schema; "required"'s is a
  JSON array of {"name", "parameters"} objects, one or more calls of any of the tools, as vLLM
  does it (one with `parallel_tool_calls: false`). A forced call streams as OpenAI's deltas: a named function's arguments as they are
  made, "required"'s calls whole in the chunk that finishes the choice (their JSON must be whole to
  be split into calls).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from pie.engine.errors import RequestError


@dataclass(slots=True)
class ForcedCall:
    """A tool_choice that forces a call: of the function `name`, or ("required") of any tool. One
    a request: a stream's "required" output is held here, by choice, until the choice finishes."""

    tools: tuple[str, ...]  # the functions' names, in the request's order
    name: str | None  # the named function; None: "required"
    parallel: bool = True  # "required" may call several tools (OpenAI's parallel_tool_calls)
    _held: dict[int, str] = field(default_factory=dict)

    def schema(self, parameters: dict[str, dict]) -> dict[str, Any]:
        """The JSON schema the output is held to (`parameters`: each function's, by name)."""
        if self.name is not None:
            return parameters[self.name]
        calls = [{"type": "object", "properties": {"name": {"const": name}, "parameters": parameters[name]},
                  "required": ["name", "parameters"], "additionalProperties": False} for name in self.tools]
        schema = {"type": "array", "minItems": 1, "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
        return schema if self.parallel else schema | {"maxItems": 1}

    def calls(self, text: str) -> list[dict[str, Any]] | None:
        """The answer's `tool_calls` from the output `text`; None when it is not whole JSON (the
        output was cut by max_tokens or the context: the text stays content)."""
        if self.name is not None:
            return [tool_call(self.name, text)]
        try:
            parsed = json.loads(text)
        except json.JSONDecodeError:
            return None
        return [tool_call(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in parsed]

    def finish_reason(self, reason: str | None, called: bool) -> str | None:
        """OpenAI's: "tool_calls" when the model chose to call ("required", `called`) and stopped; a
        named function's call ends with "stop", as a forced function's does at OpenAI."""
        return "tool_calls" if self.name is None and reason == "stop" and called else reason

    def opening(self) -> dict[str, Any]:
        """A stream's first delta of a choice: the role, and a named function's call (no arguments yet)."""
        delta: dict[str, Any] = {"role": "assistant", "content": None}
        if self.name is not None:
            delta["tool_calls"] = [tool_call(self.name, "", index=0)]
        return delta

    def delta(self, index: int, text: str, finished: bool) -> tuple[dict[str, Any], bool]:
        """Choice `index`'s delta for its new output `text`, and whether it holds calls: a named
        function's arguments as they come; "required"'s calls when the choice finishes, or its text
        when that is not whole JSON."""
        if self.name is not None:
            return ({"tool_calls": [{"index": 0, "function": {"arguments": text}}]} if text else {}), True
        self._held[index] = self._held.get(index, "") + text
        if not finished:
            return {}, False
        whole = self._held.pop(index)
        calls = self.calls(whole)
        if calls is None:
            return {"content": whole}, False
        return {"tool_calls": [call | {"index": i} for i, call in enumerate(calls)]}, True


def tool_call(name: str, arguments: str, index: int | None = None) -> dict[str, Any]:
    call: dict[str, Any] = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                            "function": {"name": name, "arguments": arguments}}
    if index is not None:  # a stream's delta names the call it belongs to
        call["index"] = index
    return call


def forced_call(tools: list[dict[str, Any]] | None, tool_choice: str | dict[str, Any] | None,
                parallel: bool = True) -> tuple[ForcedCall, dict[str, Any]] | None:
    """The forced call `tool_choice` asks for, and the schema of its output; None when it forces
    none ("none", "auto", unset). `parallel`: "required" may make several calls. RequestError names
    the bad field."""
    if tool_choice is None or tool_choice in ("none", "auto"):
        if tools is not None:
            _parameters(tools)  # checked all the same: a malformed tool is the caller's error either way
        return None
    if isinstance(tool_choice, str) and tool_choice != "required":
        raise RequestError("tool_choice", f'must be "none", "auto", "required" or {{"type": "function", '
                                        f'"function": {{"name": ...}}}}, got {tool_choice!r}')
    if not tools:
        raise RequestError("tool_choice", "forces a tool call, but no tools were given")
    parameters = _parameters(tools)
    name = None
    if isinstance(tool_choice, dict):
        function = tool_choice.get("function")
        if tool_choice.get("type") != "function" or not isinstance(function, dict) \
                or not isinstance(function.get("name"), str):
            raise RequestError("tool_choice", 'a named tool is {"type": "function", "function": {"name": ...}}')
        name = function["name"]
        if name not in parameters:
            raise RequestError("tool_choice.function.name", f"{name!r} is not one of the tools ({', '.join(parameters)})")
    forced = ForcedCall(tuple(parameters), name, parallel)
    return forced, forced.schema(parameters)


def _parameters(tools: list[dict[str, Any]]) -> dict[str, dict]:
    """Each function's parameters schema by name ({"type": "object"} when it has none)."""
    out: dict[str, dict] = {}
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict):
            raise RequestError(f"tools[{i}]", 'must be {"type": "function", "function": {"name": ..., "parameters": ...}}')
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise RequestError(f"tools[{i}].function.name", "is required (a non-empty string)")
        if name in out:
            raise RequestError(f"tools[{i}].function.name", f"{name!r} is given twice")
        params = function.get("parameters", {"type": "object"})
        if not isinstance(params, dict):
            raise RequestError(f"tools[{i}].function.parameters", "must be a JSON schema object")
        out[name] = params
    return out
