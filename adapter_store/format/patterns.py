"""PEFT's module-name patterns from an uploaded adapter config (target_modules as a string, the
keys of rank_pattern and alpha_pattern), compiled and matched under one CPU-time budget an adapter.

Python's re holds the GIL for a whole match, and a crafted pattern backtracks exponentially on a
module name of 30-odd characters (``(.|\\w|\\.)*$q``: hours): one upload would stall every request
of the process. The ``regex`` package (transformers already needs it) takes a timeout, can match
without holding the GIL, and its default syntax is re's.

The budget counts the CPU time this thread spent matching, not the wall clock: on a busy machine
a thread waits for a CPU, and a wall-clock budget then refuses a plain ``q_proj`` as if it
backtracked. regex's timeout is a wall-clock one, so a match it stops is tried again with a longer
timeout until it finishes or has used the CPU budget; only a machine that does not give it that
much CPU within ``MAX_WAIT_S`` makes the judgment fail, and then as UNAVAILABLE (try again), not as
a verdict on the pattern. Patterns are judged once, at upload; the store keeps the outcome
(peft_format.PatternValue) so a stored adapter is not judged again.
"""

from __future__ import annotations

import time

import regex

from loraplex.adapter_store.errors import AdapterValidationError, UnavailableError

MATCH_BUDGET_S = 0.5  # CPU seconds, for all the patterns of one adapter against all its module names
MAX_WAIT_S = 30.0  # wall seconds the judgment waits for that CPU time on a busy machine
_FIRST_SLICE = 1.25  # the first wall-clock timeout, as a multiple of the CPU time left


class PatternMatcher:
    """Matches for one adapter's config; raises AdapterValidationError naming the field and the
    pattern that does not compile or uses up the CPU budget."""

    def __init__(self, budget_s: float = MATCH_BUDGET_S, max_wait_s: float = MAX_WAIT_S) -> None:
        self._budget = budget_s
        self._max_wait = max_wait_s
        self._spent = 0.0  # CPU seconds of the matches that finished
        self._compiled: dict[str, regex.Pattern] = {}

    def compile(self, pattern: str, field: str) -> regex.Pattern:
        if pattern not in self._compiled:
            try:
                self._compiled[pattern] = regex.compile(pattern)
            except (regex.error, OverflowError, RecursionError) as e:
                raise AdapterValidationError(f"{field} {pattern!r} is not a valid pattern ({e})") from None
        return self._compiled[pattern]

    def fullmatch(self, pattern: str, text: str, field: str, shown: str | None = None) -> bool:
        """``pattern`` matches all of ``text``; errors name ``shown`` (the user's pattern, when
        ``pattern`` wraps it), else ``pattern``."""
        return self._run(self.compile(pattern, field).fullmatch, shown or pattern, text, field)

    def match(self, pattern: str, text: str, field: str, shown: str | None = None) -> bool:
        """``pattern`` matches a prefix of ``text`` (errors name ``shown`` as fullmatch's do)."""
        return self._run(self.compile(pattern, field).match, shown or pattern, text, field)

    def _run(self, fn, shown: str, text: str, field: str) -> bool:
        left = self._budget - self._spent
        wall = left * _FIRST_SLICE
        waited = 0.0
        while left > 0:
            started = time.thread_time()
            try:
                found = fn(text, concurrent=True, timeout=wall) is not None
            except TimeoutError:
                used = time.thread_time() - started
                if used >= left:
                    break
                waited += wall
                if waited >= self._max_wait:
                    raise UnavailableError(
                        f"{field} {shown!r}: the machine is too busy to judge the pattern (its matching got "
                        f"{used:.2g} s of CPU time in {wall:.2g} s); try again") from None
                wall = min(wall * 4, self._max_wait - waited)
                continue
            self._spent += time.thread_time() - started
            return found
        raise AdapterValidationError(
            f"{field} {shown!r}: matching the module names used {self._budget:g} s of CPU time without "
            "an answer (a pattern that backtracks)")
