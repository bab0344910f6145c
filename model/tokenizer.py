"""A thin wrapper around a `tokenizers` tokenizer.json plus the special-token facts the engine needs.

BOS: the tokenizer.json's post-processor normally adds it (Llama, Mistral: a TemplateProcessing
"<s> $A"; Qwen adds none). Some checkpoints instead rely on tokenizer_config.json's
`add_bos_token: true` (handled by transformers' Python tokenizer classes, not by tokenizer.json);
for those, `encode(..., add_special_tokens=True)` prepends bos_token itself. Nothing else from
tokenizer_config.json (chat templates, padding side, ...) is interpreted here.

EOS ids, first source that has them: generation_config.json `eos_token_id` (int or list), then
config.json `eos_token_id`, then tokenizer_config.json `eos_token`.

Refusing a text that has too many tokens costs little: each token stands for at most
`max_token_bytes` bytes of the normalized text, so `len(utf8) / max_token_bytes` tokens at least,
found in one pass over the bytes instead of a tokenization (for a very long prompt, a small
part of the time and none of an Encoding's memory). The bound holds where no piece of the text
is dropped and no token stands for an unbounded run (`_max_token_bytes` says which tokenizers).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from os import PathLike
from pathlib import Path
from typing import Any

import tokenizers

from .config import ModelConfig, as_token_ids

GIL_FREE_ENCODE_CHARS = 2048  # longer texts are encoded with the GIL released (see Tokenizer.encode)


class TooManyTokens(ValueError):
    """The text has more tokens than the caller allows: `count` of them, or, with `at_least`, at
    least `count` (refused from the byte length, before tokenizing)."""

    def __init__(self, count: int, *, at_least: bool = False) -> None:
        super().__init__(f"{'at least ' if at_least else ''}{count} tokens")
        self.count = count
        self.at_least = at_least


# Pre-tokenizers that keep every character of the normalized text in some piece. (Whitespace,
# WhitespaceSplit, BertPreTokenizer and CharDelimiterSplit drop characters; Split and Punctuation
# do with behavior "Removed".)
_KEEPING_PRE_TOKENIZERS = frozenset({"ByteLevel", "Metaspace", "Digits", "UnicodeScripts", "Split", "Punctuation"})


def _keeps_every_character(pre_tokenizer: dict | None) -> bool:
    if pre_tokenizer is None:
        return True
    kind = pre_tokenizer.get("type")
    if kind == "Sequence":
        return all(_keeps_every_character(p) for p in pre_tokenizer.get("pretokenizers", ()))
    return kind in _KEEPING_PRE_TOKENIZERS and pre_tokenizer.get("behavior") != "Removed"


def _has_byte_level(pre_tokenizer: dict | None) -> bool:
    if pre_tokenizer is None:
        return False
    if pre_tokenizer.get("type") == "Sequence":
        return any(_has_byte_level(p) for p in pre_tokenizer.get("pretokenizers", ()))
    return pre_tokenizer.get("type") == "ByteLevel"


def _max_token_bytes(spec: dict, vocab: dict[str, int]) -> int | None:
    """The most bytes of normalized text one token can stand for, or None where that is not
    bounded by the vocabulary. A token's string spells at least the bytes it stands for: byte-level
    BPE maps every byte to one character, Metaspace's "\u2581" (3 bytes) stands for one space, a
    byte-fallback token "<0x41>" (6) for one byte, an unknown character (4 bytes at most) becomes
    the unk token. That needs every character to reach some token: every byte-level character in
    the vocabulary, or every byte's fallback piece, or an unk token (BPE drops a character it has
    no piece for). Not bounded: pre-tokenizers that drop characters, BPE that fuses runs of unknown
    characters into one token, Unigram and WordPiece (an unk token per unknown run or word)."""
    model = spec.get("model") or {}
    if model.get("type") != "BPE" or not _keeps_every_character(spec.get("pre_tokenizer")):
        return None
    unk = model.get("unk_token")
    if unk is not None and model.get("fuse_unk"):
        return None
    covered = (
        unk is not None
        or (model.get("byte_fallback") and all(f"<0x{b:02X}>" in vocab for b in range(256)))
        or (_has_byte_level(spec.get("pre_tokenizer")) and all(c in vocab for c in _byte_level_alphabet())))
    if not covered:
        return None
    longest = max((len(token.encode("utf-8")) for token in vocab), default=0)
    return max(longest, 4) if unk is not None else max(longest, 1)


def _byte_level_alphabet() -> list[str]:
    return tokenizers.pre_tokenizers.ByteLevel.alphabet()


def _read_json(file: Path) -> dict[str, Any]:
    return json.loads(file.read_text()) if file.is_file() else {}


def _token_content(value: str | dict | None) -> str | None:
    """tokenizer_config.json writes special tokens as "<s>" or {"content": "<s>", ...}."""
    if isinstance(value, dict):
        return value.get("content")
    return value


class Tokenizer:
    def __init__(self, backend: tokenizers.Tokenizer, *, eos_token_ids: tuple[int, ...],
                 bos_token_id: int | None, add_bos_token: bool = False) -> None:
        self.backend = backend  # the raw tokenizers.Tokenizer (e.g. for tokenizers.decoders.DecodeStream)
        self.eos_token_ids = eos_token_ids
        self.bos_token_id = bos_token_id
        added = backend.get_added_tokens_decoder()  # id -> AddedToken
        self.all_special_ids: tuple[int, ...] = tuple(sorted(i for i, t in added.items() if t.special))
        # Largest id + 1 over the model vocabulary and added tokens (ids may have holes).
        self.vocab_size = max([backend.get_vocab_size(with_added_tokens=False) - 1, *added.keys()]) + 1
        # Prepend BOS ourselves only where the config asks for it and the post-processor does not.
        probe = backend.encode("a", add_special_tokens=True).ids
        self._prepend_bos = (add_bos_token and bos_token_id is not None
                             and (not probe or probe[0] != bos_token_id))
        self._token_text: dict[int, str] = {}  # token_text's cache: at most one entry per id
        # Bytes of normalized text one token stands for at most (None: not bounded): what
        # `min_tokens` divides by.
        self.max_token_bytes = _max_token_bytes(json.loads(backend.to_str()), backend.get_vocab(with_added_tokens=True))

    @classmethod
    def from_pretrained(cls, path: str | PathLike[str], config: ModelConfig | None = None) -> Tokenizer:
        """From a model folder holding tokenizer.json (and optionally tokenizer_config.json,
        generation_config.json, config.json). `config` saves re-reading config.json."""
        path = Path(path)
        file = path / "tokenizer.json"
        if not file.is_file():
            raise FileNotFoundError(
                f"no tokenizer.json in {path}: only fast-tokenizer folders (tokenizer.json) are supported")
        backend = tokenizers.Tokenizer.from_file(str(file))
        tok_cfg = _read_json(path / "tokenizer_config.json")
        gen_cfg = _read_json(path / "generation_config.json")
        if config is not None:
            cfg_eos, cfg_bos = config.eos_token_ids, config.bos_token_id
        else:
            raw = _read_json(path / "config.json")
            cfg_eos, cfg_bos = as_token_ids(raw.get("eos_token_id")), raw.get("bos_token_id")

        eos = as_token_ids(gen_cfg.get("eos_token_id")) or cfg_eos
        if not eos:
            eos_text = _token_content(tok_cfg.get("eos_token"))
            eos_id = backend.token_to_id(eos_text) if eos_text else None
            eos = () if eos_id is None else (eos_id,)

        bos = gen_cfg.get("bos_token_id", cfg_bos)
        if bos is None:
            bos_text = _token_content(tok_cfg.get("bos_token"))
            bos = backend.token_to_id(bos_text) if bos_text else None
        return cls(backend, eos_token_ids=eos, bos_token_id=bos,
                   add_bos_token=bool(tok_cfg.get("add_bos_token", False)))

    def min_tokens(self, text: str) -> int:
        """A lower bound of the number of tokens of `text` (special tokens not counted), from its
        normalized byte length: no tokenization. 0 where the tokenizer allows no bound."""
        if self.max_token_bytes is None:
            return 0
        normalizer = self.backend.normalizer
        normalized = normalizer.normalize_str(text) if normalizer is not None else text
        return -(-len(normalized.encode("utf-8", "surrogatepass")) // self.max_token_bytes)

    def encode(self, text: str, add_special_tokens: bool = True, *, max_tokens: int | None = None) -> list[int]:
        """Token ids of `text`; raises TooManyTokens when there are more than `max_tokens`. A text
        whose byte length alone shows that (`min_tokens`) is refused without being tokenized; one
        that is tokenized and refused pays nothing for the list of ids.

        Long texts go through `encode_batch_fast`, which releases the GIL while it works and keeps
        no offsets. `encode` holds the GIL for the whole tokenization, during which no other
        thread of the process runs; `encode_batch` releases it, but freeing its result holds it
        again for a while; the fast variant holds it only to build the list of ids (not at all when
        they are too many). So a caller on a worker thread leaves the rest of the process
        running."""
        if max_tokens is not None and len(text) > max_tokens:  # the bound can refuse only long texts
            at_least = self.min_tokens(text)
            if at_least > max_tokens:
                raise TooManyTokens(at_least, at_least=True)
        if len(text) > GIL_FREE_ENCODE_CHARS:
            encoding = self.backend.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0]
        else:
            encoding = self.backend.encode(text, add_special_tokens=add_special_tokens)
        ids = None
        bos = 0  # 1 when BOS is prepended here (tokenizer_config.json's add_bos_token)
        if add_special_tokens and self._prepend_bos:
            ids = encoding.ids
            bos = int(not ids or ids[0] != self.bos_token_id)
        if max_tokens is not None and len(encoding) + bos > max_tokens:
            count = len(encoding) + bos
            # The exception's traceback holds this frame: not the Encoding (large for a long text).
            encoding = ids = None
            raise TooManyTokens(count)
        if ids is None:
            ids = encoding.ids
        if bos:
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """The text of one token on its own (special tokens included), as logprobs report it;
        each id is decoded once (a byte-level piece of a multi-byte character decodes to U+FFFD)."""
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.backend.decode([token_id], skip_special_tokens=False)
        return text

    def id_to_token(self, token_id: int) -> str | None:
        """The token's string in the vocabulary (byte-level BPE: its byte-to-unicode spelling)."""
        return self.backend.id_to_token(token_id)

    def convert_ids_to_tokens(self, ids: Iterable[int]) -> list[str | None]:
        return [self.backend.id_to_token(i) for i in ids]

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)
