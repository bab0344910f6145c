"""Tokenizer wrapper: round trips, BOS handling, special ids, and where EOS ids come from."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer as RawTokenizer

from pie.model.config import ModelConfig
from pie.model.tokenizer import Tokenizer, TooManyTokens
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

    from pie.model.tokenizer import GIL_FREE_ENCODE_CHARS, TooManyTokens

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


# ---- the byte-length lower bound (refusing long prompts without tokenizing them) -------------------
def _bpe(*, pre, normalizer=None, byte_fallback=False, unk=None, fuse_unk=False, special=("<s>", "</s>"),
         alphabet=None):
    """A small BPE tokenizer of each kind the server may load: trained here, saved as tokenizer.json."""
    from tokenizers import Tokenizer as Raw
    from tokenizers import models, pre_tokenizers, trainers

    raw = Raw(models.BPE(unk_token=unk, byte_fallback=byte_fallback, fuse_unk=fuse_unk))
    raw.normalizer = normalizer
    raw.pre_tokenizer = pre
    if alphabet is None:
        alphabet = pre_tokenizers.ByteLevel.alphabet() if isinstance(pre, pre_tokenizers.ByteLevel) else []
    if byte_fallback:  # Llama-2 / Mistral style: <0x00>..<0xFF> pieces for bytes outside the vocabulary
        special = (*special, *(f"<0x{b:02X}>" for b in range(256)))
    raw.train_from_iterator(sample_sentences(), trainers.BpeTrainer(
        vocab_size=600, special_tokens=[*special, *([unk] if unk else [])], initial_alphabet=alphabet,
        show_progress=False))
    return raw


def _kinds():
    from tokenizers import normalizers, pre_tokenizers

    return {
        "byte-level": _bpe(pre=pre_tokenizers.ByteLevel(add_prefix_space=False)),
        "byte-level-nfc": _bpe(pre=pre_tokenizers.ByteLevel(add_prefix_space=False), normalizer=normalizers.NFC()),
        "metaspace-byte-fallback": _bpe(pre=pre_tokenizers.Metaspace(), byte_fallback=True,
                                        normalizer=normalizers.NFKC()),
        "split-digits": _bpe(pre=pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                          pre_tokenizers.ByteLevel(add_prefix_space=False)]),
                             alphabet=pre_tokenizers.ByteLevel.alphabet()),
        "unk-per-character": _bpe(pre=pre_tokenizers.Metaspace(), unk="<unk>"),
    }


HARD_TEXTS = [
    "a " * 300,
    "e\u0301" * 200 + "\u1100\u1161\u11a8" * 100,  # decomposed accents and jamo: NFC/NFKC shrink them
    "\ufb03" * 100 + "\u3392" * 50,  # ligatures and squared units: NFKC expands them
    "😀🚀👍🏽" * 80,
    "1234567890" * 60,
    "\x00\x01\x7f" * 100 + "<s></s>" * 30,
    "",
]


@pytest.mark.parametrize("kind", list(_kinds()))
def test_min_tokens_never_exceeds_the_count(tmp_path, rng, kind):
    """The bound the server refuses by must hold on every text: fixed hard cases (normalization that
    shrinks or grows text, emoji, digits split one by one, control characters, special tokens in the
    text) and random unicode drawn per run."""
    raw = _kinds()[kind]
    (tmp_path / "tokenizer.json").write_text(raw.to_str())
    tok = Tokenizer.from_pretrained(tmp_path)
    assert tok.max_token_bytes is not None and tok.max_token_bytes >= 1
    alphabet = [chr(c) for c in (*range(32, 127), 0xE9, 0x301, 0x4E00, 0x1F600, 0xFB03, 0x1100, 0x1161, 0xA)]
    random_texts = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 400))) for _ in range(30)]
    for text in HARD_TEXTS + random_texts:
        count = len(tok.encode(text, add_special_tokens=False))
        assert tok.min_tokens(text) <= count, (kind, text[:40])
        if count:
            with pytest.raises(TooManyTokens) as err:
                tok.encode(text, max_tokens=count - 1)
            assert err.value.count <= count + 1  # exact (BOS included), or a lower bound


def test_min_tokens_is_off_where_a_token_can_stand_for_any_length(tmp_path):
    """Tokenizers that drop characters (whitespace splitting), fuse unknown runs into one token, or
    map a whole unknown word to one token allow no bound: those texts are tokenized to be counted."""
    from tokenizers import Tokenizer as Raw
    from tokenizers import models, pre_tokenizers

    cases = {
        "whitespace": _bpe(pre=pre_tokenizers.WhitespaceSplit()),
        # BPE silently drops a character it has no piece for: digits never trained here
        "drops-unknown": _bpe(pre=pre_tokenizers.Metaspace()),
        "fused-unk": _bpe(pre=pre_tokenizers.Metaspace(), unk="<unk>", fuse_unk=True),
        "wordpiece": Raw(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]")),
    }
    for name, raw in cases.items():
        if name == "wordpiece":
            raw.pre_tokenizer = pre_tokenizers.Whitespace()
        folder = tmp_path / name
        folder.mkdir()
        (folder / "tokenizer.json").write_text(raw.to_str())
        tok = Tokenizer.from_pretrained(folder)
        assert tok.max_token_bytes is None, name
        assert tok.min_tokens(" " * 10_000) == 0
    # 1,000 digits it has no pieces for: the Metaspace prefix alone, far fewer tokens than bytes
    assert len(Tokenizer.from_pretrained(tmp_path / "drops-unknown").encode(
        "1234567890" * 100, add_special_tokens=False, max_tokens=5)) <= 1
    # 10,000 spaces are 0 tokens to a whitespace splitter: refused by count, not by length
    assert Tokenizer.from_pretrained(tmp_path / "whitespace").encode(" " * 10_000, add_special_tokens=False,
                                                                     max_tokens=5) == []


def test_a_long_text_is_refused_from_its_length_alone(tok_dir, monkeypatch):
    """1M characters against a 512-token limit: refused as 'at least N' without a tokenization."""
    tok = Tokenizer.from_pretrained(tok_dir)
    text = "once upon a time " * 60_000

    def no_tokenizing(*args, **kwargs):
        raise AssertionError("tokenized a text its length already refuses")

    monkeypatch.setattr(tok, "backend", _NoEncode(tok.backend, no_tokenizing))
    with pytest.raises(TooManyTokens) as err:
        tok.encode(text, max_tokens=511)
    assert err.value.at_least and err.value.count > 511
    assert str(err.value).startswith("at least ")


class _NoEncode:
    """A tokenizers.Tokenizer stand-in whose encode calls fail; everything else passes through."""

    def __init__(self, backend, fail) -> None:
        self._backend = backend
        self.encode = self.encode_batch_fast = self.encode_batch = fail

    def __getattr__(self, name):
        return getattr(self._backend, name)
