"""Where training documents come from: local files, read with the standard library, or a hub dataset.

    load_documents("runs/stories/corpus")                  # .txt/.jsonl/.json/.parquet files, folders, globs
    load_documents("roneneldan/TinyStories", split="validation")   # the hub, through `datasets`

Local .txt and .jsonl files need nothing beyond a plain install; .parquet needs pyarrow and a hub id
needs `datasets` (both come with the `train` extra), imported only when such a source is loaded. A
missing one raises MissingExtraError, whose message says what to install.

Local documents are held in memory as Python strings (DocumentList); a hub dataset stays in the
memory-mapped Arrow table `datasets` keeps (HubDocuments). Both are read through `Documents`.
"""

from __future__ import annotations

import glob
import json
import os
import socket
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

DEFAULT_HUB_DATASET = "roneneldan/TinyStories"
STORY_SEPARATOR = "\n\n\n"  # same as training.corpus.STORY_SEPARATOR: blank-line pair between stories
TXT_MODES = ("separator", "line")
_LOCAL_EXTENSIONS = {".txt": "text", ".text": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
_HUB_PROBE_TIMEOUT_S = 3.0
INSTALL_TRAIN_EXTRA = "pip install -e '.[train]' in a checkout, or pip install 'pie[train]'"


class HubUnreachableError(RuntimeError):
    """The Hugging Face hub cannot be used (offline mode, or no connection)."""


class MissingExtraError(RuntimeError):
    """A source needs a package that a plain install leaves out; the message says what to install."""


class Documents(Protocol):
    """Documents in a fixed order, one text each."""

    def __len__(self) -> int: ...

    def texts(self, start: int = 0, stop: int | None = None) -> list[str]:
        """Documents [start, stop) (stop None: to the end)."""
        ...

    def select(self, indices: Sequence[int]) -> Documents:
        """The documents at `indices`, in that order."""
        ...


@dataclass(frozen=True, slots=True)
class DocumentList:
    """Documents held in memory (local files)."""

    items: list[str]

    def __len__(self) -> int:
        return len(self.items)

    def texts(self, start: int = 0, stop: int | None = None) -> list[str]:
        return self.items[start:stop]

    def select(self, indices: Sequence[int]) -> DocumentList:
        return DocumentList([self.items[i] for i in indices])


@dataclass(frozen=True, slots=True)
class HubDocuments:
    """Column `text_field` of a `datasets.Dataset` (Arrow, memory-mapped: never copied whole)."""

    dataset: Any  # datasets.Dataset; typed loosely so that this module never imports `datasets`
    text_field: str

    def __len__(self) -> int:
        return len(self.dataset)

    def texts(self, start: int = 0, stop: int | None = None) -> list[str]:
        stop = len(self) if stop is None else min(stop, len(self))
        return list(self.dataset[start:stop][self.text_field]) if start < stop else []

    def select(self, indices: Sequence[int]) -> HubDocuments:
        return HubDocuments(self.dataset.select(indices), self.text_field)


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


def _import_extra(module: str, needed_for: str) -> Any:
    """`import module`, or MissingExtraError naming the extra that brings it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise MissingExtraError(f"{needed_for} needs the `{module.split('.')[0]}` package, which a plain "
                                f"install leaves out ({e}): {INSTALL_TRAIN_EXTRA}") from e


def local_files(source: str | os.PathLike[str] | Iterable[str | os.PathLike[str]]) -> list[Path] | None:
    """The files `source` names (files, folders, globs; one or several), or None when it is one name
    of nothing local that could be a hub id (`owner/name`)."""
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
        elif len(items) == 1 and _could_be_hub_id(s):
            return None
        else:
            raise FileNotFoundError(f"no such data file or folder: {s}")
        files += [m for m in matches if m.is_file()]
    return files


def _could_be_hub_id(name: str) -> bool:
    """`name` or `owner/name`: not a path (a typo in one should not send the user to the hub)."""
    return (name.count("/") <= 1 and "\\" not in name and not name.startswith((".", "/", "~"))
            and Path(name).suffix not in _LOCAL_EXTENSIONS)


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not UTF-8 text ({e})") from e


def _txt_documents(path: Path, txt_mode: str) -> list[str]:
    text = _read_text(path)
    if txt_mode == "line":
        return [line for line in text.splitlines() if line.strip()]
    return [doc.strip("\n") for doc in text.split(STORY_SEPARATOR) if doc.strip()]


def _json(text: str, where: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where} is not valid JSON ({e})") from e


def _row_text(row: Any, text_field: str, where: str) -> str | None:
    if not isinstance(row, dict):
        raise ValueError(f"{where} is a JSON {type(row).__name__}, not an object holding {text_field!r}")
    if text_field not in row:
        raise ValueError(f"{where} has no field {text_field!r}; fields: {sorted(row)}")
    value = row[text_field]
    if value is not None and not isinstance(value, str):
        raise ValueError(f"{where}: field {text_field!r} holds {type(value).__name__}, not text")
    return value


def _json_documents(path: Path, text_field: str) -> list[str]:
    """JSON Lines (one object per line), or one JSON array of objects."""
    text = _read_text(path)
    if text.lstrip().startswith("["):
        rows = [(f"{path} row {i}", row) for i, row in enumerate(_json(text, str(path)))]
    else:
        rows = [(f"{path}:{n}", _json(line, f"{path}:{n}")) for n, line in enumerate(text.splitlines(), 1)
                if line.strip()]
    values = (_row_text(row, text_field, where) for where, row in rows)
    return [v for v in values if v and v.strip()]


def _parquet_documents(path: Path, text_field: str) -> list[str]:
    pq = _import_extra("pyarrow.parquet", f"reading {path}")
    names = pq.read_schema(path).names
    if text_field not in names:
        raise ValueError(f"{path} has no field {text_field!r}; fields: {sorted(names)}")
    values = pq.read_table(path, columns=[text_field]).column(text_field).to_pylist()
    return [v for v in values if v and v.strip()]


def load_documents(source: str | os.PathLike[str] | Iterable[str | os.PathLike[str]] = DEFAULT_HUB_DATASET,
                   *, split: str = "train", text_field: str = "text", txt_mode: str = "separator",
                   cache_dir: str | None = None) -> Documents:
    """The documents of `source`: a hub id (default TinyStories), or local files / folders / globs.

    .txt files hold one document per STORY_SEPARATOR block (`txt_mode="separator"`) or per line
    (`txt_mode="line"`); .jsonl/.json and .parquet files hold `text_field`; blank documents are
    dropped. `split` and `cache_dir` apply to hub datasets (TinyStories has "train" and
    "validation"). A hub id fails fast with HubUnreachableError when offline.
    """
    if txt_mode not in TXT_MODES:
        raise ValueError(f"txt_mode must be one of {TXT_MODES}, got {txt_mode!r}")
    files = local_files(source)
    if files is None:
        return _hub_documents(str(source), split=split, text_field=text_field, cache_dir=cache_dir)
    if not files:
        raise FileNotFoundError(f"{source} names no data files ({', '.join(_LOCAL_EXTENSIONS)})")
    kinds = {_LOCAL_EXTENSIONS.get(f.suffix) for f in files}
    if None in kinds or len(kinds) > 1:
        raise ValueError(f"data files must all be one of {sorted(_LOCAL_EXTENSIONS)}; got "
                         f"{sorted({f.suffix for f in files})}")
    kind = kinds.pop()
    docs: list[str] = []
    for f in files:
        if kind == "text":
            docs += _txt_documents(f, txt_mode)
        elif kind == "json":
            docs += _json_documents(f, text_field)
        else:
            docs += _parquet_documents(f, text_field)
    return DocumentList(docs)


def _hub_documents(source: str, *, split: str, text_field: str, cache_dir: str | None) -> HubDocuments:
    datasets = _import_extra("datasets", f"loading the hub dataset {source!r}")
    check_hub(source)
    ds = datasets.load_dataset(source, split=split, cache_dir=cache_dir)
    if text_field not in ds.column_names:
        raise ValueError(f"hub dataset {source!r} has no field {text_field!r}; fields: {ds.column_names}")
    return HubDocuments(ds, text_field)
