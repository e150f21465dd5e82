"""What of a JSON schema xgrammar enforces, checked before it compiles one. xgrammar skips with
only a log line every keyword it does not implement, and several it implements only in some
places: a keyword beside ``enum``, ``const``, ``anyOf`` or ``$ref``; a number, string, array or
object keyword without a ``type``; ``minLength``/``maxLength`` beside ``pattern`` or ``format``;
``required`` names that ``properties`` does not declare; ``multipleOf`` outside a few cases; a
regex feature it does not read (schema_patterns.py). ``check_schema`` refuses each of these naming
its place, so a schema is enforced whole or refused, never half-enforced (tests/engine/
test_grammar.py shows each accepted keyword enforced and each refusal).

``with_whole_integer_bounds`` rounds an integer's fractional bounds inward, which xgrammar refuses
although JSON Schema allows them; the compiler applies it before compiling.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

from loraplex.adapter_store.errors import InvalidRequestError
from loraplex.inference_server.engine.schema_patterns import pattern_problem

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

# keywords xgrammar applies only where "type" names theirs (it infers no type from them)
_TYPED = {**dict.fromkeys(("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"), "integer"),
          **dict.fromkeys(("minLength", "maxLength", "pattern", "format"), "string"),
          **dict.fromkeys(("minItems", "maxItems"), "array"),
          **dict.fromkeys(("minProperties", "maxProperties"), "object")}
# keywords whose values or subschemas xgrammar takes alone, ignoring every validation keyword beside
# them: what to do instead
_ALONE = {"enum": "drop it, or the values it rules out", "const": "drop it", "anyOf": "move it into each branch",
          "$ref": "move it into the schema $ref names"}
_BESIDE_ANY = ANNOTATIONS | {"$defs", "definitions"}
# string keywords xgrammar ignores beside another: {ignored: {what it yields to: what to do instead}}
_LENGTH_CLASHES = {"pattern": "write the length into the pattern (e.g. ^[a-z]{1,30}$)", "format": "drop it"}
_STRING_CLASHES = {"minLength": _LENGTH_CLASHES, "maxLength": _LENGTH_CLASHES, "pattern": {"format": "drop one"}}
# integer bounds rounded inward: x >= 2.5 is x >= 3, x > 2.5 is x > 2, x <= 3.5 is x <= 3, x < 3.5 is x < 4
_INWARD = {"minimum": math.ceil, "exclusiveMinimum": math.floor, "maximum": math.floor, "exclusiveMaximum": math.ceil}
# xgrammar enforces an integer's multipleOf (a whole number up to this) unbounded or within two bounds
MULTIPLE_OF_MAX = 1024
MULTIPLE_OF_RANGE_MAX = 10_000  # values between the two bounds


def check_schema(schema: Any, field: str = SCHEMA_FIELD, path: str = "") -> None:
    """Refuse (InvalidRequestError naming ``field`` and the keyword's place in the schema) a
    schema that uses a keyword, a format, a combination or a regex that xgrammar does not enforce."""
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise InvalidRequestError(f"the schema at {path or '/'} must be an object or a boolean", field)
    for key, value in schema.items():
        _check_keyword(key, value, field, f"{path}/{key}")
    for check in (_check_alone, _check_typed, _check_string_clashes, _check_required, _check_multiple_of):
        check(schema, field, path)
    for where, sub in _subschemas(schema, field, path):
        check_schema(sub, field, where)


def with_whole_integer_bounds(schema: Any) -> Any:
    """``schema`` with the fractional bounds of every integer-only schema in it rounded inward
    (the same integers pass); the rest as it is."""
    if not isinstance(schema, dict):
        return schema
    out = {key: _map_subschemas(key, value, with_whole_integer_bounds) for key, value in schema.items()}
    if _integer_only(schema):
        out.update({key: _INWARD[key](value) for key, value in schema.items() if key in _INWARD and _finite(value)})
    return out


def _check_keyword(key: str, value: Any, field: str, where: str) -> None:
    if key not in SCHEMA_KEYWORDS:
        raise InvalidRequestError(f"keyword {key!r} at {where} is not supported; supported: "
                                  f"{', '.join(sorted(SCHEMA_KEYWORDS - ANNOTATIONS))}", field)
    if key == "format" and (not isinstance(value, str) or value not in FORMATS):
        raise InvalidRequestError(f"format {value!r} at {where} is not supported; supported: "
                                  f"{', '.join(sorted(FORMATS))}", field)
    if key == "pattern" and isinstance(value, str) and (problem := pattern_problem(value)):
        raise InvalidRequestError(f"pattern {value!r} at {where} {problem}", field)


def _check_alone(schema: dict, field: str, path: str) -> None:
    """enum, const, anyOf and $ref with nothing beside them but annotations and definitions (and,
    for enum and const, a type all their values have)."""
    alone = next((key for key in _ALONE if key in schema), None)
    if alone is None:
        return
    allowed = _BESIDE_ANY | {alone} | ({"type"} if alone in ("enum", "const") else set())
    beside = next((key for key in schema if key not in allowed), None)
    if beside is not None:
        raise InvalidRequestError(f"keyword {beside!r} at {path}/{beside} is ignored beside {alone!r} by the grammar "
                                  f"library; {_ALONE[alone]}", field)
    if "type" in schema:
        values = schema["enum"] if alone == "enum" else [schema["const"]]
        for i, value in enumerate(values if isinstance(values, list) else []):
            if not _types(schema) & _json_types(value):
                where = f"{path}/enum/{i}" if alone == "enum" else f"{path}/const"
                raise InvalidRequestError(f"the value {value!r} at {where} is not of the type at {path}/type "
                                          f"({schema['type']!r}); the grammar library would write it anyway", field)


def _check_typed(schema: dict, field: str, path: str) -> None:
    if "type" in schema:
        return
    for key, kind in _TYPED.items():
        if key in schema:
            raise InvalidRequestError(f"keyword {key!r} at {path}/{key} needs a \"type\" beside it (e.g. "
                                      f"\"{kind}\"): the grammar library ignores it in a schema without one", field)


def _check_string_clashes(schema: dict, field: str, path: str) -> None:
    for key, stronger in _STRING_CLASHES.items():
        clash = next((other for other in stronger if other in schema), None) if key in schema else None
        if clash:
            raise InvalidRequestError(f"keyword {key!r} at {path}/{key} is ignored beside {clash!r} by the grammar "
                                      f"library; {stronger[clash]}", field)


def _check_required(schema: dict, field: str, path: str) -> None:
    """xgrammar enforces a required name only where ``properties`` declares it."""
    required = schema.get("required", [])
    if not isinstance(required, list):
        raise InvalidRequestError(f"{path}/required must be a list of property names", field)
    properties = schema.get("properties")
    declared = properties if isinstance(properties, dict) else {}
    for i, name in enumerate(required):
        if not isinstance(name, str) or name not in declared:
            raise InvalidRequestError(f"required name {name!r} at {path}/required/{i} is not in {path}/properties; "
                                      f"declare it in properties (the grammar library enforces only declared "
                                      f"required properties)", field)


def _check_multiple_of(schema: dict, field: str, path: str) -> None:
    """xgrammar enforces multipleOf on integers only, for a whole number 1..MULTIPLE_OF_MAX, with
    no bounds or with both (at most MULTIPLE_OF_RANGE_MAX values apart); elsewhere it drops it."""
    if "multipleOf" not in schema:
        return
    value, (low, high) = schema["multipleOf"], _integer_range(schema)
    whole = _finite(value) and float(value).is_integer() and 1 <= value <= MULTIPLE_OF_MAX
    bounds_ok = (low is None and high is None) or (
        low is not None and high is not None and high - low < MULTIPLE_OF_RANGE_MAX)
    if not (whole and _integer_only(schema) and bounds_ok):
        raise InvalidRequestError(
            f"keyword 'multipleOf' at {path}/multipleOf is enforced by the grammar library only on \"type\": "
            f"\"integer\", as a whole number from 1 to {MULTIPLE_OF_MAX}, with no bounds or with both a lower and "
            f"an upper bound at most {MULTIPLE_OF_RANGE_MAX} values apart", field)


def _integer_range(schema: dict) -> tuple[int | None, int | None]:
    """The lowest and highest integers ``schema``'s bounds allow (None: unbounded; a bound that
    is not a finite number counts as none: the library refuses it)."""
    def bound(key: str, step: int) -> int | None:
        value = schema.get(key)
        return _INWARD[key](value) + step if _finite(value) else None

    lows = [b for b in (bound("minimum", 0), bound("exclusiveMinimum", 1)) if b is not None]
    highs = [b for b in (bound("maximum", 0), bound("exclusiveMaximum", -1)) if b is not None]
    return (max(lows) if lows else None), (min(highs) if highs else None)


def _subschemas(schema: dict, field: str, path: str) -> Iterator[tuple[str, Any]]:
    """(place, subschema) of each schema directly inside ``schema``."""
    for key, value in schema.items():
        where = f"{path}/{key}"
        if key in _SCHEMA_MAPS:
            if not isinstance(value, dict):
                raise InvalidRequestError(f"{where} must be an object", field)
            yield from ((f"{where}/{name}", sub) for name, sub in value.items())
        elif key in _SCHEMA_LISTS:
            if not isinstance(value, list):
                raise InvalidRequestError(f"{where} must be a list", field)
            yield from ((f"{where}/{i}", sub) for i, sub in enumerate(value))
        elif key in _SCHEMA_VALUES:
            yield where, value


def schema_patterns(schema: Any, path: str = "") -> Iterator[tuple[str, str]]:
    """(place, regex) of every ``pattern`` in a schema that ``check_schema`` passed."""
    if not isinstance(schema, dict):
        return
    if isinstance(schema.get("pattern"), str):
        yield f"{path}/pattern", schema["pattern"]
    for where, sub in _subschemas(schema, SCHEMA_FIELD, path):
        yield from schema_patterns(sub, where)


def _map_subschemas(key: str, value: Any, fn: Any) -> Any:
    if key in _SCHEMA_MAPS and isinstance(value, dict):
        return {name: fn(sub) for name, sub in value.items()}
    if key in _SCHEMA_LISTS and isinstance(value, list):
        return [fn(sub) for sub in value]
    return fn(value) if key in _SCHEMA_VALUES else value


def _types(schema: dict) -> set[str]:
    kinds = schema.get("type")
    return {kind for kind in (kinds if isinstance(kinds, list) else [kinds]) if isinstance(kind, str)}


def _integer_only(schema: dict) -> bool:
    """Numbers in ``schema`` must be integers ("integer" among its types, "number" not)."""
    types = _types(schema)
    return "integer" in types and "number" not in types


def _json_types(value: Any) -> set[str]:
    if isinstance(value, bool):
        return {"boolean"}
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer()):
        return {"integer", "number"}
    names = {float: "number", str: "string", type(None): "null", list: "array", dict: "object"}
    return {names.get(type(value), "")}


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
