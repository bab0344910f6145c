"""Documents (training.documents) -> flat token streams for training.

A token stream is every document's ids back to back, each document as `<s> ... </s>` (BOS from the
tokenizer's post-processor, EOS appended here), so the model learns where stories end and starts
from BOS exactly as a served prompt does. Training samples windows of it at random offsets.

    stream:  <s> once upon ... end . </s> <s> tom had ... </s> <s> ...
    window:          [----------- seq_len + 1 -----------]   -> inputs [:-1], targets [1:]
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .documents import Documents

_TEXT_BATCH = 1000  # documents read (and tokenized) at a time


@dataclass(slots=True)
class TokenSplits:
    train: np.ndarray  # (N_train,) uint16 or int32 token stream, EOS after every document
    eval: np.ndarray  # (N_eval,) the held-out stream, same layout

    def __post_init__(self) -> None:
        for name in ("train", "eval"):
            arr = getattr(self, name)
            if arr.ndim != 1 or len(arr) < 2:
                raise ValueError(f"{name} token stream must be 1-D with at least 2 tokens, got shape {arr.shape}")


def iter_texts(docs: Documents, limit: int | None = None) -> Iterator[str]:
    """Document texts, the first `limit` of them when given (e.g. for the tokenizer)."""
    n = len(docs) if limit is None else min(limit, len(docs))
    for start in range(0, n, _TEXT_BATCH):
        yield from docs.texts(start, min(start + _TEXT_BATCH, n))


def hold_out(docs: Documents, n_eval: int, seed: int) -> tuple[Documents, Documents]:
    """(train, eval): `n_eval` documents drawn at random (seeded) for eval, the rest for training;
    both keep the documents' order."""
    if not 0 < n_eval < len(docs):
        raise ValueError(f"cannot hold out {n_eval} of {len(docs)} documents (need at least 2 documents)")
    picked = np.zeros(len(docs), dtype=bool)
    picked[np.random.default_rng(seed).choice(len(docs), size=n_eval, replace=False)] = True
    return docs.select(np.flatnonzero(~picked).tolist()), docs.select(np.flatnonzero(picked).tolist())


def tokenize_texts(texts: Iterable[str], tokenizer, *, eos_id: int, batch_size: int = 1000) -> np.ndarray:
    """`<s> doc </s>` for every text, concatenated; uint16 when the vocabulary fits, else int32."""
    dtype = np.uint16 if tokenizer.get_vocab_size() <= np.iinfo(np.uint16).max + 1 else np.int32
    chunks: list[np.ndarray] = []
    batch: list[str] = []

    def flush() -> None:
        for enc in tokenizer.encode_batch(batch, add_special_tokens=True):
            chunks.append(np.asarray(enc.ids + [eos_id], dtype=dtype))
        batch.clear()

    for text in texts:
        batch.append(text)
        if len(batch) == batch_size:
            flush()
    if batch:
        flush()
    return np.concatenate(chunks) if chunks else np.zeros(0, dtype=dtype)


def prepare_tokens(train_docs: Documents, tokenizer, *, eos_id: int, eval_docs: Documents | None = None,
                   eval_fraction: float = 0.01, seed: int = 0, save_dir: str | os.PathLike[str] | None = None,
                   ) -> TokenSplits:
    """Tokenizes the documents into TokenSplits. Without `eval_docs`, `eval_fraction` of the training
    documents (drawn with `seed`, at least one) are held out. With `save_dir` the streams are
    written as train.npy / eval.npy and returned memory-mapped."""
    if eval_docs is None:
        train_docs, eval_docs = hold_out(train_docs, max(1, int(round(len(train_docs) * eval_fraction))), seed)
    streams = {name: tokenize_texts(iter_texts(docs), tokenizer, eos_id=eos_id)
               for name, docs in (("train", train_docs), ("eval", eval_docs))}
    if save_dir is not None:
        Path(save_dir).mkdir(parents=True, exist_ok=True)
        for name, arr in streams.items():
            np.save(Path(save_dir) / f"{name}.npy", arr)
        streams = {name: np.load(Path(save_dir) / f"{name}.npy", mmap_mode="r") for name in streams}
    return TokenSplits(train=streams["train"], eval=streams["eval"])
