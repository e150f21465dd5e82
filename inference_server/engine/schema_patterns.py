"""The regex features of a JSON-schema ``pattern`` that xgrammar would not enforce as JSON Schema
reads them (ECMA-262). xgrammar refuses some (lookbehind, ``\\b``, backreferences, inline flags)
but drops others with only a log line: a lookahead, an anchor inside the pattern; and it reads a
letter escape ECMA-262 does not define (``\\A``, ``\\z``, ``\\a``) as something of its own. Each is
named here, before the schema reaches the library.

Whether the library can keep a pattern inside a JSON string (no unescaped quote, backslash or
control character) depends on how it compiles it, so grammar.py asks the library itself.
"""

from __future__ import annotations

# The letter and digit escapes xgrammar reads as ECMA-262 does (\b too, inside a class: backspace)
ESCAPES = frozenset("dDwWsStnrfv0xu")
_REFUSED_ESCAPES = {
    "b": "a word boundary (\\b)", "B": "a word boundary (\\B)", "k": "a backreference (\\k<name>)",
    "p": "a Unicode property escape (\\p{...})", "P": "a Unicode property escape (\\P{...})",
    **{d: f"a backreference (\\{d})" for d in "123456789"},
}
_GROUP_OPENERS = ("(?:", "(?P<")  # groups that only group; "(?<" is one too unless a lookbehind
_LOOKAROUNDS = {"(?=": "a lookahead (?=...)", "(?!": "a negative lookahead (?!...)",
                "(?<=": "a lookbehind (?<=...)", "(?<!": "a negative lookbehind (?<!...)"}


def pattern_problem(pattern: str) -> str | None:
    """What in ``pattern`` the grammar library would not enforce as written, in words (None:
    nothing). Character classes are skipped whole: only escapes matter inside one."""
    depth, alternative, i = 0, 0, 0  # group depth; where the current top-level alternative starts
    while i < len(pattern):
        char = pattern[i]
        if char == "\\":
            problem = _escape_problem(pattern, i, in_class=False)
            i += 2
        elif char == "[":
            problem, i = _class_problem(pattern, i)
        else:
            problem = _group_problem(pattern, i) if char == "(" else _anchor_problem(pattern, i, depth, alternative)
            if char in "()":
                depth += 1 if char == "(" else -1
            if char == "|" and depth == 0:
                alternative = i + 1
            i += 1
        if problem:
            return problem
    return None


def _escape_problem(pattern: str, i: int, in_class: bool) -> str | None:
    letter = pattern[i + 1:i + 2]
    if not (letter.isascii() and letter.isalnum()) or (letter == "b" and in_class):
        return None  # an escaped punctuation character matches itself
    if letter in _REFUSED_ESCAPES:
        return f"uses {_REFUSED_ESCAPES[letter]}, which the grammar library does not support"
    if letter == "u" and pattern[i + 2:i + 3] == "{":
        return "uses \\u{...}, which ECMA-262 reads as a code point only in unicode mode; write \\uXXXX"
    if letter not in ESCAPES:
        return (f"uses the escape \\{letter}, which ECMA-262 (JSON Schema's regex dialect) does not define "
                f"and other dialects read differently")
    return None


def _class_problem(pattern: str, start: int) -> tuple[str | None, int]:
    """The problem of the character class opening at ``start`` and the index past it."""
    i = start + 1
    while i < len(pattern) and pattern[i] != "]":
        if pattern[i] == "\\":
            problem = _escape_problem(pattern, i, in_class=True)
            if problem:
                return problem, i
            i += 1
        i += 1
    return None, i + 1


def _group_problem(pattern: str, i: int) -> str | None:
    if not pattern.startswith("(?", i):
        return None
    for opener, words in _LOOKAROUNDS.items():
        if pattern.startswith(opener, i):
            return f"uses {words}, which the grammar library would ignore or refuse"
    if pattern.startswith(_GROUP_OPENERS, i) or pattern.startswith("(?<", i):
        return None
    return "uses an inline flag or a special group (?...), which the grammar library does not support"


def _anchor_problem(pattern: str, i: int, depth: int, alternative: int) -> str | None:
    """``^`` only where a top-level alternative starts, ``$`` only where one ends: the library
    matches the whole string anyway and ignores an anchor anywhere else (where it could never
    match), so ``a^b`` would let "ab" through."""
    char = pattern[i]
    if char == "^" and not (depth == 0 and i == alternative):
        return "has '^' inside it; the grammar library would ignore it (put anchors at the start and end only)"
    if char == "$" and not (depth == 0 and pattern[i + 1:i + 2] in ("", "|")):
        return "has '$' inside it; the grammar library would ignore it (put anchors at the start and end only)"
    return None
