"""Incremental detokenization and stop strings."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loraplex.inference_server.engine.detokenizer import IncrementalDetokenizer, StopStringMatcher
from loraplex.inference_server.model.tokenizer import Tokenizer

TEXTS = [
    "Hello, world! 你好，世界。",
    "Emoji: 🦀🐍🚀 and accents: café naïve résumé",
    "   leading spaces and\nnew\tlines  ",
    "def f(x):\n    return x ** 2  # math ✓",
]


@pytest.fixture(scope="module")
def tokenizer(smollm2_tokenizer_dir) -> Tokenizer:
    return Tokenizer.from_folder(smollm2_tokenizer_dir)


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_text_equals_one_decode_and_never_splits_a_character(tokenizer: Tokenizer, text: str) -> None:
    prompt = tokenizer.encode("Say:")
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, prompt)
    deltas = [detok.push(t) for t in ids] + [detok.flush()]
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True)
    assert not any("\ufffd" in d for d in deltas)


def test_random_byte_tokens_stream_like_a_full_decode(tokenizer: Tokenizer) -> None:
    rng = random.Random(0)
    ids = [rng.randrange(tokenizer.vocab_size) for _ in range(300)]
    detok = IncrementalDetokenizer(tokenizer, [])
    streamed = "".join(detok.push(t) for t in ids) + detok.flush()
    assert streamed == tokenizer.decode(ids, skip_special_tokens=True)


def _stream(stops: list[str], pieces: list[str]) -> tuple[str, bool]:
    matcher = StopStringMatcher(stops)
    out = "".join(matcher.feed(p) for p in pieces)
    if not matcher.stopped:
        out += matcher.finish()
    return out, matcher.stopped


def test_stop_string_split_over_pieces_is_cut_exactly() -> None:
    assert _stream(["STOP"], ["abc S", "T", "OP and more"]) == ("abc ", True)


def test_text_that_only_looks_like_a_stop_prefix_is_released() -> None:
    assert _stream(["STOP"], ["abc ST", "ay here"]) == ("abc STay here", False)


def test_earliest_of_several_stop_strings_wins() -> None:
    assert _stream(["xyz", "b"], ["a", "bcxyz"]) == ("a", True)


def test_held_back_prefix_is_released_at_the_end() -> None:
    assert _stream(["STOP"], ["end ST"]) == ("end ST", False)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.text("ab", min_size=1, max_size=6), min_size=1, max_size=3),
       st.lists(st.text("abc", max_size=4), max_size=8))
def test_streamed_text_is_the_text_cut_at_the_first_stop(stops: list[str], deltas: list[str]) -> None:
    """However the text arrives, what is streamed is the text up to the first stop string (held
    back only while its end could still begin one), and never a character of the stop itself."""
    matcher = StopStringMatcher(tuple(stops))
    out = "".join(matcher.feed(d) for d in deltas)
    if not matcher.stopped:
        full = "".join(deltas)
        held = max((n for s in stops for n in range(1, len(s)) if full.endswith(s[:n])), default=0)
        assert out == full[: len(full) - held]
        out += matcher.finish()
    full = "".join(deltas)
    by_char = StopStringMatcher(tuple(stops))
    expected = "".join(by_char.feed(c) for c in full) + by_char.finish()
    hits = [(i + len(s), i) for s in stops if (i := full.find(s)) >= 0]
    assert out == expected == (full[: min(hits)[1]] if hits else full)
    assert not any(s in out for s in stops)


def test_the_stop_that_completes_first_wins_however_the_text_is_chunked() -> None:
    """"baa" with stops "a" and "baa": generation stops when "a" completes after "ba", so the
    answer is "b" whether the text came as one chunk or two."""
    assert _stream(["a", "baa"], ["baa"]) == ("b", True)
    assert _stream(["a", "baa"], ["ba", "a"]) == ("b", True)


def test_min_tokens_text_is_never_cut_but_a_stop_it_begins_is() -> None:
    """Before min_tokens (fed unchecked) a whole stop string does not stop and stays in the text;
    one begun there and completed after is cut where it begins: its first characters were held
    back, never streamed (" Paris" with stop "s." completed by the token after: " Pari")."""
    begun = StopStringMatcher(["s."])
    out = begun.feed_unchecked(" Paris")
    assert out == " Pari"
    out += begun.feed(".")
    assert (out, begun.stopped, begun.text) == (" Pari", True, " Pari")
    whole = StopStringMatcher(["s."])
    out = whole.feed_unchecked(" is.") + whole.feed(" Next")
    assert (out, whole.stopped) == (" is. Next", False)
    assert whole.feed(" s.") == " " and whole.stopped and whole.text == " is. Next "


def test_stop_strings_are_bounded_in_length() -> None:
    """Matching runs on the engine thread for every token: a stop string is at most
    MAX_STOP_CHARS long (16 stops of 400000 characters cost ~18 ms a token for everyone)."""
    from loraplex.inference_server.engine.request import MAX_STOP_CHARS, StoppingCriteria
    from loraplex.adapter_store.errors import InvalidRequestError

    StoppingCriteria(stop_strings=("x" * MAX_STOP_CHARS,))
    with pytest.raises(InvalidRequestError, match=f"at most {MAX_STOP_CHARS} characters"):
        StoppingCriteria(stop_strings=("ok", "x" * (MAX_STOP_CHARS + 1)))
