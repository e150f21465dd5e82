"""Structured output: a request's ``GrammarSpec`` compiled with xgrammar (once per distinct spec,
kept in a bounded cache), one matcher per constrained sequence, and each step's token bitmasks
of the constrained rows, which the sampler applies (``sampler.TokenMasks``).

Why xgrammar: filling the masks is host work every step, and at batch 256 on SmolLM2's
vocabulary xgrammar fills a JSON schema's in a fraction of llguidance's time
(benchmarks/engine/bench_grammar_mask.py, RESULTS.md). xgrammar skips JSON-schema keywords it does not
implement, so ``check_schema`` refuses every keyword outside ``SCHEMA_KEYWORDS`` (each one's
enforcement is tested in tests/engine/test_grammar.py) first: a schema is enforced whole or refused,
never half-enforced.

Compiling runs on the caller's thread (AsyncEngine compiles off the event loop and off the step
loop, before the request is queued); the matchers and masks run on the step loop.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from loraplex.adapter_store.errors import InvalidRequestError
from loraplex.inference_server.engine.request import GrammarSpec
from loraplex.inference_server.engine.sampler import TokenMasks, to_device

SEPARATORS = (", ", ": ")  # JSON is written on one line, as models write it: no free whitespace
SCHEMA_FIELD = "response_format.schema"

# What xgrammar enforces (tests/engine/test_grammar.py shows each); annotations change nothing
ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$comment", "$schema", "$id", "deprecated",
                         "readOnly", "writeOnly"})
SCHEMA_KEYWORDS = frozenset({
    "type", "properties", "required", "additionalProperties", "items", "prefixItems", "minItems", "maxItems",
    "enum", "const", "anyOf", "$ref", "$defs", "definitions", "pattern", "minLength", "maxLength", "format",
    "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "minProperties", "maxProperties",
}) | ANNOTATIONS
FORMATS = frozenset({"date", "date-time", "time", "email", "uuid", "ipv4", "ipv6"})
_SCHEMA_MAPS = ("properties", "$defs", "definitions")  # keywords whose values map names to subschemas
_SCHEMA_LISTS = ("prefixItems", "anyOf")  # keywords whose values are lists of subschemas
_SCHEMA_VALUES = ("items", "additionalProperties")  # keywords whose value is a subschema (or a bool)


def check_schema(schema: Any, field: str = SCHEMA_FIELD, path: str = "") -> None:
    """Refuse (InvalidRequestError naming ``field`` and the keyword's place in the schema) a
    schema that uses a keyword or a format outside what xgrammar enforces."""
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise InvalidRequestError(f"the schema at {path or '/'} must be an object or a boolean", field)
    for key, value in schema.items():
        where = f"{path}/{key}"
        if key not in SCHEMA_KEYWORDS:
            raise InvalidRequestError(f"keyword {key!r} at {where} is not supported; supported: "
                                      f"{', '.join(sorted(SCHEMA_KEYWORDS - ANNOTATIONS))}", field)
        if key == "format" and value not in FORMATS:
            raise InvalidRequestError(f"format {value!r} at {where} is not supported; supported: "
                                      f"{', '.join(sorted(FORMATS))}", field)
        if key in _SCHEMA_MAPS:
            if not isinstance(value, dict):
                raise InvalidRequestError(f"{where} must be an object", field)
            for name, sub in value.items():
                check_schema(sub, field, f"{where}/{name}")
        elif key in _SCHEMA_LISTS:
            if not isinstance(value, list):
                raise InvalidRequestError(f"{where} must be a list", field)
            for i, sub in enumerate(value):
                check_schema(sub, field, f"{where}/{i}")
        elif key in _SCHEMA_VALUES:
            check_schema(value, field, where)


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
        if spec.schema:
            check_schema(json.loads(spec.schema))
        compiled = CompiledGrammar(spec, self._xgrammar_compile(spec))
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

    def _xgrammar_compile(self, spec: GrammarSpec) -> Any:
        import xgrammar  # noqa: PLC0415

        compiler = self._xgrammar_compiler()
        try:
            if spec.kind == "tagged_json":
                return compiler.compile_structural_tag(_tool_tag(spec))
            schema = spec.schema if spec.kind == "json_schema" else '{"type": "object"}'
            return compiler.compile_json_schema(schema, any_whitespace=False, separators=SEPARATORS,
                                                strict_mode=spec.kind == "json_schema")
        except (RuntimeError, ValueError, xgrammar.InvalidJSONError, xgrammar.InvalidStructuralTagError) as exc:
            message = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
            raise InvalidRequestError(f"the grammar library refused it: {message}", SCHEMA_FIELD) from None


def _tool_tag(spec: GrammarSpec) -> dict:
    """xgrammar's structural tag of a tagged_json spec: begin, the JSON, end; the whole output,
    or (``free_text``) wherever the text writes ``begin``."""
    tag = {"type": "tag", "begin": spec.begin, "end": spec.end,
           "content": {"type": "json_schema", "json_schema": json.loads(spec.schema), "max_whitespace_cnt": 1}}
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
