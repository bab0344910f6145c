"""Incremental detokenizer tests against a small byte-level BPE trained here: the concatenated
deltas equal one full decode, split characters never leak U+FFFD, stop strings are cut exactly."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from pie.engine.scheduling.detokenizer import IncrementalDetokenizer

WORDS = ("the cat sat on a mat while café naïve 日本語 東京 🙂🚀 déjà vu über straße "
         "hello world , . ! ? 42 emoji 🎉 test ünïcödé ελληνικά русский текст").split()


class Adapter:
    """The engine's tokenizer interface over a `tokenizers.Tokenizer`."""

    def __init__(self, tok: Tokenizer):
        self.tok = tok
        self.backend = tok  # what DecodeStream runs on
        self.all_special_ids = tuple(i for i, t in tok.get_added_tokens_decoder().items() if t.special)
        self.calls = 0
        self.longest = 0  # most ids decoded in one call

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text).ids

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        self.calls += 1
        self.longest = max(self.longest, len(ids))
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


def random_text(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


@pytest.fixture(scope="module")
def tok() -> Adapter:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    rng = random.Random(0)
    corpus = [random_text(rng, rng.randint(3, 15)) for _ in range(400)]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(corpus, trainer)
    return Adapter(tokenizer)


def byte_token_ids(tok: Adapter, text: str) -> list[int]:
    """One token per UTF-8 byte: every multi-byte character is split across tokens."""
    table = {b: c for b, c in zip(range(256), _bytes_to_unicode())}
    return [tok.tok.token_to_id(table[b]) for b in text.encode()]


def _bytes_to_unicode() -> list[str]:
    # The GPT-2 byte -> printable character map used by the ByteLevel pre-tokenizer.
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0x100))
    out, extra = [], 0
    for b in range(256):
        if b in keep:
            out.append(chr(b))
        else:
            out.append(chr(256 + extra))
            extra += 1
    return out


def run(detok: IncrementalDetokenizer, ids: list[int], chunks: list[int] | None = None,
        flush: bool = True) -> list[str]:
    deltas, i = [], 0
    sizes = iter(chunks or [])
    while i < len(ids) and not detok.stopped:
        n = next(sizes, 1)
        deltas.append(detok.step(ids[i:i + n]))
        i += n
    if flush:
        deltas.append(detok.flush())
    return deltas


def cut_at_stop(text: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    best = None
    for s in stops:
        i = text.find(s)
        if i != -1 and (best is None or i < best[0]):
            best = (i, s)
    if best is None:
        return text, None
    return text[:best[0] + (len(best[1]) if include else 0)], best[1]


def test_one_token_at_a_time_equals_full_decode(tok):
    rng = random.Random(1)
    for _ in range(50):
        prompt = tok.encode(random_text(rng, rng.randint(1, 6)))
        output = tok.encode(" " + random_text(rng, rng.randint(1, 20)))
        detok = IncrementalDetokenizer(tok, prompt)
        deltas = run(detok, output)
        assert "".join(deltas) == tok.decode(output, True) == detok.text
        assert not any("\ufffd" in d for d in deltas)
        assert not detok.stopped and detok.stop_string is None


def test_random_chunks_equal_full_decode(tok):
    rng = random.Random(2)
    for _ in range(50):
        prompt = tok.encode(random_text(rng, 3))
        output = tok.encode(random_text(rng, rng.randint(1, 25)))
        chunks = [rng.randint(1, 6) for _ in range(len(output))]
        detok = IncrementalDetokenizer(tok, prompt)
        assert "".join(run(detok, output, chunks)) == tok.decode(output, True)


def test_split_multibyte_characters_never_yield_replacement(tok):
    text = "café 日本語 🙂🚀 naïve"
    ids = byte_token_ids(tok, text)
    assert len(ids) == len(text.encode())
    detok = IncrementalDetokenizer(tok, tok.encode("hello"))
    deltas = run(detok, ids, flush=False)
    assert not any("\ufffd" in d for d in deltas)
    assert "".join(deltas) == text
    # The 4 byte tokens of 🚀 give nothing, nothing, nothing, then the character.
    detok = IncrementalDetokenizer(tok, tok.encode("x"))
    assert [detok.step([i]) for i in byte_token_ids(tok, "🚀")] == ["", "", "", "🚀"]


def test_chunks_ending_inside_characters(tok):
    # 3-token chunks of 4-byte characters: a chunk that ends mid-character gives nothing yet (the
    # text before the split character waits with it), one that ends on a boundary gives all of it.
    text = "ab🙂🚀🎉🙂🚀🎉"
    ids = byte_token_ids(tok, text)  # character boundaries after ids 2, 6, 10, ..., 26
    detok = IncrementalDetokenizer(tok, tok.encode("x"))
    deltas = run(detok, ids, [3] * len(ids), flush=False)
    assert deltas[:6] == ["", "ab🙂", "", "", "", "🚀🎉🙂"] and "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)


def test_flush_returns_incomplete_character_as_full_decode_does(tok):
    ids = byte_token_ids(tok, "ab🚀")[:-1]  # the rocket's last byte never arrives
    detok = IncrementalDetokenizer(tok, tok.encode("x"))
    assert "".join(run(detok, ids, flush=False)) == "ab"
    rest = detok.flush()
    assert "ab" + rest == tok.decode(ids, True) and "\ufffd" in rest


def test_prompt_text_is_not_emitted_and_leading_space_kept(tok):
    prompt = tok.encode("the cat sat")
    output = tok.encode(" on a mat")
    detok = IncrementalDetokenizer(tok, prompt)
    assert "".join(run(detok, output)) == " on a mat"


def test_skip_special_tokens(tok):
    eos = tok.tok.token_to_id("<eos>")
    output = tok.encode("hello world") + [eos]
    assert "".join(run(IncrementalDetokenizer(tok, [1], skip_special_tokens=True), output)) == "hello world"
    assert "".join(run(IncrementalDetokenizer(tok, [1], skip_special_tokens=False), output)) \
        == "hello world<eos>"


def test_skipped_special_tokens_are_never_held(tok):
    """Skipped specials have no text: a run of them between text tokens (a model emitting padding)
    neither delays the text after them nor grows what the stream decodes, even inside a split
    character; kept (skip_special_tokens=False), they are text like any token."""
    eos = tok.tok.token_to_id("<eos>")
    rocket = byte_token_ids(tok, "🚀")
    output = tok.encode("hello") + [eos] * 200 + rocket[:2] + [eos] * 3 + rocket[2:] + tok.encode(" world")
    tok.longest = 0
    detok = IncrementalDetokenizer(tok, [1])
    deltas = [detok.step([i]) for i in output]
    assert tok.longest < 20  # no held window of the 200 specials was decoded
    assert "".join(deltas) == "hello🚀 world" == tok.decode(output, True)
    assert deltas[len(tok.encode("hello")) + 200 + 2 + 3 + 1] == "🚀"  # out with the character's last byte
    assert "".join(run(IncrementalDetokenizer(tok, [1]), output, [3] * len(output))) == "hello🚀 world"  # chunks too
    kept = IncrementalDetokenizer(tok, [1], skip_special_tokens=False)
    assert "".join(kept.step([i]) for i in output) + kept.flush() == tok.decode(output, False)


@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_spanning_tokens_match_reference(tok, include):
    rng = random.Random(3)
    found = 0
    for _ in range(80):
        output = tok.encode(random_text(rng, rng.randint(5, 25)))
        full = tok.decode(output, True)
        # Stop strings drawn from the text itself (so they often span token boundaries), plus one
        # that rarely occurs.
        a = rng.randrange(len(full))
        stops = [full[a:a + rng.randint(1, 8)], "zzz"]
        rng.shuffle(stops)
        detok = IncrementalDetokenizer(tok, [1, 2, 3], stop=stops, include_stop_str_in_output=include)
        chunks = [rng.randint(1, 3) for _ in range(len(output))]
        deltas = run(detok, output, chunks)
        expected, stop = cut_at_stop(full, stops, include)
        assert "".join(deltas) == expected == detok.text
        assert detok.stop_string == stop and detok.stopped == (stop is not None)
        found += stop is not None
    assert found >= 70


def test_stop_string_across_byte_tokens(tok):
    ids = byte_token_ids(tok, "so 日本語 and more")
    detok = IncrementalDetokenizer(tok, [5], stop=["本語 a"])
    deltas = run(detok, ids, flush=False)
    assert "".join(deltas) == "so 日" and detok.stopped and detok.stop_string == "本語 a"
    assert detok.step(tok.encode(" more")) == "" and detok.flush() == ""


def test_stop_at_first_token(tok):
    output = tok.encode("hello world")
    first = tok.decode(output[:1], True)
    detok = IncrementalDetokenizer(tok, [1], stop=[first])
    assert detok.step(output[:1]) == "" and detok.stopped and detok.stop_string == first
    assert detok.text == ""
    detok = IncrementalDetokenizer(tok, [1], stop=[first], include_stop_str_in_output=True)
    assert detok.step(output[:1]) == first and detok.stopped


def test_earliest_stop_wins_and_hold_back_is_flushed(tok):
    detok = IncrementalDetokenizer(tok, [1], stop=["world peace", "lo w"])
    deltas = run(detok, tok.encode("hello world"), flush=False)
    assert "".join(deltas) == "hel" and detok.stop_string == "lo w"
    # No stop string occurs: the held-back tail comes out on flush.
    detok = IncrementalDetokenizer(tok, [1], stop=["world peace"])
    deltas = run(detok, tok.encode("hello world"), flush=False)
    held = detok.flush()
    assert held and "".join(deltas) + held == "hello world" and not detok.stopped
    assert len(held) <= len("world peace") - 1 + 4  # the hold-back, plus at most the last token


def test_decode_cost_bounded_by_window(tok):
    # The ids kept stay a short window however long the output, and well-formed text never needs
    # a Python-side decode (the stream does it).
    rng = random.Random(4)
    prompt = tok.encode(random_text(rng, 200))
    output = tok.encode(" " + random_text(rng, 400))
    tok.calls = 0
    detok = IncrementalDetokenizer(tok, prompt, stop=["never appears"])
    deltas, longest = [], 0
    for i in output:
        deltas.append(detok.step([i]))
        longest = max(longest, len(detok._window))
    deltas.append(detok.flush())
    assert longest <= 20 and tok.calls <= 1, (longest, tok.calls)  # 1: the prompt context's check
    assert "".join(deltas) == tok.decode(output, True)


def test_endless_invalid_utf8_is_emitted_after_the_pending_limit(tok):
    # Continuation bytes alone never complete a character: after 64 held ids they come out as
    # U+FFFD (as a full decode gives them), and decoding goes on normally afterwards.
    cont = byte_token_ids(tok, "é")[1]  # 0xA9, a lone continuation byte
    ids = [cont] * 70 + tok.encode(" the cat")
    detok = IncrementalDetokenizer(tok, tok.encode("x"))
    deltas = run(detok, ids)
    assert deltas[63] == "\ufffd" * 64 and not any(deltas[:63])
    assert "".join(deltas) == tok.decode(ids, True)
    assert len(detok._window) <= 20


def test_prompt_ending_inside_a_character_is_not_emitted(tok):
    # The prompt's last id is the first byte of "é": its text is the prompt's, never the output's.
    first, cont = byte_token_ids(tok, "é")
    detok = IncrementalDetokenizer(tok, tok.encode("x") + [first])
    deltas = run(detok, [cont] + tok.encode(" the cat"))
    assert "x" not in "".join(deltas) and "".join(deltas).endswith(" the cat")


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompt=st.text(max_size=20), body=st.text(min_size=1, max_size=60),
       stop=st.text(min_size=1, max_size=4), chunk=st.integers(1, 5))
def test_property_random_strings(tok, prompt, body, stop, chunk):
    prompt_ids = tok.encode(prompt) or [0]
    output = tok.encode(body)
    full = tok.decode(output, True)
    detok = IncrementalDetokenizer(tok, prompt_ids)
    deltas = run(detok, output, [chunk] * len(output))
    assert "".join(deltas) == full
    if "\ufffd" not in full:
        assert not any("\ufffd" in d for d in deltas)
    detok = IncrementalDetokenizer(tok, prompt_ids, stop=[stop])
    expected, found = cut_at_stop(full, [stop], False)
    assert "".join(run(detok, output, [chunk] * len(output))) == expected
    assert detok.stop_string == found


def stop_after_min_tokens(tok: Adapter, ids: list[int], stop: str, min_tokens: int) -> str | None:
    """Reference for min_tokens (one token a step, ASCII text): the text before the first stop
    string that ends in the text of token k >= min_tokens; None when there is none."""
    ends = [len(tok.decode(ids[:k], True)) for k in range(len(ids) + 1)]
    full = tok.decode(ids, True)
    for k in range(max(1, min_tokens), len(ids) + 1):
        starts = [i for i in range(len(full)) if full.startswith(stop, i) and ends[k - 1] < i + len(stop) <= ends[k]]
        if starts:
            return full[:starts[0]]
    return None


def test_stop_strings_wait_for_min_tokens(tok):
    rng = random.Random(7)
    ascii_words = [w for w in WORDS if w.isascii()]
    cut_early = 0
    for _ in range(120):
        ids = tok.encode(" ".join(rng.choice(ascii_words) for _ in range(rng.randint(4, 14))))
        full = tok.decode(ids, True)
        a = rng.randrange(len(full))
        stop = full[a:a + rng.randint(1, 4)]
        min_tokens = rng.randint(0, len(ids))
        detok = IncrementalDetokenizer(tok, [1], stop=[stop], min_tokens=min_tokens)
        text = "".join(run(detok, ids))
        expected = stop_after_min_tokens(tok, ids, stop, min_tokens)
        assert (text, detok.stopped) == ((full, False) if expected is None else (expected, True)), \
            (full, stop, min_tokens)
        plain = "".join(run(IncrementalDetokenizer(tok, [1], stop=[stop]), ids))
        cut_early += expected != plain
    assert cut_early >= 20  # min_tokens let many texts past a stop string the plain run stops at


def test_a_stop_string_held_back_before_min_tokens_does_not_count_later(tok):
    """A stop string completed before min_tokens is still in the held-back tail when the check
    begins; only one that ends in later text ends the request."""
    ids = tok.encode("the cat sat on the mat")
    first = len(tok.encode("the cat"))
    detok = IncrementalDetokenizer(tok, [1], stop=["cat", "zzzzzz"], min_tokens=first + 1)
    assert "".join(run(detok, ids)) == "the cat sat on the mat" and not detok.stopped
    detok = IncrementalDetokenizer(tok, [1], stop=["at"], min_tokens=first + 1)
    assert "".join(run(detok, ids)) == "the cat s" and detok.stop_string == "at"
