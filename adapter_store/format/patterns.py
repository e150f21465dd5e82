"""PEFT's module-name patterns from an uploaded adapter config (target_modules as a string, the
keys of rank_pattern and alpha_pattern), compiled and matched under one time budget an adapter.

Python's re holds the GIL for a whole match, and a crafted pattern backtracks exponentially on a
module name of 30-odd characters (``(.|.)*X``: hours): one upload would stall every request of
the process. The ``regex`` package (transformers already needs it) takes a timeout and its
default syntax is re's.
"""

from __future__ import annotations

import time

import regex

from adapter_store.errors import AdapterValidationError

MATCH_BUDGET_S = 0.5  # for all the patterns of one adapter against all its module names


class PatternMatcher:
    """Matches for one adapter's config; raises AdapterValidationError naming the field and the
    pattern that does not compile or outruns the budget."""

    def __init__(self, budget_s: float = MATCH_BUDGET_S) -> None:
        self._budget = budget_s
        self._deadline = time.monotonic() + budget_s
        self._compiled: dict[str, regex.Pattern] = {}

    def compile(self, pattern: str, field: str) -> regex.Pattern:
        if pattern not in self._compiled:
            try:
                self._compiled[pattern] = regex.compile(pattern)
            except (regex.error, OverflowError, RecursionError) as e:
                raise AdapterValidationError(f"{field} {pattern!r} is not a valid pattern ({e})") from None
        return self._compiled[pattern]

    def fullmatch(self, pattern: str, text: str, field: str) -> bool:
        return self._run(self.compile(pattern, field).fullmatch, pattern, text, field)

    def match(self, pattern: str, text: str, field: str) -> bool:
        return self._run(self.compile(pattern, field).match, pattern, text, field)

    def _run(self, fn, pattern: str, text: str, field: str) -> bool:
        left = self._deadline - time.monotonic()
        try:
            if left <= 0:
                raise TimeoutError
            return fn(text, timeout=left) is not None
        except TimeoutError:
            raise AdapterValidationError(f"{field} {pattern!r}: matching the module names takes over "
                                         f"{self._budget:g} s (a pattern that backtracks)") from None
