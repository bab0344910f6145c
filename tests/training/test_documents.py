"""Documents from local files (standard library; pyarrow for .parquet) and the hub (`datasets`)."""

import json
import sys
import time

import pytest

from pie.training.data import hold_out, iter_texts
from pie.training.documents import (
    STORY_SEPARATOR,
    DocumentList,
    HubUnreachableError,
    MissingExtraError,
    load_documents,
)


@pytest.fixture
def no_extras(monkeypatch):
    """What a plain `pip install -e .` lacks: importing these fails as if they were not installed."""
    for name in ("datasets", "pyarrow", "pyarrow.parquet"):
        monkeypatch.setitem(sys.modules, name, None)


def test_txt_documents_split_on_separator_or_line(tmp_path):
    f = tmp_path / "s.txt"
    f.write_text("first story\nline two" + STORY_SEPARATOR + "second" + STORY_SEPARATOR + "\n \n" + STORY_SEPARATOR
                 + "third\n")
    assert load_documents(str(f)).texts() == ["first story\nline two", "second", "third"]
    assert load_documents(str(f), txt_mode="line").texts() == ["first story", "line two", "second", "third"]


def test_json_lines_and_json_arrays_hold_the_text_field(tmp_path):
    lines = tmp_path / "d.jsonl"
    lines.write_text(json.dumps({"story": "a b", "n": 1}) + "\n\n" + json.dumps({"story": ""}) + "\n"
                     + json.dumps({"story": None}) + "\n" + json.dumps({"story": "c"}) + "\n")
    array = tmp_path / "e.json"
    array.write_text(json.dumps([{"story": "d"}, {"story": "e f"}]))
    assert load_documents(str(lines), text_field="story").texts() == ["a b", "c"]
    assert load_documents([lines, array], text_field="story").texts() == ["a b", "c", "d", "e f"]
    with pytest.raises(ValueError, match=r"d\.jsonl:1 has no field 'text'; fields: \['n', 'story'\]"):
        load_documents(str(lines))
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "ok"}) + "\n{oops\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl:2 is not valid JSON"):
        load_documents(str(bad))
    bad.write_text(json.dumps({"text": 3}) + "\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl:1: field 'text' holds int, not text"):
        load_documents(str(bad))


def test_parquet_reads_the_text_column(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"text": ["one", "", "two three", None], "id": [1, 2, 3, 4]}), path)
    assert load_documents(str(path)).texts() == ["one", "two three"]
    with pytest.raises(ValueError, match=r"has no field 'story'; fields: \['id', 'text'\]"):
        load_documents(str(path), text_field="story")


def test_txt_and_jsonl_need_no_extras_and_the_rest_says_what_to_install(tmp_path, no_extras):
    (tmp_path / "a.txt").write_text("one" + STORY_SEPARATOR + "two\n")
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "three"}) + "\n")
    assert load_documents(tmp_path / "a.txt").texts() == ["one", "two"]
    assert load_documents(tmp_path / "b.jsonl").texts() == ["three"]
    (tmp_path / "c.parquet").write_bytes(b"PAR1")
    with pytest.raises(MissingExtraError, match=r"needs the `pyarrow` package.*pip install -e '\.\[train\]'"):
        load_documents(tmp_path / "c.parquet")
    with pytest.raises(MissingExtraError, match=r"hub dataset 'roneneldan/TinyStories' needs the `datasets` "
                                                r"package.*pip install -e '\.\[train\]'"):
        load_documents("roneneldan/TinyStories")


def test_folders_and_globs_and_missing_files(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.txt").write_text("b\n")
    (tmp_path / "a.txt").write_text("a\n")
    (tmp_path / "notes.md").write_text("not data\n")
    assert load_documents(tmp_path).texts() == ["a", "b"]
    assert load_documents(str(tmp_path / "**" / "*.txt")).texts() == ["a", "b"]
    for missing in ([tmp_path / "a.txt", tmp_path / "gone.txt"], tmp_path / "gone", "gone.jsonl", "runs/x/corpus"):
        with pytest.raises(FileNotFoundError, match="no such data file or folder"):
            load_documents(missing)  # a path, not a hub id: no hub (or `datasets`) involved
    with pytest.raises(ValueError, match="must all be one of"):
        load_documents([tmp_path / "a.txt", tmp_path / "notes.md"])


def test_hub_unreachable_fails_fast_with_offline_hint(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    t0 = time.perf_counter()
    with pytest.raises(HubUnreachableError, match="--data PATH.*--generate-corpus"):
        load_documents("roneneldan/TinyStories")
    assert time.perf_counter() - t0 < 10  # the `datasets` import included


def test_hold_out_is_seeded_disjoint_and_keeps_order():
    docs = DocumentList([f"d{i}" for i in range(50)])
    train, held = hold_out(docs, 5, seed=3)
    assert len(held) == 5 and len(train) == 45
    assert sorted(train.texts() + held.texts(), key=lambda d: int(d[1:])) == docs.texts()
    for part in (train, held):
        assert part.texts() == sorted(part.texts(), key=lambda d: int(d[1:]))
    assert hold_out(docs, 5, seed=3)[1].texts() == held.texts()
    assert hold_out(docs, 5, seed=4)[1].texts() != held.texts()
    with pytest.raises(ValueError, match="at least 2 documents"):
        hold_out(DocumentList(["only"]), 1, seed=0)


def test_iter_texts_reads_in_batches_up_to_the_limit():
    docs = DocumentList([str(i) for i in range(2500)])
    assert list(iter_texts(docs)) == docs.texts()
    assert list(iter_texts(docs, limit=1234)) == docs.texts(0, 1234)
