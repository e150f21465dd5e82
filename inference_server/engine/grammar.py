"""Structured output: a request's ``GrammarSpec`` compiled with xgrammar (once per distinct spec,
kept in a bounded cache), one matcher per constrained sequence, and each step's token bitmasks
of the constrained rows, which the sampler applies (``sampler.TokenMasks``).

Why xgrammar: filling the masks is host work every step, and at batch 256 on SmolLM2's
vocabulary xgrammar fills a JSON schema's in a fraction of llguidance's time
(benchmarks/engine/bench_grammar_mask.py, RESULTS.md). xgrammar skips, with only a log line, the
JSON-schema keywords and combinations it does not implement, so ``check_schema`` (schema_checks.py)
refuses those first, and the compiler refuses a pattern that xgrammar would not keep inside a JSON
string: a schema is enforced whole or refused, never half-enforced.

Compiling runs on the caller's thread (AsyncEngine compiles off the event loop and off the step
loop, before the request is queued); the matchers and masks run on the step loop.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from loraplex.adapter_store.errors import InvalidRequestError
from loraplex.inference_server.engine.request import GrammarSpec
from loraplex.inference_server.engine.sampler import TokenMasks, to_device
from loraplex.inference_server.engine.schema_checks import (SCHEMA_FIELD, check_schema, schema_patterns,
                                                            with_whole_integer_bounds)

SEPARATORS = (", ", ": ")  # JSON is written on one line, as models write it: no free whitespace
# the log prefix of the library's messages ("[04:29:08] /project/cpp/x.cc:5082: ") and its checks' wording
_LIBRARY_NOISE = re.compile(r"^(\[[\d:]+\] \S+:\d+: )?(Check failed: .* is false: )?")
# a pattern compiled to one automaton over a JSON string's characters (quote, backslash and control
# characters left out); any other rule lets the library write them raw (json_schema_converter.cc)
_STRING_REGEX_RULE = re.compile(r'^\w+ ::= Regex\(".*", json_string=true\)$', re.MULTILINE)
# a minLength / maxLength string's character: anything but a quote, a backslash, CR or LF
_RAW_CHARACTERS_RULE = re.compile(r'^(\w+_characters) ::= \(\(\[\^\\"\\\\\\r\\n\]\)\)$', re.MULTILINE)


@dataclass(frozen=True, slots=True)
class CompiledGrammar:
    """A spec compiled for this engine's tokenizer (xgrammar's CompiledGrammar inside)."""

    spec: GrammarSpec
    compiled: Any


class GrammarState:
    """One constrained sequence's place in its grammar: told every token the sequence takes."""

    def __init__(self, grammar: CompiledGrammar, stop_ids: Iterable[int]) -> None:
        import xgrammar  # noqa: PLC0415  (only servers that see a constrained request load it)

        self.matcher = xgrammar.GrammarMatcher(grammar.compiled, override_stop_tokens=sorted(stop_ids) or None)

    def accept(self, token: int) -> bool:
        """Advance past ``token``; False if the grammar does not allow it (the sampler's mask
        never lets that happen) or has ended already."""
        return self.matcher.accept_token(token)

    @property
    def ended(self) -> bool:
        """The grammar took a stop token: nothing more may follow."""
        return self.matcher.is_terminated()


class GrammarCompiler:
    """Specs -> CompiledGrammar for one tokenizer, the newest ``cache_size`` kept (a repeated
    schema costs nothing the second time). Thread-safe; xgrammar's tokenizer tables are built on
    the first compile, so a server that never sees a constrained request never pays for them."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, stop_ids: Iterable[int], cache_size: int = 256) -> None:
        if cache_size < 1:
            raise ValueError(f"cache_size must be >= 1, got {cache_size}")
        self._hf_tokenizer = hf_tokenizer
        self._vocab_size = vocab_size
        self._stop_ids = sorted(stop_ids)
        self._cache_size = cache_size
        self._cache: OrderedDict[GrammarSpec, CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self._compiler: Any = None
        self.compiles = 0  # compilations done (cache misses)

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """The compiled grammar of ``spec``; InvalidRequestError (naming ``response_format``) for a
        schema xgrammar does not enforce whole or cannot compile."""
        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
                return hit
        schema = json.loads(spec.schema) if spec.schema else None
        if schema is not None:
            check_schema(schema)
        compiled = CompiledGrammar(spec, self._xgrammar_compile(spec, with_whole_integer_bounds(schema)))
        with self._lock:
            self.compiles += 1
            self._cache[spec] = compiled
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def _xgrammar_compiler(self) -> Any:
        import xgrammar  # noqa: PLC0415

        with self._lock:
            if self._compiler is None:
                info = xgrammar.TokenizerInfo.from_huggingface(self._hf_tokenizer, vocab_size=self._vocab_size,
                                                               stop_token_ids=self._stop_ids)
                self._compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            return self._compiler

    def _xgrammar_compile(self, spec: GrammarSpec, schema: Any) -> Any:
        """``spec`` compiled, ``schema`` being its schema as checked and rounded (None: none)."""
        import xgrammar  # noqa: PLC0415

        compiler = self._xgrammar_compiler()
        try:
            _check_patterns_stay_in_strings(schema)
            if spec.kind == "tagged_json":
                grammar = xgrammar.Grammar.from_structural_tag(_tool_tag(spec, schema))
            else:
                text = json.dumps(schema) if spec.kind == "json_schema" else '{"type": "object"}'
                grammar = xgrammar.Grammar.from_json_schema(text, any_whitespace=False, separators=SEPARATORS,
                                                            strict_mode=spec.kind == "json_schema")
            return compiler.compile_grammar(_escaped_control_characters(grammar))
        except InvalidRequestError:
            raise
        except (RuntimeError, ValueError, xgrammar.InvalidJSONError, xgrammar.InvalidStructuralTagError) as exc:
            raise InvalidRequestError(f"the grammar library refused it: {_library_message(exc)}",
                                      SCHEMA_FIELD) from None


def _check_patterns_stay_in_strings(schema: Any) -> None:
    """Refuse a pattern xgrammar cannot compile to one automaton over a JSON string's characters:
    it then matches the regex against the raw JSON text, writing an unescaped quote, backslash or
    control character (a non-ASCII character in the pattern, a pattern whose every match holds
    such a character, or one whose automaton would be too large)."""
    import xgrammar  # noqa: PLC0415

    for where, pattern in schema_patterns(schema):
        alone = json.dumps({"type": "string", "pattern": pattern})
        if not _STRING_REGEX_RULE.search(str(xgrammar.Grammar.from_json_schema(alone, any_whitespace=False))):
            raise InvalidRequestError(
                f"pattern {pattern!r} at {where} is one the grammar library cannot keep inside a JSON string (it "
                f"could write an unescaped quote, backslash or control character): write non-ASCII characters as "
                f"\\uXXXX, let it match text without such characters, and keep repetitions small", SCHEMA_FIELD)


def _escaped_control_characters(grammar: Any) -> Any:
    """``grammar`` with its length-bounded strings' characters kept to what JSON writes raw:
    xgrammar writes a string with minLength / maxLength as a repetition of one character rule that
    leaves out only the quote, backslash, CR and LF, so a tab or another control character could
    appear unescaped (invalid JSON). Those rules leave out every control character here (the
    other rules of the grammar are the library's, parsed back from its own text)."""
    import xgrammar  # noqa: PLC0415

    text, n = _RAW_CHARACTERS_RULE.subn(r'\1 ::= (([^\\0-\\x1f\\"\\\\]))', str(grammar))
    return xgrammar.Grammar.from_ebnf(text) if n else grammar


def _library_message(exc: Exception) -> str:
    """The library's message as plain text: its last line without the log prefix."""
    text = str(exc).strip()
    return _LIBRARY_NOISE.sub("", text.splitlines()[-1]) if text else type(exc).__name__


def _tool_tag(spec: GrammarSpec, schema: Any) -> dict:
    """xgrammar's structural tag of a tagged_json spec: begin, the JSON, end; the whole output,
    or (``free_text``) wherever the text writes ``begin``."""
    tag = {"type": "tag", "begin": spec.begin, "end": spec.end,
           "content": {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": 1}}
    if spec.free_text:
        return {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": [spec.begin],
                                                      "tags": [tag]}}
    return {"type": "structural_tag", "format": tag}


class MaskFiller:
    """Each step's bitmasks of its constrained rows, filled by xgrammar on the host (a batch at
    once, on ``threads`` threads) into pinned memory and sent to the device without a sync
    (torch's pinned-memory allocator keeps a buffer until its copy is done, so the next step's
    buffer is another)."""

    def __init__(self, threads: int = 1) -> None:
        import xgrammar  # noqa: PLC0415

        self._xgrammar = xgrammar
        self._batch = xgrammar.BatchGrammarMatcher(max_threads=threads)

    def masks(self, states: Sequence[GrammarState | None], vocab: int, device: torch.device) -> TokenMasks | None:
        """The masks of the rows whose state is not None (row i of the step: ``states[i]``); None
        when no row is constrained."""
        rows = [i for i, s in enumerate(states) if s is not None]
        if not rows:
            return None
        words = (vocab + 31) // 32
        host = torch.empty((len(rows), words), dtype=torch.int32, pin_memory=device.type == "cuda")
        self._batch.batch_fill_next_token_bitmask([states[i].matcher for i in rows], host)
        bitmask = host.to(device, non_blocking=True) if device.type == "cuda" else host
        return TokenMasks(to_device(rows, device), bitmask)
