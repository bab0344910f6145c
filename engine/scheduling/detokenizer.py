"""Incremental detokenization with stop strings, at a cost per token of one short native call.

Token -> text is not a per-token map: byte-level BPE splits multi-byte UTF-8 characters across
tokens, and SentencePiece-style decoders drop or add a leading space depending on what comes
before. `tokenizers.decoders.DecodeStream` (the fast path of vLLM v1's detokenizer) handles both in
Rust: it keeps a short window of ids, decodes it against the text of the window's prefix, and
returns the new text, or None while the window ends inside a character. One call per step
replaces two window decodes and their Python bookkeeping: less host time per token, which a
decode step pays once for every sequence in it.

The stream starts on the last few prompt ids, so the first output token decodes in context; the
prompt's own text is never emitted. Ids the stream holds back are tracked here too, for two
cases it does not cover: `flush` at the end of a request returns them as a full decode would
(U+FFFD for a split character), and after _MAX_PENDING_TOKENS held ids (a stream of invalid
UTF-8) they are taken as decoded and the stream restarts without context, so the window cannot
grow forever.

Stop strings: the last (longest stop string - 1) characters of decoded text are held back, so a
stop string that spans steps is found whole; each step searches only the held tail plus the new
text, for a match that ends in the new text. Text from the stop string on is never emitted (unless
include_stop_str_in_output keeps the stop string itself). With `min_tokens`, no stop string counts
before that many tokens have been stepped in (as vLLM checks them): the text goes on, held back as
usual, and from then on a stop string ending in the text of a later token ends it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from tokenizers import Tokenizer as BackendTokenizer
from tokenizers.decoders import DecodeStream

# Tokens of prompt context decoded before the first output token.
_PROMPT_CONTEXT_TOKENS = 5
# Past this many ids without a character boundary, held ids are taken as decoded (U+FFFD included).
_MAX_PENDING_TOKENS = 64
_REPLACEMENT = "\ufffd"


class Decoder(Protocol):
    backend: BackendTokenizer  # the `tokenizers` object DecodeStream runs on
    all_special_ids: tuple[int, ...]  # the added tokens marked special (skip_special_tokens drops them)

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
        min_tokens: int = 0,
    ) -> None:
        self._tokenizer = tokenizer
        self._backend = tokenizer.backend
        self._skip_special = skip_special_tokens
        # Ids with no text: stepped in, they only grow the stream's window (a run of them is held
        # as if inside a character, and re-decoded every step until _MAX_PENDING_TOKENS).
        self._textless = frozenset(tokenizer.all_special_ids) if skip_special_tokens else frozenset()
        self._stop = [s for s in stop if s]
        self._include_stop = include_stop_str_in_output
        self._hold = max((len(s) for s in self._stop), default=1) - 1  # chars held back
        # Tokens still to be stepped in before a stop string may end the request (min_tokens).
        self._stops_from = min_tokens
        context = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        # The stream would emit a context that ends inside a character (prompt ids cut mid-way):
        # it then starts before that character, whose rest decodes as U+FFFD in the output.
        while context and tokenizer.decode(context, skip_special_tokens).endswith(_REPLACEMENT):
            context.pop()
        self._stream = DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)
        # The ids the stream holds (no text yet), after up to _PROMPT_CONTEXT_TOKENS ids of context.
        self._window: list[int] = context
        self._num_held = 0
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
        if self._stops_from:
            self._stops_from = max(0, self._stops_from - len(new_token_ids))
        if not self._textless.isdisjoint(new_token_ids):  # skipped special tokens: the stream never sees them
            new_token_ids = [i for i in new_token_ids if i not in self._textless]
            if not new_token_ids:
                return ""
        # One id goes in as an int: half the cost of a list through the binding.
        one = len(new_token_ids) == 1
        chunk = self._stream.step(self._backend, new_token_ids[0] if one else list(new_token_ids))
        window = self._window
        window.extend(new_token_ids)
        if chunk is None:  # the window ends inside a character
            self._num_held += len(new_token_ids)
            if self._num_held < _MAX_PENDING_TOKENS:
                return ""
            chunk = self._decode_held()
        else:
            self._num_held = 0
            if len(window) > 4 * _PROMPT_CONTEXT_TOKENS:
                del window[:-_PROMPT_CONTEXT_TOKENS]
            if not self._stop:  # nothing is held back for stop strings: the chunk goes out as is
                return self._push(chunk)
        return self._release(chunk, final=False)

    def flush(self) -> str:
        """At the end of the request: return everything held back (split characters decode as
        U+FFFD, as a full decode would). A stop string found here still cuts the text."""
        if self.stopped:
            return ""
        return self._release(self._decode_held() if self._num_held else "", final=True)

    def _decode_held(self) -> str:
        """The text of the held ids as a full decode gives it (in the context of the ids before
        them); the stream restarts after them."""
        window, held = self._window, self._num_held
        context = window[:len(window) - held]
        text = (self._tokenizer.decode(window, self._skip_special)[
            len(self._tokenizer.decode(context, self._skip_special)):])
        window.clear()  # a context ending in U+FFFD would be emitted again (see __init__)
        self._stream = DecodeStream(skip_special_tokens=self._skip_special)
        self._num_held = 0
        return text

    def _release(self, new_text: str, *, final: bool) -> str:
        if not new_text and not final:
            return ""
        buf = self._pending + new_text
        if self._stop and not self._stops_from:
            cut = self._find_stop(buf, len(self._pending))
            if cut is not None:
                start, stop = cut
                self.stopped = True
                self.stop_string = stop
                self._pending = ""
                return self._push(buf[:start + len(stop)] if self._include_stop else buf[:start])
        keep = 0 if final else min(self._hold, len(buf))
        self._pending = buf[len(buf) - keep:] if keep else ""
        return self._push(buf[:len(buf) - keep])

    def _find_stop(self, buf: str, new_from: int) -> tuple[int, str] | None:
        """Earliest occurrence of any stop string in buf that ends past `new_from` (in the new text:
        one wholly in the held tail was searched before, or came before min_tokens); ties: the
        first listed."""
        best: tuple[int, str] | None = None
        for s in self._stop:
            i = buf.find(s, max(0, new_from - len(s) + 1))
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        return best

    def _push(self, delta: str) -> str:
        if delta:
            self._pieces.append(delta)
            self._text_cache = None
        return delta
