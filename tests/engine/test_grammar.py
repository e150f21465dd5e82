"""Structured output in the engine (#41 item 4): the schema keywords loraplex accepts are the ones
xgrammar enforces (each shown refusing a document that breaks it) and every other is refused
naming its place, as is each combination, multipleOf and regex feature xgrammar would drop, and a
pattern it would not keep inside a JSON string; the library's own refusals read as plain text, and
an integer's fractional bounds are rounded inward; the bitmask layout; the sampler masking only the
constrained rows; the compile cache; and, on a tiny random Llama, constrained requests mixed with
free ones and adapters, in the plain and the launch-ahead engine: every constrained output is a
path through its grammar and every free request gets the tokens it gets alone."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch

from loraplex.adapter_store.errors import InvalidRequestError
from loraplex.inference_server.engine.grammar import GrammarCompiler, GrammarState, MaskFiller
from loraplex.inference_server.engine.request import (GenerationRequest, GrammarSpec, SamplingParams,
                                                      StoppingCriteria)
from loraplex.inference_server.engine.sampler import SampleRow, TokenMasks, apply_bitmask, sample
from loraplex.inference_server.engine.schema_checks import ANNOTATIONS, FORMATS, SCHEMA_KEYWORDS, check_schema
from lora_helpers import ADAPTER_CONFIGS, load_engine, make_test_adapters, run_all, tokens_of
from launch_ahead import _deferred

EOS = 2

# keyword: (schema using it, a document it accepts, one that breaks only it)
ENFORCED = {
    "type": ({"type": ["integer", "null"]}, "null", '"x"'),
    "properties": ({"type": "object", "properties": {"a": {"type": "integer"}}}, '{"a": 1}', '{"a": "x"}'),
    "required": ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}, '{"a": 1}', "{}"),
    "additionalProperties": ({"type": "object", "additionalProperties": {"type": "integer"}}, '{"b": 2}',
                             '{"b": "x"}'),
    "items": ({"type": "array", "items": {"type": "integer"}}, "[1]", '["a"]'),
    "prefixItems": ({"type": "array", "prefixItems": [{"type": "string"}], "items": False}, '["a"]', "[1]"),
    "minItems": ({"type": "array", "items": {"type": "integer"}, "minItems": 2}, "[1, 2]", "[1]"),
    "maxItems": ({"type": "array", "items": {"type": "integer"}, "maxItems": 1}, "[1]", "[1, 2]"),
    "enum": ({"enum": ["x", "y"]}, '"x"', '"z"'),
    "const": ({"const": "x"}, '"x"', '"y"'),
    "anyOf": ({"anyOf": [{"type": "string"}, {"type": "integer"}]}, "1", "true"),
    "$ref": ({"$defs": {"n": {"type": "integer"}}, "$ref": "#/$defs/n"}, "1", '"x"'),
    "$defs": ({"$defs": {"n": {"type": "integer"}}, "$ref": "#/$defs/n"}, "1", '"x"'),
    "definitions": ({"definitions": {"n": {"type": "integer"}}, "$ref": "#/definitions/n"}, "1", '"x"'),
    "pattern": ({"type": "string", "pattern": "^a[0-9]+$"}, '"a12"', '"b12"'),
    "minLength": ({"type": "string", "minLength": 3}, '"abc"', '"ab"'),
    "maxLength": ({"type": "string", "maxLength": 3}, '"abc"', '"abcd"'),
    "format": ({"type": "string", "format": "date"}, '"2024-01-31"', '"yesterday"'),
    "minimum": ({"type": "number", "minimum": 1.5}, "1.5", "1.4"),
    "maximum": ({"type": "integer", "maximum": 3}, "3", "4"),
    "exclusiveMinimum": ({"type": "integer", "exclusiveMinimum": 3}, "4", "3"),
    "exclusiveMaximum": ({"type": "integer", "exclusiveMaximum": 3}, "2", "3"),
    "multipleOf": ({"type": "integer", "multipleOf": 3}, "6", "7"),
    "minProperties": ({"type": "object", "additionalProperties": {"type": "integer"}, "minProperties": 1},
                      '{"b": 2}', "{}"),
    "maxProperties": ({"type": "object", "additionalProperties": {"type": "integer"}, "maxProperties": 1},
                      '{"b": 2}', '{"b": 2, "c": 3}'),
}
FORMAT_EXAMPLES = {"date": "2024-01-31", "date-time": "2024-01-31T10:00:00Z", "time": "10:00:00Z",
                   "email": "a@b.co", "uuid": "123e4567-e89b-12d3-a456-426614174000", "ipv4": "10.0.0.1",
                   "ipv6": "::1"}


@pytest.fixture(scope="module")
def hf_tokenizer():
    from transformers import AutoTokenizer

    from loraplex.inference_server.model.checkpoint import default_model_path

    gguf = default_model_path()
    return AutoTokenizer.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf))


@pytest.fixture(scope="module")
def grammars(hf_tokenizer) -> GrammarCompiler:
    return GrammarCompiler(hf_tokenizer, len(hf_tokenizer), [EOS])


def _takes(grammars: GrammarCompiler, spec: GrammarSpec, text: str) -> bool:
    """Whether ``text`` is a whole output of ``spec`` (then EOS is allowed)."""
    state = GrammarState(grammars.compile(spec), [EOS])
    return state.matcher.accept_string(text) and state.accept(EOS) and state.ended


def test_every_accepted_keyword_is_enforced(grammars) -> None:
    assert set(ENFORCED) == SCHEMA_KEYWORDS - ANNOTATIONS
    for keyword, (schema, good, bad) in ENFORCED.items():
        spec = GrammarSpec("json_schema", json.dumps(schema))
        assert _takes(grammars, spec, good), keyword
        assert not _takes(grammars, spec, bad), keyword


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_every_accepted_format_is_enforced(grammars, fmt: str) -> None:
    spec = GrammarSpec("json_schema", json.dumps({"type": "string", "format": fmt}))
    assert _takes(grammars, spec, json.dumps(FORMAT_EXAMPLES[fmt]))
    assert not _takes(grammars, spec, '"not a ' + fmt + '"')


@pytest.mark.parametrize("schema, where", [
    ({"type": "object", "properties": {"a": {"oneOf": [{"type": "integer"}]}}}, "'oneOf' at /properties/a/oneOf"),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "'uniqueItems' at /uniqueItems"),
    ({"not": {"type": "string"}}, "'not' at /not"),
    ({"$defs": {"x": {"if": {"type": "string"}}}, "$ref": "#/$defs/x"}, "'if' at /$defs/x/if"),
    ({"type": "object", "patternProperties": {"^x": {}}}, "'patternProperties' at /patternProperties"),
    ({"anyOf": [{"type": "string", "format": "hostname"}]}, "format 'hostname' at /anyOf/0/format"),
])
def test_keywords_xgrammar_would_skip_are_refused_naming_their_place(grammars, schema, where) -> None:
    with pytest.raises(InvalidRequestError) as refused:
        grammars.compile(GrammarSpec("json_schema", json.dumps(schema)))
    assert refused.value.field == "response_format.schema" and where in str(refused.value)
    check_schema(ENFORCED["anyOf"][0])  # and what it supports passes the same check


def test_a_schema_the_library_cannot_compile_is_refused(grammars) -> None:
    with pytest.raises(InvalidRequestError) as refused:
        grammars.compile(GrammarSpec("json_schema", json.dumps({"$ref": "#/$defs/missing"})))
    assert refused.value.field == "response_format.schema" and "refused" in str(refused.value)


def _refusal(grammars: GrammarCompiler, schema: dict) -> str:
    """The message of ``schema``'s refusal at compile time."""
    with pytest.raises(InvalidRequestError) as refused:
        grammars.compile(GrammarSpec("json_schema", json.dumps(schema)))
    assert refused.value.field == "response_format.schema"
    return str(refused.value)


@pytest.mark.parametrize("schema, where", [
    ({"type": "object", "required": ["b"]}, "'b' at /required/0 is not in /properties; declare it in properties"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a", "b"]}, "'b' at /required/1"),
    ({"type": "object", "properties": {"o": {"type": "object", "additionalProperties": {"type": "integer"},
                                             "required": ["x"]}}}, "'x' at /properties/o/required/0"),
])
def test_required_names_properties_does_not_declare_are_refused(grammars, schema, where) -> None:
    assert where in _refusal(grammars, schema)  # xgrammar let {} through for each


@pytest.mark.parametrize("schema", [
    {"type": "integer", "multipleOf": 7, "maximum": 100},  # one bound
    {"type": "integer", "multipleOf": 7, "exclusiveMinimum": 0},
    {"type": "integer", "multipleOf": 7, "minimum": 0, "maximum": 10000},  # 10001 values
    {"type": "integer", "multipleOf": 2.5},  # not whole
    {"type": "integer", "multipleOf": 1025},
    {"type": "number", "multipleOf": 0.5},
    {"type": ["integer", "number"], "multipleOf": 7},
])
def test_multiple_of_is_refused_where_the_library_drops_it(grammars, schema) -> None:
    assert "'multipleOf' at /multipleOf is enforced by the grammar library only on" in _refusal(grammars, schema)


@pytest.mark.parametrize("schema, good, bad", [
    ({"type": "integer", "multipleOf": 7}, ["14", "-21", "0"], ["15", "10826190002568232458"]),
    ({"type": "integer", "multipleOf": 7, "minimum": 0, "maximum": 9999}, ["0", "9996"], ["8", "9997", "10003"]),
    ({"type": "integer", "multipleOf": 7, "minimum": 0.5, "exclusiveMaximum": 10000.5}, ["7", "9996"], ["0", "10003"]),
    ({"type": ["integer", "null"], "multipleOf": 7}, ["7", "null"], ["8"]),
])
def test_multiple_of_is_enforced_where_accepted(grammars, schema, good, bad) -> None:
    spec = GrammarSpec("json_schema", json.dumps(schema))
    assert all(_takes(grammars, spec, text) for text in good)
    assert not any(_takes(grammars, spec, text) for text in bad)


@pytest.mark.parametrize("pattern, words", [
    ("^(?!abc)[a-z]{3}$", "negative lookahead"),  # xgrammar let "abc" through
    ("^(?=a)[a-z]{3}$", "lookahead"),
    ("^[a-z]{3}(?<!c)$", "lookbehind"),
    (r"^a\bb$", "word boundary"),
    (r"^(a)\1$", "backreference"),
    (r"^(?<x>a)\k<x>$", "backreference"),
    ("^(?i)abc$", "inline flag"),
    (r"^\p{L}$", "Unicode property"),
    (r"\Aab\z", "escape \\A"),  # xgrammar: a literal "A", Python's re: the start
    (r"^[\a-z]$", "escape \\a"),  # xgrammar: the bell character to "z"; ECMA-262: "a" to "z"
    (r"^\u{41}$", "\\u{...}"),
    ("a^b", "'^' inside it"),  # xgrammar let "ab" through
    ("(a$)b", "'$' inside it"),
])
def test_regex_features_the_library_drops_or_misreads_are_refused(grammars, pattern, words) -> None:
    message = _refusal(grammars, {"type": "object", "properties": {"p": {"type": "string", "pattern": pattern}}})
    assert "at /properties/p/pattern" in message and words in message


@pytest.mark.parametrize("pattern", [
    "^é.$",  # non-ASCII: xgrammar matched "." against the raw text, quote included
    '^a"b$',  # only a quote could match: written raw
    r"^a\\b$",  # a backslash, written raw (then read as an escape)
    r"^a\tb$",  # a raw tab: invalid JSON
    r"^[\x00-\x1f]$",
    r"^\S{1,10000}$",  # too large for one automaton: matched against the raw text
])
def test_patterns_the_library_would_not_keep_inside_a_json_string_are_refused(grammars, pattern) -> None:
    message = _refusal(grammars, {"type": "string", "pattern": pattern})
    assert "at /pattern is one the grammar library cannot keep inside a JSON string" in message
    assert "refused it" not in message


def test_supported_regex_features_are_enforced(grammars) -> None:
    for pattern, good, bad in [(r"^(?:ab)+(?<n>c)(?P<m>d)?$", "ababcd", "abc d"), ("^a$|^b$", "b", "ab"),
                               (r"^a{2,3}?\d\w\s\S$", "aa1_ x", "a1_ x"), (r"^\u00e9[^\d-]$", "éa", "é-"),
                               (r"^[\w.+-]+\/x$", "a.b/x", "a b/x")]:
        spec = GrammarSpec("json_schema", json.dumps({"type": "string", "pattern": pattern}))
        assert _takes(grammars, spec, json.dumps(good, ensure_ascii=False)), pattern
        assert not _takes(grammars, spec, json.dumps(bad, ensure_ascii=False)), pattern


@pytest.mark.parametrize("schema, where", [
    ({"type": "integer", "enum": [1, 2, 3], "maximum": 2}, "'maximum' at /maximum is ignored beside 'enum'"),
    ({"type": "integer", "const": "a"}, "'a' at /const is not of the type"),
    ({"type": "array", "items": {"type": "string", "enum": ["a", 1]}}, "1 at /items/enum/1 is not of the type"),
    ({"type": "string", "anyOf": [{"type": "integer"}]}, "'type' at /type is ignored beside 'anyOf'"),
    ({"$defs": {"n": {"type": "integer"}}, "$ref": "#/$defs/n", "maximum": 3}, "'maximum' at /maximum is ignored"),
    ({"anyOf": [{"minimum": 5}, {"type": "string"}]}, "'minimum' at /anyOf/0/minimum needs a \"type\""),
    ({"maxLength": 3}, "'maxLength' at /maxLength needs"),
    ({"minItems": 2}, "'minItems' at /minItems needs"),
    ({"properties": {"a": {"type": "integer"}}, "minProperties": 1}, "'minProperties' at /minProperties needs"),
    ({"type": "string", "pattern": "^a+$", "maxLength": 3}, "'maxLength' at /maxLength is ignored beside 'pattern'"),
    ({"type": "string", "format": "email", "minLength": 9}, "'minLength' at /minLength is ignored beside 'format'"),
    ({"type": "string", "format": "date", "pattern": "^1"}, "'pattern' at /pattern is ignored beside 'format'"),
])
def test_keywords_the_library_ignores_beside_others_are_refused(grammars, schema, where) -> None:
    assert where in _refusal(grammars, schema)  # xgrammar let the document breaking it through


@pytest.mark.parametrize("schema", [{"type": {"a": 1}}, {"type": [["integer"]], "const": 1},
                                    {"type": "object", "required": [["a"]]}, {"type": "string", "format": ["date"]}])
def test_malformed_values_are_refused_not_crashed_on(grammars, schema) -> None:
    _refusal(grammars, schema)


@pytest.mark.parametrize("schema, cause", [
    ({"type": "integer", "minimum": 5, "maximum": 3}, "Invalid range: minimum greater than maximum"),
    ({"type": "integer", "maximum": 1e300}, "Integer exceeds maximum limit"),
    ({"type": "string", "pattern": "^a{2,1}$"}, "Lower bound is larger than upper bound: 2 > 1"),
])
def test_library_refusals_read_as_plain_text(grammars, schema, cause) -> None:
    message = _refusal(grammars, schema)
    assert "the grammar library refused it: " in message and message.endswith(cause), message
    assert not re.search(r"\[\d\d:|\.cc:|Check failed", message), message  # no log time, C++ path or check


@pytest.mark.parametrize("schema, good, bad", [
    ({"type": "integer", "minimum": 2.5, "maximum": 4.5}, ["3", "4"], ["2", "5"]),
    ({"type": "integer", "exclusiveMinimum": 2.5, "exclusiveMaximum": 4.5}, ["3", "4"], ["2", "5"]),
    ({"type": "integer", "exclusiveMinimum": -2.5, "exclusiveMaximum": 0.0}, ["-2", "-1"], ["-3", "0"]),
    ({"type": ["integer", "null"], "maximum": -0.5}, ["-1", "null"], ["0"]),
])
def test_fractional_integer_bounds_are_rounded_inward(grammars, schema, good, bad) -> None:
    spec = GrammarSpec("json_schema", json.dumps({"type": "object", "properties": {"n": schema}, "required": ["n"]}))
    assert all(_takes(grammars, spec, f'{{"n": {text}}}') for text in good)
    assert not any(_takes(grammars, spec, f'{{"n": {text}}}') for text in bad)


def test_specs_are_checked_where_they_are_made() -> None:
    for bad, field in [(dict(kind="yaml"), "response_format"), (dict(kind="json_schema", schema="{"),
                                                                 "response_format.schema"),
                       (dict(kind="json_schema", schema="[1]"), "response_format.schema"),
                       (dict(kind="tagged_json", schema="{}"), "response_format")]:
        with pytest.raises(InvalidRequestError) as refused:
            GrammarSpec(**bad)
        assert refused.value.field == field
    spec = GrammarSpec("json_object")
    for stop, field in [(dict(ignore_eos=True), "ignore_eos"), (dict(min_tokens=2), "min_tokens")]:
        with pytest.raises(InvalidRequestError) as refused:
            GenerationRequest("r", (1,), stopping=StoppingCriteria(max_new_tokens=4, **stop), grammar=spec)
        assert refused.value.field == field


def test_compiled_once_per_spec_and_the_cache_is_bounded(hf_tokenizer) -> None:
    grammars = GrammarCompiler(hf_tokenizer, len(hf_tokenizer), [EOS], cache_size=2)
    specs = [GrammarSpec("json_schema", json.dumps({"type": "integer", "maximum": m})) for m in range(3)]
    first = grammars.compile(specs[0])
    assert grammars.compile(GrammarSpec("json_schema", specs[0].schema)) is first and grammars.compiles == 1
    grammars.compile(specs[1])
    grammars.compile(specs[2])  # evicts specs[0], the least recently used
    assert grammars.compile(specs[2]) is not None and grammars.compiles == 3
    assert grammars.compile(specs[0]) is not first and grammars.compiles == 4


def test_tagged_json_alone_or_in_free_text(grammars) -> None:
    schema = json.dumps({"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]})
    whole = GrammarSpec("tagged_json", schema, "<call>", "</call>")
    free = GrammarSpec("tagged_json", schema, "<call>", "</call>", free_text=True)
    assert _takes(grammars, whole, '<call>{"x": 1}</call>')
    assert not _takes(grammars, whole, 'hi <call>{"x": 1}</call>') and not _takes(grammars, whole, "hi")
    assert _takes(grammars, free, 'hi <call>{"x": 1}</call>') and _takes(grammars, free, "just text")
    assert not _takes(grammars, free, 'hi <call>{"x": "one"}</call>')


@pytest.mark.parametrize("kind", ["json_schema", "tagged_json"])
def test_length_bounded_strings_write_control_characters_escaped_or_not_at_all(grammars, kind) -> None:
    # xgrammar's own rule for a string with minLength / maxLength let a raw tab (or any control
    # character but CR and LF) into the string: not JSON
    schema = {"type": "object", "properties": {"s": {"type": "string", "minLength": 1, "maxLength": 8}},
              "required": ["s"]}
    spec = GrammarSpec(kind, json.dumps(schema), *(("<call>", "</call>") if kind == "tagged_json" else ()))
    wrap = (lambda doc: f"<call>{doc}</call>") if kind == "tagged_json" else (lambda doc: doc)
    assert _takes(grammars, spec, wrap('{"s": "caf\u00e9 ok"}'))
    for raw in ("\t", "\x00", "\x1f", "\n"):
        doc = '{"s": "a' + raw + 'b"}'
        assert not _takes(grammars, spec, wrap(doc)), repr(raw)
    assert not _takes(grammars, spec, wrap('{"s": "123456789"}')) and not _takes(grammars, spec, wrap('{"s": ""}'))


def test_bitmask_layout() -> None:
    logits = torch.zeros(2, 70)
    mask = torch.zeros(2, 2, dtype=torch.int32)
    mask[0, 0] = 0b101  # tokens 0 and 2
    mask[1, 1] = -1  # tokens 32-63; 64-69 are past the mask's bits
    apply_bitmask(logits, mask)
    assert (logits[0] == 0).nonzero().flatten().tolist() == [0, 2]
    assert (logits[1] == 0).nonzero().flatten().tolist() == list(range(32, 64))


def test_the_sampler_masks_only_the_constrained_rows() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 64, generator=gen)
    logits[:, 5] = 10.0  # every row's favourite
    mask = torch.zeros(1, 2, dtype=torch.int32)
    mask[0, 1] = 1 << 7  # row 1 may only choose token 39
    rows = [SampleRow(SamplingParams(), (), None) for _ in range(3)]
    biased = SamplingParams(temperature=1.0, logit_bias=((5, -100.0),))
    rows[2] = SampleRow(biased, (), torch.Generator().manual_seed(1))
    result = sample(logits, rows, masks=TokenMasks(torch.tensor([1]), mask))
    assert result.token_ids[:2] == [5, 39] and result.token_ids[2] != 5
    unmasked = sample(logits[:2], rows[:2])
    assert unmasked.token_ids == [5, 5]


def test_mask_filler_fills_the_constrained_rows_only(grammars) -> None:
    state = GrammarState(grammars.compile(GrammarSpec("json_object")), [EOS])
    masks = MaskFiller().masks([None, state, None], 49152, torch.device("cpu"))
    assert masks.rows.tolist() == [1] and masks.bitmask.shape == (1, 49152 // 32)
    logits = torch.zeros(1, 49152)
    apply_bitmask(logits, masks.bitmask)
    assert 0 < int((logits == 0).sum()) < 49152  # '{' and the tokens that start with it
    assert MaskFiller().masks([None, None], 49152, torch.device("cpu")) is None


# ------------------------------------------------------------------------- in the engine (tiny Llama)

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "n"], "additionalProperties": False}
SPECS = [GrammarSpec("json_schema", json.dumps(SCHEMA)), GrammarSpec("json_object")]


@pytest.fixture(scope="module")
def adapter_dir(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_test_adapters(tiny_llama_dir, tmp_path_factory.mktemp("grammar-adapters"))


def _requests(engine, constrained: bool) -> list[GenerationRequest]:
    adapters = [None, *ADAPTER_CONFIGS]
    out = []
    for i in range(8):
        prompt = tuple(engine.tokenizer.encode(f"Item {i}: write some JSON"))
        spec = SPECS[i % 2] if constrained and i % 3 != 2 else None
        stopping = StoppingCriteria(max_new_tokens=24 + i) if spec else StoppingCriteria(max_new_tokens=20,
                                                                                          ignore_eos=True)
        sampling = SamplingParams(temperature=0.8, seed=i) if i == 4 else SamplingParams()
        out.append(GenerationRequest(f"r{i}", prompt, adapters[i % len(adapters)], sampling, stopping, grammar=spec))
    return out


@pytest.mark.parametrize("launch_ahead", [False, True])
def test_constrained_and_free_requests_share_batches(tiny_llama_dir, adapter_dir, grammars, launch_ahead) -> None:
    factory = _deferred if launch_ahead else None
    engine = load_engine(tiny_llama_dir, adapter_dir, runner_factory=factory, max_num_seqs=8)
    mixed = _requests(engine, constrained=True)
    got = run_all(engine, mixed)
    free = [r for r in mixed if r.grammar is None]
    alone = run_all(load_engine(tiny_llama_dir, adapter_dir, max_num_seqs=8), free)
    for r in free:
        assert tokens_of(got[r.request_id]) == tokens_of(alone[r.request_id]), r.request_id
    for r in mixed:
        if r.grammar is None:
            continue
        events = got[r.request_id]
        assert events[-1].finish_reason.value in ("stop", "length"), r.request_id
        state = GrammarState(grammars.compile(r.grammar), [EOS])  # the output is a path through the grammar
        assert all(state.accept(t) for t in tokens_of(events)), r.request_id
        if events[-1].finish_reason.value == "stop":
            assert state.ended
    if launch_ahead:
        assert engine._core.runner.launches > 0
