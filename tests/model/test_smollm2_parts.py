"""tests/smollm2.py's transport of the GGUF to the GPU machine: `--split` writes it in parts
small enough for one device call each, and `--gguf DIR` joins them in number order (part-10 after
part-9) and refuses a whole that is not the file (a part missing or out of order)."""

from __future__ import annotations

import hashlib
import random

import pytest

from tests import smollm2


def test_parts_join_back_into_the_file_and_nothing_else(tmp_path, monkeypatch, rng: random.Random):
    data = rng.randbytes(10_500)
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(data)
    monkeypatch.setattr(smollm2, "GGUF_SHA256", hashlib.sha256(data).hexdigest())
    parts = smollm2.split(gguf, tmp_path / "parts", part_mb=0.001)  # 1,000 bytes a part
    assert [p.name for p in parts] == [f"part-{i}" for i in range(1, 12)]
    assert max(p.stat().st_size for p in parts) == 1_000
    work = tmp_path / "work"
    work.mkdir()
    assert smollm2._local_gguf(tmp_path / "parts", work).read_bytes() == data
    assert smollm2._local_gguf(gguf, work) == gguf
    parts[4].unlink()
    with pytest.raises(RuntimeError, match="SHA-256"):
        smollm2._local_gguf(tmp_path / "parts", work)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(RuntimeError, match="no part-N"):
        smollm2._local_gguf(empty, work)
