"""The bundled default model: what `pie serve` serves with no argument."""

from __future__ import annotations

from pathlib import Path

import pytest

from pie.engine.config import DEFAULT_MODEL, EngineConfig
from pie.service.server import BackgroundServer, ServerConfig
from pie_client import Client

# slow: starts a BackgroundServer on the bundled model
pytestmark = pytest.mark.slow


def test_bundled_model_is_the_default_and_writes_stories():
    assert EngineConfig().model == DEFAULT_MODEL
    folder = Path(DEFAULT_MODEL)
    assert (folder / "model.safetensors").stat().st_size <= 20 * 2**20
    assert {"config.json", "tokenizer.json", "generation_config.json", "README.md"} <= {p.name for p in folder.iterdir()}
    cfg = EngineConfig(device="cpu", num_kv_blocks=64)
    with BackgroundServer(ServerConfig(port=0, grace_s=1), cfg) as s, Client(s.address, timeout=120) as c:
        info = c.model_info()
        assert info.model_name == "stories-7m" and info.kv_cache_dtype == "int8"
        out = c.generate("Once upon a time, there was a little girl named Lily.", max_tokens=48, temperature=0)
        words = out.text.split()
        assert len(words) >= 20 and sum(w.strip('.,!?"').isalpha() for w in words) >= 0.8 * len(words)
        streamed = "".join(d.text for d in c.stream("One sunny day,", max_tokens=32, temperature=0.8, seed=3))
        assert streamed == c.generate("One sunny day,", max_tokens=32, temperature=0.8, seed=3).text
