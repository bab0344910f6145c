"""Byte-level BPE tokenizer training (GPT-2 style bytes, Llama-style specials).

Ids 0, 1, 2 are `<pad>`, `<s>` (BOS) and `</s>` (EOS). The post-processor prepends BOS, so a
prompt encoded with special tokens starts with `<s>` exactly as the training stream does. There is
no normalizer and the pre-tokenizer adds no prefix space: decode(encode(text)) == text for any
text, including leading/trailing spaces and multi-byte characters.
"""

from __future__ import annotations

from collections.abc import Iterable
from os import PathLike
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

PAD_TOKEN, BOS_TOKEN, EOS_TOKEN = "<pad>", "<s>", "</s>"
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
SPECIAL_TOKENS = [PAD_TOKEN, BOS_TOKEN, EOS_TOKEN]  # in id order: the trainer assigns ids 0, 1, 2


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int,
                        out_path: str | PathLike[str] | None = None, *, min_frequency: int = 2) -> Tokenizer:
    """Trains a byte-level BPE on `texts`, saves it as tokenizer.json at `out_path` (a file, or a
    folder to put tokenizer.json in) when given, and returns it.

    The vocabulary holds the 3 specials, all 256 byte symbols and merges up to `vocab_size`; a small
    corpus may stop short of it (`get_vocab_size()` tells the real size).
    """
    floor = len(SPECIAL_TOKENS) + 256
    if vocab_size < floor:
        raise ValueError(f"vocab_size must be at least {floor} (3 specials + 256 bytes), got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    for token, want in zip(SPECIAL_TOKENS, (PAD_ID, BOS_ID, EOS_ID)):
        got = tok.token_to_id(token)
        assert got == want, f"{token} got id {got}, expected {want}"
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B:1", special_tokens=[(BOS_TOKEN, BOS_ID)])
    if out_path is not None:
        path = Path(out_path)
        if path.is_dir() or path.suffix != ".json":
            path = path / "tokenizer.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        tok.save(str(path))
    return tok
