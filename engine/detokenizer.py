"""Incremental detokenization with stop strings, at a cost per step bounded by a small window.

Token -> text is not a per-token map: byte-level BPE splits multi-byte UTF-8 characters across
tokens, and SentencePiece-style decoders drop or add a leading space depending on what comes
before. So each step decodes a short window of ids twice (the approach of vLLM's
`detokenize_incrementally`), with two offsets into the ids:

    ids:   ... prompt ... | ... output ...
                  ^prefix_offset     ^read_offset        ^len(ids)
                  |-- prefix_text --|
                  |------------ new_text ----------------|

    delta = new_text[len(prefix_text):]. When new_text ends in U+FFFD (a character still split
    across tokens) only the text before it is returned and the offsets stay; once it does not,
    the rest is returned and prefix_offset = read_offset, read_offset = len(ids).

The window starts a few tokens before the end of the prompt so the first output token decodes in
context; the prompt's own text is never emitted.

Stop strings: the last (longest stop string - 1) characters of decoded text are held back, so a
stop string that spans steps is found whole; each step searches only the held tail plus the new
text. Text from the stop string on is never emitted (unless include_stop_str_in_output keeps the
stop string itself).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

# Tokens of prompt context decoded before the first output token.
_PROMPT_CONTEXT_TOKENS = 5
# Byte-level BPE tokens can straddle characters, and a step may carry several tokens, so the window
# may need a few steps to end on a character boundary. Past this many tokens without one, the text
# is taken as decoded (U+FFFD included), so a stream of invalid UTF-8 cannot grow it forever.
_MAX_PENDING_TOKENS = 64
_REPLACEMENT = "\ufffd"


class Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool) -> str: ...


class IncrementalDetokenizer:
    """Turns one request's output tokens into text deltas and finds its stop strings."""

    def __init__(
        self,
        tokenizer: Decoder,
        prompt_token_ids: Sequence[int],
        *,
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._stop = [s for s in stop if s]
        self._include_stop = include_stop_str_in_output
        self._hold = max((len(s) for s in self._stop), default=1) - 1  # chars held back
        # Only the window ids[prefix_offset:] is kept; offsets are relative to self._ids.
        self._ids: list[int] = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._emitted_in_window = 0  # chars of the window past prefix_text already returned
        self._pending = ""  # decoded, not yet emitted (held back for stop strings)
        self._pieces: list[str] = []  # emitted deltas
        self._text_cache: str | None = ""
        self.stopped = False
        self.stop_string: str | None = None

    @property
    def text(self) -> str:
        """All text emitted so far."""
        if self._text_cache is None:
            self._text_cache = "".join(self._pieces)
        return self._text_cache

    def step(self, new_token_ids: Sequence[int]) -> str:
        """Append output tokens; return the text that is now safe to emit ("" after a stop)."""
        if self.stopped:
            return ""
        self._ids.extend(new_token_ids)
        return self._emit(self._decode_new(final=False), final=False)

    def flush(self) -> str:
        """At the end of the request: return everything held back (split characters decode as
        U+FFFD, as a full decode would). A stop string found here still cuts the text."""
        if self.stopped:
            return ""
        return self._emit(self._decode_new(final=True), final=True)

    def _decode_new(self, *, final: bool) -> str:
        """Text of the window not yet returned. While the window ends inside a character, only
        the text before that character is returned and the offsets stay, so the window grows
        until a token ends on a character boundary (usually the next token)."""
        if self._read_offset == len(self._ids):
            return ""
        ids = self._ids
        prefix_text = self._tokenizer.decode(ids[self._prefix_offset:self._read_offset],
                                             self._skip_special)
        new_text = self._tokenizer.decode(ids[self._prefix_offset:], self._skip_special)
        start = len(prefix_text) + self._emitted_in_window
        if (not final and new_text.endswith(_REPLACEMENT)
                and len(ids) - self._read_offset < _MAX_PENDING_TOKENS):
            stable = new_text.rstrip(_REPLACEMENT)  # the split character is still arriving
            delta = stable[start:]
            self._emitted_in_window += len(delta)
            return delta
        delta = new_text[start:]
        # Advance the window and drop the ids before it, so every decode stays short.
        del ids[:self._read_offset]
        self._prefix_offset = 0
        self._read_offset = len(ids)
        self._emitted_in_window = 0
        return delta

    def _emit(self, new_text: str, *, final: bool) -> str:
        if not new_text and not final:
            return ""
        buf = self._pending + new_text
        if self._stop:
            cut = self._find_stop(buf)
            if cut is not None:
                start, stop = cut
                self.stopped = True
                self.stop_string = stop
                self._pending = ""
                return self._push(buf[:start + len(stop)] if self._include_stop else buf[:start])
        keep = 0 if final else min(self._hold, len(buf))
        self._pending = buf[len(buf) - keep:] if keep else ""
        return self._push(buf[:len(buf) - keep])

    def _find_stop(self, buf: str) -> tuple[int, str] | None:
        """Earliest occurrence of any stop string in buf (ties: the first listed)."""
        best: tuple[int, str] | None = None
        for s in self._stop:
            i = buf.find(s)
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        return best

    def _push(self, delta: str) -> str:
        if delta:
            self._pieces.append(delta)
            self._text_cache = None
        return delta
