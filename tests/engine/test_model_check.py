"""Start-up checks of a model folder (engine/model_check.py): each way a folder cannot be served is
one StartupError naming the path and the fix; the notes logged at start say what is odd about a
folder that can be served."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pie.engine.config import EngineConfig
from pie.engine.core.engine_core import EngineCore
from pie.engine.errors import StartupError
from pie.engine.model_check import (
    FOLDER_HINT,
    check_vocab,
    check_weights_present,
    has_chat_template,
    model_notes,
    read_model_config,
    read_tokenizer,
)
from tests.helpers import make_hf_model_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_hf_model_dir(tmp_path_factory.mktemp("check"), "llama")


def _copy(src: Path, dst: Path, *, config: dict | None = None, drop: tuple[str, ...] = ()) -> Path:
    """A copy of model folder `src` at `dst`, its config.json's fields updated with `config`,
    without the files named in `drop`."""
    dst.mkdir()
    for file in src.iterdir():
        if file.name not in drop:
            (dst / file.name).write_bytes(file.read_bytes())
    if config is not None:
        raw = json.loads((dst / "config.json").read_text())
        (dst / "config.json").write_text(json.dumps({**raw, **config}))
    return dst


def _refusal(path: Path) -> str:
    with pytest.raises(StartupError) as err:
        read_model_config(str(path))
    return str(err.value)


def test_folders_that_cannot_be_read_are_refused_naming_the_path(model_dir, tmp_path):
    missing = tmp_path / "nope"
    assert _refusal(missing) == f"--model {missing}: no such folder; {FOLDER_HINT}"
    assert _refusal(model_dir / "config.json") == f"--model {model_dir / 'config.json'} is a file; {FOLDER_HINT} " \
                                                 "(the folder, not a file in it)"
    empty = tmp_path / "empty"
    empty.mkdir()
    assert _refusal(empty) == f"--model {empty}: the folder has no config.json; {FOLDER_HINT}"
    broken = _copy(model_dir, tmp_path / "broken")
    (broken / "config.json").write_text('{"model_type": "llama",')
    assert _refusal(broken).startswith(f"--model {broken}: config.json is not valid JSON (Expecting property name")
    listed = _copy(model_dir, tmp_path / "listed")
    (listed / "config.json").write_text("[1, 2]")
    assert _refusal(listed) == f"--model {listed}: config.json holds list, not a JSON object"


def test_unsupported_architectures_and_incomplete_configs_are_refused(model_dir, tmp_path):
    gpt2 = _copy(model_dir, tmp_path / "gpt2", config={"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})
    assert _refusal(gpt2) == (f"--model {gpt2}: config.json: unsupported model_type 'gpt2'; supported: llama, "
                              "mistral, qwen2, qwen3")
    raw = json.loads((model_dir / "config.json").read_text())
    del raw["hidden_size"]
    headless = _copy(model_dir, tmp_path / "headless")
    (headless / "config.json").write_text(json.dumps(raw))
    assert _refusal(headless) == (f"--model {headless}: config.json has no 'hidden_size'; it is not a decoder's "
                                  "config (pie serves Llama, Mistral, Qwen2 and Qwen3)")


def test_weights_and_tokenizer_must_be_there(model_dir, tmp_path):
    check_weights_present(str(model_dir))
    no_weights = _copy(model_dir, tmp_path / "no-weights", drop=("model.safetensors",))
    (no_weights / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(StartupError, match=r"no model.safetensors or model.safetensors.index.json \(found "
                                           r"pytorch_model.bin: only safetensors are read\)"):
        check_weights_present(str(no_weights))
    mc = read_model_config(str(model_dir))
    no_tokenizer = _copy(model_dir, tmp_path / "no-tokenizer", drop=("tokenizer.json",))
    with pytest.raises(StartupError, match=r"^--model .*no-tokenizer: no tokenizer.json \(only fast-tokenizer"):
        read_tokenizer(str(no_tokenizer), mc)
    garbled = _copy(model_dir, tmp_path / "garbled")
    (garbled / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "Nothing"}}')
    with pytest.raises(StartupError, match=r"^--model .*garbled: tokenizer.json cannot be loaded \("):
        read_tokenizer(str(garbled), mc)


def test_a_tokenizer_larger_than_the_embedding_is_refused(tmp_path):
    # a byte-level BPE has at least 256 + 3 ids; this model's embedding has 128 rows
    small = make_hf_model_dir(tmp_path, "llama", vocab_size=128)
    mc = read_model_config(str(small))
    tokenizer = read_tokenizer(str(small), mc)
    assert tokenizer.vocab_size > 128
    with pytest.raises(StartupError) as err:
        check_vocab(str(small), mc, tokenizer)
    assert str(err.value) == (
        f"--model {small}: the tokenizer has {tokenizer.vocab_size} ids (tokenizer.json, added tokens included) but "
        "the model's embedding only 128 rows (config.json vocab_size): ids past them would index out of the "
        "embedding; use the tokenizer that came with the model")
    with pytest.raises(StartupError, match="the model's embedding only 128 rows"):  # the engine refuses it too
        EngineCore(EngineConfig(model=str(small), device="cpu", kv_cache_dtype="fp32", num_kv_blocks=8))


def _notes(path: Path) -> dict[str, tuple[str, dict]]:
    mc = read_model_config(str(path))
    tokenizer = read_tokenizer(str(path), mc)
    check_vocab(str(path), mc, tokenizer)
    return {n.event: (n.level, n.fields) for n in model_notes(str(path), mc, tokenizer)}


def test_notes_no_eos_a_much_larger_vocabulary_and_no_chat_template(model_dir, tmp_path):
    # the tiny folder: an embedding of 512 rows over a tokenizer of a few hundred ids (padding: no note)
    assert _notes(model_dir) == {"model_has_no_chat_template": ("info", {"hint": (
        "no chat_template in tokenizer_config.json and no chat_template.jinja: likely a base model; prompts reach "
        "it as sent, and chat requests are refused (or give --chat-template FILE)")})}
    templated = _copy(model_dir, tmp_path / "templated")
    (templated / "chat_template.jinja").write_text("{{ messages }}")
    assert has_chat_template(str(templated)) and _notes(templated) == {}
    # A template that does not compile: a warning with the compiler's words.
    (templated / "chat_template.jinja").write_text("{% for m in messages %}{{ m")
    level, fields = _notes(templated)["model_chat_template_unusable"]
    assert level == "warning" and "does not compile" in fields["error"]
    mc = read_model_config(str(model_dir))
    tokenizer = read_tokenizer(str(model_dir), mc)
    assert model_notes(str(model_dir), mc, tokenizer, chat_template="t.jinja") == []  # --chat-template: no note
    in_config = _copy(model_dir, tmp_path / "in-config")
    tok_cfg = json.loads((in_config / "tokenizer_config.json").read_text())
    (in_config / "tokenizer_config.json").write_text(json.dumps({**tok_cfg, "chat_template": "{{ messages }}"}))
    assert has_chat_template(str(in_config))

    no_eos = _copy(model_dir, tmp_path / "no-eos", config={"eos_token_id": None})
    (no_eos / "generation_config.json").write_text(json.dumps({"bos_token_id": 1}))
    (no_eos / "tokenizer_config.json").write_text(json.dumps({k: v for k, v in tok_cfg.items() if k != "eos_token"}))
    level, fields = _notes(no_eos)["model_has_no_eos"]
    assert level == "warning" and "generation stops only at max_tokens" in fields["hint"]

    wide = make_hf_model_dir(tmp_path, "llama", vocab_size=4096)  # the tokenizer has at most 512 ids
    level, fields = _notes(wide)["model_vocab_exceeds_tokenizer"]
    assert level == "warning" and fields["model_vocab_size"] == 4096 and fields["tokenizer_vocab_size"] <= 512
