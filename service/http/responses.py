"""The engine's outputs as OpenAI's Completions and Chat Completions bodies: whole answers, stream
chunks, logprobs in each endpoint's format, usage, and finish reasons as OpenAI defines them
("stop": an end-of-sequence token, a stop string or a stop token id; "length": max_tokens or the
context)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from pie.engine.messages import RequestOutput, RequestStatus, SampledToken
from pie.model.tokenizer import Tokenizer

from .tool_parsers import ToolParser
from .tools import ForcedCall

FINISH_REASONS = {RequestStatus.FINISHED_STOPPED: "stop", RequestStatus.FINISHED_LENGTH: "length",
                  RequestStatus.FINISHED_ABORTED: "abort"}


@dataclass(slots=True)
class Choice:
    """One choice of an answer as it grows."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[SampledToken] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list[SampledToken] | None = None  # its prompt's tokens after the first (echo with logprobs)

    def add(self, out: RequestOutput) -> None:
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        self.text += out.new_text
        self.token_ids += out.new_token_ids
        self.logprobs += out.new_logprobs
        if out.finished:
            self.finish_reason = FINISH_REASONS.get(out.status)
            self.stop_reason = out.stop_reason


@dataclass(slots=True)
class Answer:
    """Everything one HTTP request asked for: its choices (index = prompt x n + sample) and usage."""

    id: str
    model: str
    created: int = field(default_factory=lambda: int(time.time()))
    choices: dict[int, Choice] = field(default_factory=dict)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: dict[int, int] = field(default_factory=dict)  # per prompt: its tokens read from the prefix cache
    score_only: bool = False  # max_tokens 0: the prompt echoed (and scored), nothing generated shown

    def usage(self) -> dict[str, Any]:
        completion_tokens = 0 if self.score_only else self.completion_tokens
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": self.prompt_tokens + completion_tokens,
                "prompt_tokens_details": {"cached_tokens": sum(self.cached_tokens.values())}}


def _token(tokenizer: Tokenizer, token_id: int) -> str:
    return tokenizer.token_text(token_id)


def chat_logprobs(entries: list[SampledToken], tokenizer: Tokenizer, top: int) -> dict[str, Any]:
    """Chat's `logprobs`: {"content": [{token, logprob, bytes, top_logprobs: [...]}]}."""
    content = []
    for e in entries:
        text = _token(tokenizer, e.token_id)
        content.append({
            "token": text, "logprob": e.logprob, "bytes": list(text.encode()),
            "top_logprobs": [{"token": (t := _token(tokenizer, i)), "logprob": lp, "bytes": list(t.encode())}
                             for i, lp in e.top[:top]]})
    return {"content": content}


def completion_logprobs(entries: list[SampledToken], tokenizer: Tokenizer, offset: int, top: int) -> dict[str, Any]:
    """Completions' `logprobs`: tokens, token_logprobs, top_logprobs (the `top` most likely
    {token: logprob} per position) and text_offset (each token's start in the choice's text, from
    `offset`)."""
    tokens, offsets, at = [], [], offset
    for e in entries:
        text = _token(tokenizer, e.token_id)
        tokens.append(text)
        offsets.append(at)
        at += len(text)
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{_token(tokenizer, i): lp for i, lp in e.top[:top]} for e in entries],
            "text_offset": offsets}


def completion_body(answer: Answer, tokenizer: Tokenizer, logprobs: int | None, echo: list[str] | None,
                    n: int, prompts: list[list[int]] | None = None) -> dict[str, Any]:
    """The whole answer of /v1/completions (`logprobs`: the alternatives per token asked for,
    None: no logprobs; `echo`: each prompt's text, put before its n choices'). With echo and
    logprobs (`prompts`: each prompt's ids), the logprobs cover the prompt's tokens first (the
    first with none, as OpenAI's), as an evaluation harness scoring a continuation reads them; with
    max_tokens 0 (`answer.score_only`) they are all there is."""
    choices = []
    scored: dict[int, list[SampledToken]] = {}  # each prompt's logprobs, from whichever choice carried them
    for index, c in answer.choices.items():
        if c.prompt_logprobs is not None:
            scored[index // n] = c.prompt_logprobs
    for index, c in sorted(answer.choices.items()):
        prefix = echo[index // n] if echo else ""
        text, entries = ("", []) if answer.score_only else (c.text, c.logprobs)
        body = None
        if logprobs is not None and prompts is not None and echo:
            body = _echoed_logprobs(prompts[index // n], scored.get(index // n, []), entries, tokenizer, prefix,
                                    logprobs)
        elif logprobs is not None:
            body = completion_logprobs(entries, tokenizer, len(prefix), logprobs)
        choices.append({"index": index, "text": prefix + text,
                        "finish_reason": "length" if answer.score_only else c.finish_reason,
                        "stop_reason": None if answer.score_only else c.stop_reason, "logprobs": body})
    return {"id": answer.id, "object": "text_completion", "created": answer.created, "model": answer.model,
            "choices": choices, "usage": answer.usage()}


def _echoed_logprobs(prompt: list[int], scored: list[SampledToken], entries: list[SampledToken],
                     tokenizer: Tokenizer, prefix: str, top: int) -> dict[str, Any]:
    """Completions' logprobs over an echoed prompt's tokens (from 0; the first has no logprob, the
    rest `scored`), then the generated `entries` (from the end of `prefix`, the echoed text)."""
    head = completion_logprobs(scored, tokenizer, len(tokenizer.token_text(prompt[0])), top) if prompt else None
    tail = completion_logprobs(entries, tokenizer, len(prefix), top)
    if head is None:
        return tail
    return {"tokens": [tokenizer.token_text(prompt[0])] + head["tokens"] + tail["tokens"],
            "token_logprobs": [None] + head["token_logprobs"] + tail["token_logprobs"],
            "top_logprobs": [None] + head["top_logprobs"] + tail["top_logprobs"],
            "text_offset": [0] + head["text_offset"] + tail["text_offset"]}


def chat_body(answer: Answer, tokenizer: Tokenizer, top_logprobs: int | None,
              forced: ForcedCall | None = None, parser: ToolParser | None = None) -> dict[str, Any]:
    """The whole answer of /v1/chat/completions (`top_logprobs` None: no logprobs asked; `forced`:
    the tool call the request's tool_choice forced, its output the message's `tool_calls`;
    `parser`: reads "auto"'s calls out of the model's text)."""
    choices = []
    for index, c in sorted(answer.choices.items()):
        message: dict[str, Any] = {"role": "assistant", "content": c.text}
        finish = c.finish_reason
        if forced is not None and (calls := forced.calls(c.text)) is not None:
            message = {"role": "assistant", "content": None, "tool_calls": calls}
            finish = forced.finish_reason(finish, True)
        elif parser is not None:
            content, calls = parser.parse(c.text)
            if calls is not None:
                message = {"role": "assistant", "content": content, "tool_calls": calls}
                finish = "tool_calls" if finish == "stop" else finish
        choices.append({
            "index": index, "message": message,
            "logprobs": chat_logprobs(c.logprobs, tokenizer, top_logprobs) if top_logprobs is not None else None,
            "finish_reason": finish, "stop_reason": c.stop_reason})
    return {"id": answer.id, "object": "chat.completion", "created": answer.created, "model": answer.model,
            "choices": choices, "usage": answer.usage()}


def completion_chunk(answer: Answer, index: int, outs: list[RequestOutput], tokenizer: Tokenizer,
                     logprobs: int | None, offset: int, prefix: str = "") -> dict[str, Any]:
    """One /v1/completions stream chunk: choice `index`'s new text, at `offset` in its text after
    `prefix` (the echoed prompt, on its first chunk)."""
    last = outs[-1]
    entries = [e for o in outs for e in o.new_logprobs]
    choice = {"index": index, "text": prefix + "".join(o.new_text for o in outs),
              "logprobs": None if logprobs is None else completion_logprobs(entries, tokenizer, offset + len(prefix),
                                                                            logprobs),
              "finish_reason": FINISH_REASONS.get(last.status) if last.finished else None,
              "stop_reason": last.stop_reason if last.finished else None}
    return {"id": answer.id, "object": "text_completion", "created": answer.created, "model": answer.model,
            "choices": [choice]}


def chat_chunk(answer: Answer, index: int, outs: list[RequestOutput] | None, tokenizer: Tokenizer,
               top_logprobs: int | None, *, first: bool = False, forced: ForcedCall | None = None,
               parser: ToolParser | None = None) -> dict[str, Any]:
    """One /v1/chat/completions stream chunk for choice `index`: the assistant's role first
    (`first`, no outputs), then content deltas, the last with its finish reason. With `forced` (the
    tool call tool_choice forced) the deltas are tool calls;
    with `parser`, content and the calls it reads out of the text."""
    delta: dict[str, Any] = {"role": "assistant", "content": ""} if first else {}
    if first and forced is not None:
        delta = forced.opening()
    choice: dict[str, Any] = {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}
    if outs:
        text = "".join(o.new_text for o in outs)
        last = outs[-1]
        calls = False
        if parser is not None:
            update, calls = parser.feed(index, text, last.finished)
            delta.update(update)
        elif forced is None:
            delta["content"] = text
        else:
            update, calls = forced.delta(index, text, last.finished)
            delta.update(update)
        if top_logprobs is not None:
            choice["logprobs"] = chat_logprobs([e for o in outs for e in o.new_logprobs], tokenizer, top_logprobs)
        if last.finished:
            reason = FINISH_REASONS.get(last.status)
            if forced is not None:
                reason = forced.finish_reason(reason, calls)
            elif calls and reason == "stop":  # the model called a tool ("auto", read by the parser)
                reason = "tool_calls"
            choice["finish_reason"] = reason
            choice["stop_reason"] = last.stop_reason
    return {"id": answer.id, "object": "chat.completion.chunk", "created": answer.created, "model": answer.model,
            "choices": [choice]}


def usage_chunk(answer: Answer, chat: bool) -> dict[str, Any]:
    """`stream_options.include_usage`: the last chunk, with no choices."""
    return {"id": answer.id, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": answer.created, "model": answer.model, "choices": [], "usage": answer.usage()}
