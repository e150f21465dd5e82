"""Incremental detokenization and stop strings.

Text is produced by decoding a sliding window of token ids and emitting only what is new,
so byte-level BPE tokens that merge across boundaries and multi-byte UTF-8 characters
split over tokens come out whole (a window ending in U+FFFD waits for the next token).
Stop strings cut the text exactly: text that might be the start of a stop string is held
back until the next token decides.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

_CONTEXT_TOKENS = 5  # prompt tokens decoded ahead of the output, so merges decode right


class Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    def __init__(self, decoder: Decoder, prompt_ids: Sequence[int], skip_special_tokens: bool = True) -> None:
        self._decoder = decoder
        self._skip_special = skip_special_tokens
        self._ids: list[int] = list(prompt_ids[-_CONTEXT_TOKENS:])
        self._prefix = 0
        self._read = len(self._ids)

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes (possibly empty)."""
        self._ids.append(token_id)
        before = self._decode(self._ids[self._prefix : self._read])
        after = self._decode(self._ids[self._prefix :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self._ids)
            return after[len(before) :]
        return ""

    def flush(self) -> str:
        """Text still pending at the end of generation (an incomplete character decodes as U+FFFD)."""
        before = self._decode(self._ids[self._prefix : self._read])
        after = self._decode(self._ids[self._prefix :])
        self._prefix = self._read = len(self._ids)
        return after[len(before) :] if after.startswith(before) else ""

    def _decode(self, ids: list[int]) -> str:
        return self._decoder.decode(ids, skip_special_tokens=self._skip_special)


class StopStringMatcher:
    """Accumulates output text; releases what can no longer be part of a stop string."""

    def __init__(self, stop_strings: Sequence[str]) -> None:
        self._stops = tuple(stop_strings)
        self._text = ""
        self._emitted = 0
        self.stopped = False

    @property
    def text(self) -> str:
        """All output text so far (cut before the stop string once stopped)."""
        return self._text

    def feed(self, delta: str) -> str:
        """Add text; return the part that is safe to stream now."""
        if self.stopped:
            return ""
        before = len(self._text)
        self._text += delta
        hit = self._first_stop(before)
        if hit is not None:
            self._text = self._text[:hit]
            self.stopped = True
            return self._release(len(self._text))
        return self._release(len(self._text) - self._held_back())

    def feed_unchecked(self, delta: str) -> str:
        """Add text that no stop string may end (before ``min_tokens``): a stop string completed
        in it does not stop; its end is still held back while it may begin one, which text fed
        later can complete (then the cut is there, as vLLM cuts)."""
        if self.stopped:
            return ""
        self._text += delta
        return self._release(len(self._text) - self._held_back())

    def finish(self) -> str:
        """Release everything still held back (generation ended for another reason)."""
        return self._release(len(self._text))

    def _first_stop(self, before: int) -> int | None:
        """Where the text is cut: at the stop string that completes first past its first
        ``before`` characters (those were matched already, or fed unchecked), as if the text had
        arrived one character at a time (so the answer never depends on how it was chunked); of
        stops completing at the same character, the one that starts earliest."""
        hits = [(i + len(s), i) for s in self._stops if (i := self._text.find(s, max(0, before - len(s) + 1))) >= 0]
        return min(hits)[1] if hits else None

    def _held_back(self) -> int:
        """Characters at the end of the text that may begin a stop string: the longest suffix
        that is a proper prefix of one. Only the positions in the last len(stop) - 1 characters
        holding the stop's first character are tried (each token used to cost O(len(stop)^2))."""
        text, best = self._text, 0
        for stop in self._stops:
            tail = text[max(0, len(text) - len(stop) + 1) :] if len(stop) > 1 else ""
            i = tail.find(stop[0])
            while 0 <= i and len(tail) - i > best:
                if stop.startswith(tail[i:]):
                    best = len(tail) - i
                    break
                i = tail.find(stop[0], i + 1)
        return best

    def _release(self, upto: int) -> str:
        upto = max(upto, self._emitted)
        out = self._text[self._emitted : upto]
        self._emitted = upto
        return out
