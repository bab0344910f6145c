"""Tool calls read out of a model's own text, for `tool_choice: "auto"` (`pie serve
--tool-call-parser NAME`): each family writes calls its own way, so the server is told which.

- hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks, any number, with text
  around them (Qwen2.5, Qwen3, Hermes and the templates written after them).
- llama3_json: the whole answer one JSON object `{"name": ..., "parameters": {...}}` (Llama 3.1-3.3's
  JSON tool calling; `<|python_tag|>` before it is dropped).

A parser turns a whole answer into (content, calls), and a stream's text deltas into content deltas
and calls, holding back only what may still become a call: a hermes answer streams its text as it
comes (but a tail that could open a `<tool_call>`) and each call once its block closes; a llama3_json
answer that opens with `{` is held to its end. Text that turns out not to be a call (JSON that does
not parse, a block cut by max_tokens) comes out as content, never lost.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from .tools import tool_call

PARSERS = ("hermes", "llama3_json")


def _call(text: str, arguments_key: str) -> dict[str, Any] | None:
    """A call of `{"name": ..., arguments_key: {...}}` JSON text, or None when it is not one."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get(arguments_key, obj.get("arguments", {}))
    return tool_call(obj["name"], arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False))


@dataclass(slots=True)
class _Stream:
    """One choice's stream: text not yet given out, whether it is inside a call, calls so far."""

    held: str = ""
    inside: bool = False
    calls: int = 0
    started: bool = False  # some non-space text seen (llama3_json decides on its first character)


class ToolParser:
    """Reads calls out of one family's text (see the module's docstring). `parse` a whole answer;
    `feed` a stream's deltas, per choice."""

    def __init__(self, name: str) -> None:
        if name not in PARSERS:
            raise ValueError(f"tool call parser must be one of {PARSERS}, got {name!r}")
        self.name = name
        self._streams: dict[int, _Stream] = {}

    # ---- a whole answer ----
    def parse(self, text: str) -> tuple[str | None, list[dict[str, Any]] | None]:
        """(content, calls) of an answer; calls None when it holds none (content is then the text)."""
        if self.name == "llama3_json":
            body = _llama_body(text)
            call = _call(body, "parameters") if body.startswith("{") else None
            return (text, None) if call is None else (None, [call])
        calls, content, rest = [], [], text
        while (i := rest.find(HERMES_OPEN)) >= 0:
            content.append(rest[:i])
            j = rest.find(HERMES_CLOSE, i)
            call = _call(rest[i + len(HERMES_OPEN):j if j >= 0 else len(rest)], "arguments")
            if call is None:
                return text, None
            calls.append(call)
            rest = "" if j < 0 else rest[j + len(HERMES_CLOSE):]
        if not calls:
            return text, None
        return "".join(content + [rest]).strip() or None, calls

    # ---- a stream ----
    def feed(self, index: int, text: str, finished: bool) -> tuple[dict[str, Any], bool]:
        """Choice `index`'s delta for its new `text`, and whether the choice has made a call so far."""
        s = self._streams.setdefault(index, _Stream())
        s.held += text
        if self.name == "llama3_json":
            delta = self._feed_llama(s, finished)
        else:
            delta = self._feed_hermes(s, finished)
        made = s.calls > 0
        if finished:
            del self._streams[index]
        return delta, made

    def _feed_llama(self, s: _Stream, finished: bool) -> dict[str, Any]:
        if not s.started:
            if not s.held.strip():
                return {}
            # `{`: a call, held to the end; `<`: maybe a `<|python_tag|>` not yet whole, held as well
            s.started, s.inside = True, s.held.lstrip()[0] in "{<"
        if not s.inside:
            out, s.held = s.held, ""
            return {"content": out} if out else {}
        if not finished:
            return {}
        call = _call(_llama_body(s.held), "parameters")
        if call is None:
            return {"content": s.held}
        s.calls = 1
        return {"tool_calls": [call | {"index": 0}]}

    def _feed_hermes(self, s: _Stream, finished: bool) -> dict[str, Any]:
        content, calls = "", []
        while True:
            if not s.inside:
                i = s.held.find(HERMES_OPEN)
                if i < 0:
                    keep = 0 if finished else _open_tail(s.held)
                    content, s.held = content + s.held[:len(s.held) - keep], s.held[len(s.held) - keep:]
                    break
                content, s.held, s.inside = content + s.held[:i], s.held[i + len(HERMES_OPEN):], True
            j = s.held.find(HERMES_CLOSE)
            if j < 0 and not finished:
                break
            # a block ends at its close, or at the answer's end (the model stopped before closing it:
            # a call all the same if it parses, else its text, cut by max_tokens)
            end = j + len(HERMES_CLOSE) if j >= 0 else len(s.held)
            call = _call(s.held[:j] if j >= 0 else s.held, "arguments")
            if call is None:
                content += HERMES_OPEN + s.held[:end]
            else:
                calls.append(call | {"index": s.calls})
                s.calls += 1
            s.held, s.inside = s.held[end:], False
        delta: dict[str, Any] = {}
        if content and (content.strip() or not s.calls):  # no blank lines between calls
            delta["content"] = content
        if calls:
            delta["tool_calls"] = calls
        return delta


HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"


def _llama_body(text: str) -> str:
    body = text.strip()
    return body.removeprefix(PYTHON_TAG).lstrip()


def _open_tail(text: str) -> int:
    """The longest end of `text` that could still grow into HERMES_OPEN (held back from the stream)."""
    for k in range(min(len(text), len(HERMES_OPEN) - 1), 0, -1):
        if HERMES_OPEN.startswith(text[-k:]):
            return k
    return 0

