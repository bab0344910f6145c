"""Text datasets (the hub or local files, through `datasets`) -> flat token streams for training.

A token stream is every document's ids back to back, each document as `<s> ... </s>` (BOS from the
tokenizer's post-processor, EOS appended here), so the model learns where stories end and starts
from BOS exactly as a served prompt does. Training samples windows of it at random offsets.

    stream:  <s> once upon ... end . </s> <s> tom had ... </s> <s> ...
    window:          [----------- seq_len + 1 -----------]   -> inputs [:-1], targets [1:]
"""

from __future__ import annotations

import glob
import os
import socket
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

DEFAULT_HUB_DATASET = "roneneldan/TinyStories"
STORY_SEPARATOR = "\n\n\n"  # same as training.corpus.STORY_SEPARATOR: blank-line pair between stories
_LOCAL_EXTENSIONS = {".txt": "text", ".text": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
_HUB_PROBE_TIMEOUT_S = 3.0


class HubUnreachableError(RuntimeError):
    """The Hugging Face hub cannot be used (offline mode, or no connection)."""


@dataclass(slots=True)
class TokenSplits:
    train: np.ndarray  # (N_train,) uint16 or int32 token stream, EOS after every document
    eval: np.ndarray  # (N_eval,) the held-out stream, same layout

    def __post_init__(self) -> None:
        for name in ("train", "eval"):
            arr = getattr(self, name)
            if arr.ndim != 1 or len(arr) < 2:
                raise ValueError(f"{name} token stream must be 1-D with at least 2 tokens, got shape {arr.shape}")


def _offline_flag() -> str | None:
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        if os.environ.get(var, "").strip().lower() in ("1", "true", "yes", "on"):
            return var
    return None


def _hub_reachable(timeout: float) -> bool:
    """TCP connect to the hub endpoint within `timeout` (DNS included: the probe runs in a daemon
    thread, since getaddrinfo itself has no timeout)."""
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    host = endpoint.split("://", 1)[-1].split("/", 1)[0]
    host, _, port = host.partition(":")
    ok = [False]

    def probe() -> None:
        try:
            with socket.create_connection((host, int(port or 443)), timeout=timeout):
                ok[0] = True
        except OSError:
            pass

    t = threading.Thread(target=probe, daemon=True)
    t.start()
    t.join(timeout + 0.5)
    return ok[0]


def check_hub(source: str) -> None:
    """Raises HubUnreachableError at once (offline mode) or within ~3 s (no connection)."""
    hint = ("train offline instead: pass local files with `--data PATH [PATH ...]` (.txt, .jsonl, "
            ".parquet, folders or globs), or generate the bundled story corpus with "
            "`--generate-corpus N` (training.corpus.write_corpus)")
    flag = _offline_flag()
    if flag:
        raise HubUnreachableError(f"cannot load hub dataset {source!r}: {flag} is set; {hint}")
    if not _hub_reachable(_HUB_PROBE_TIMEOUT_S):
        raise HubUnreachableError(f"cannot load hub dataset {source!r}: the Hugging Face hub is not "
                                  f"reachable within {_HUB_PROBE_TIMEOUT_S:.0f} s; {hint}")


def local_files(source: str | os.PathLike[str] | Iterable[str | os.PathLike[str]]) -> list[Path] | None:
    """The files `source` names (files, folders, globs; one or several), or None when it names
    nothing local (then it is taken as a hub id)."""
    items = [source] if isinstance(source, (str, os.PathLike)) else list(source)
    files: list[Path] = []
    for item in items:
        s = str(item)
        if any(c in s for c in "*?["):
            matches = sorted(Path(m) for m in glob.glob(s, recursive=True))
        elif Path(s).is_dir():
            matches = sorted(p for p in Path(s).rglob("*") if p.suffix in _LOCAL_EXTENSIONS)
        elif Path(s).exists():
            matches = [Path(s)]
        else:
            return None if len(items) == 1 else _missing(s)
        files += [m for m in matches if m.is_file()]
    return files


def _missing(path: str) -> list[Path]:
    raise FileNotFoundError(f"no such data file or folder: {path}")


def load_text_dataset(source: str | os.PathLike[str] | Iterable[str | os.PathLike[str]] = DEFAULT_HUB_DATASET,
                      *, split: str = "train", text_field: str = "text", txt_mode: str = "separator",
                      cache_dir: str | None = None):
    """A `datasets.Dataset` with one document per row in column `text_field`.

    source: a hub id (default TinyStories), or local files / folders / globs. .txt files hold one
    document per STORY_SEPARATOR block (`txt_mode="separator"`) or per line (`txt_mode="line"`);
    .jsonl/.json and .parquet files hold `text_field`. A hub id fails fast with HubUnreachableError
    when offline. `split` applies to hub datasets (TinyStories has "train" and "validation").
    """
    import datasets  # heavy import, only when data is actually loaded

    if txt_mode not in ("separator", "line"):
        raise ValueError(f"txt_mode must be 'separator' or 'line', got {txt_mode!r}")
    files = local_files(source)
    if files is None:
        check_hub(str(source))
        return datasets.load_dataset(str(source), split=split, cache_dir=cache_dir)
    if not files:
        raise FileNotFoundError(f"{source} names no data files ({', '.join(_LOCAL_EXTENSIONS)})")
    kinds = {_LOCAL_EXTENSIONS.get(f.suffix) for f in files}
    if None in kinds or len(kinds) > 1:
        raise ValueError(f"data files must all be one of {sorted(_LOCAL_EXTENSIONS)}; got "
                         f"{sorted({f.suffix for f in files})}")
    kind = kinds.pop()
    data_files = [str(f) for f in files]
    if kind != "text":
        ds = datasets.load_dataset(kind, data_files=data_files, split="train", cache_dir=cache_dir)
        if text_field not in ds.column_names:
            raise ValueError(f"{source} has no field {text_field!r}; fields: {ds.column_names}")
        return ds
    if txt_mode == "line":
        ds = datasets.load_dataset("text", data_files=data_files, split="train", cache_dir=cache_dir)
    else:
        ds = datasets.load_dataset("text", data_files=data_files, split="train", sample_by="document",
                                   cache_dir=cache_dir)

        def split_docs(batch: dict[str, list[str]]) -> dict[str, list[str]]:
            return {text_field: [d.strip("\n") for text in batch["text"] for d in text.split(STORY_SEPARATOR)
                                 if d.strip()]}

        ds = ds.map(split_docs, batched=True, remove_columns=ds.column_names)
    if text_field != "text" and "text" in ds.column_names:
        ds = ds.rename_column("text", text_field)
    return ds.filter(lambda row: bool(row[text_field].strip()))


def iter_texts(ds, text_field: str = "text", limit: int | None = None) -> Iterator[str]:
    """Document texts of a dataset, the first `limit` of them when given (e.g. for the tokenizer)."""
    n = len(ds) if limit is None else min(limit, len(ds))
    for start in range(0, n, 1000):
        yield from ds[start:min(start + 1000, n)][text_field]


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


def prepare_tokens(train_ds, tokenizer, *, eos_id: int, eval_ds=None, text_field: str = "text",
                   eval_fraction: float = 0.01, seed: int = 0, save_dir: str | os.PathLike[str] | None = None,
                   ) -> TokenSplits:
    """Tokenizes the datasets into TokenSplits. Without `eval_ds`, `eval_fraction` of the training
    documents (shuffled with `seed`, at least one) are held out. With `save_dir` the streams are
    written as train.npy / eval.npy and returned memory-mapped."""
    if eval_ds is None:
        if len(train_ds) < 2:
            raise ValueError("need at least 2 documents to hold one out for evaluation")
        n_eval = max(1, int(round(len(train_ds) * eval_fraction)))
        parts = train_ds.train_test_split(test_size=n_eval, seed=seed)
        train_ds, eval_ds = parts["train"], parts["test"]
    streams = {name: tokenize_texts(iter_texts(ds, text_field), tokenizer, eos_id=eos_id)
               for name, ds in (("train", train_ds), ("eval", eval_ds))}
    if save_dir is not None:
        Path(save_dir).mkdir(parents=True, exist_ok=True)
        for name, arr in streams.items():
            np.save(Path(save_dir) / f"{name}.npy", arr)
        streams = {name: np.load(Path(save_dir) / f"{name}.npy", mmap_mode="r") for name in streams}
    return TokenSplits(train=streams["train"], eval=streams["eval"])
