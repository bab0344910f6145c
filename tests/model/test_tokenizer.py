"""Tokenizer wrapper: round trips, BOS handling, special ids, and where EOS ids come from."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer as RawTokenizer

from model import ModelConfig, Tokenizer
from tests.helpers import BOS_ID, EOS_ID, PAD_ID, make_hf_model_dir, sample_sentences, write_tokenizer

TEXTS = [
    "Hello world",
    "Un café très naïve à Paris.",
    "日本語のテキスト、東京",
    "emoji 😀🚀 and skin tone 👍🏽 ok",
    "  leading spaces\nand a newline\t tab",
    "",
]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return write_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip_with_multibyte_utf8(tok_dir, text):
    tok = Tokenizer.from_pretrained(tok_dir)
    ids = tok.encode(text)
    assert ids[0] == BOS_ID  # added by the tokenizer.json post-processor
    assert tok.decode(ids) == text
    assert tok.encode(text, add_special_tokens=False) == ids[1:]
    assert tok.decode(ids, skip_special_tokens=False).startswith("<s>")


def test_matches_transformers_autotokenizer(tok_dir):
    import transformers

    hf = transformers.AutoTokenizer.from_pretrained(tok_dir)
    tok = Tokenizer.from_pretrained(tok_dir)
    for text in TEXTS + sample_sentences(20, seed=7):
        assert tok.encode(text) == hf(text)["input_ids"]


def test_vocab_and_special_ids(tok_dir):
    tok = Tokenizer.from_pretrained(tok_dir)
    raw = RawTokenizer.from_file(str(tok_dir / "tokenizer.json"))
    assert tok.vocab_size == raw.get_vocab_size(with_added_tokens=True) <= 512
    assert tok.all_special_ids == (PAD_ID, BOS_ID, EOS_ID)
    assert tok.id_to_token(EOS_ID) == "</s>" and tok.id_to_token(10**6) is None
    assert tok.convert_ids_to_tokens([BOS_ID, PAD_ID]) == ["<s>", "<pad>"]
    assert tok.bos_token_id == BOS_ID
    assert tok.eos_token_ids == (EOS_ID,)  # tokenizer_config.json's eos_token: nothing else is there


def test_eos_ids_from_generation_config_first(tmp_path):
    path = make_hf_model_dir(tmp_path, "qwen2", generation_eos=[EOS_ID, 7])
    assert Tokenizer.from_pretrained(path).eos_token_ids == (EOS_ID, 7)
    cfg = ModelConfig.from_hf(path)
    assert Tokenizer.from_pretrained(path, cfg).eos_token_ids == (EOS_ID, 7)


def test_eos_ids_fall_back_to_config_json(tmp_path):
    path = make_hf_model_dir(tmp_path, "llama", eos_token_id=[5, 6])
    (path / "generation_config.json").unlink()
    assert Tokenizer.from_pretrained(path).eos_token_ids == (5, 6)
    assert Tokenizer.from_pretrained(path, ModelConfig.from_hf(path)).eos_token_ids == (5, 6)


def _without_post_processor(path, add_bos_token: bool):
    spec = json.loads((path / "tokenizer.json").read_text())
    spec["post_processor"] = None
    (path / "tokenizer.json").write_text(json.dumps(spec))
    tok_cfg = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**tok_cfg, "add_bos_token": add_bos_token}))


def test_add_bos_token_prepends_when_post_processor_does_not(tmp_path):
    path = write_tokenizer(tmp_path / "tok")
    _without_post_processor(path, add_bos_token=True)
    tok = Tokenizer.from_pretrained(path)
    assert tok.encode("hello")[0] == BOS_ID and tok.encode("hello")[1:] == tok.encode("hello", False)
    assert tok.encode("") == [BOS_ID]
    _without_post_processor(path, add_bos_token=False)
    assert Tokenizer.from_pretrained(path).encode("hello")[0] != BOS_ID


def test_add_bos_token_does_not_double_bos(tmp_path):
    path = write_tokenizer(tmp_path / "tok")
    tok_cfg = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**tok_cfg, "add_bos_token": True}))
    ids = Tokenizer.from_pretrained(path).encode("hello")
    assert ids[0] == BOS_ID and ids[1] != BOS_ID


def test_missing_tokenizer_json_is_a_clear_error(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="no tokenizer.json in"):
        Tokenizer.from_pretrained(tmp_path)


@pytest.mark.parametrize("prepend_bos", [False, True])
def test_long_texts_and_the_token_limit(rng, tmp_path, prepend_bos):
    """Texts past the GIL-free threshold take another tokenizers call: the same ids either way,
    BOS handling included; `max_tokens` refuses a longer text with its exact count."""

    from model import TooManyTokens
    from model.tokenizer import GIL_FREE_ENCODE_CHARS

    path = write_tokenizer(tmp_path / "tok")
    if prepend_bos:
        _without_post_processor(path, add_bos_token=True)
    tok = Tokenizer.from_pretrained(path)
    raw = RawTokenizer.from_file(str(path / "tokenizer.json"))
    sentences = sample_sentences(200, seed=rng.randrange(2**31))
    text = " ".join(sentences)
    while len(text) <= GIL_FREE_ENCODE_CHARS:
        text += " " + text
    for add in (True, False):
        want = raw.encode(text, add_special_tokens=add).ids
        if add and prepend_bos:
            want = [BOS_ID, *want]
        assert tok.encode(text, add) == want
        assert tok.encode(text, add, max_tokens=len(want)) == want
        with pytest.raises(TooManyTokens) as err:
            tok.encode(text, add, max_tokens=len(want) - 1)
        assert err.value.count == len(want)
        short = sentences[0]
        assert len(short) <= GIL_FREE_ENCODE_CHARS
        with pytest.raises(TooManyTokens):
            tok.encode(short, add, max_tokens=0)
