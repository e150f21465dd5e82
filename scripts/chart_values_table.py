"""Write the values table of helm/loraplex/README.md from values.schema.json and values.yaml.

Each row is one leaf value: its dotted name, its default (from values.yaml) and what it does
(the schema's description, with its allowed values or range). The table sits between the
README's `<!-- values:start -->` and `<!-- values:end -->` lines; tests/helm/test_helm_values.py
fails when it is stale.

Usage: python scripts/chart_values_table.py [--check]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import yaml

CHART = Path(__file__).resolve().parents[1] / "helm" / "loraplex"
START, END = "<!-- values:start -->", "<!-- values:end -->"


def _limits(schema: dict[str, Any]) -> str:
    if "enum" in schema:
        return "one of " + ", ".join(f"`{v if isinstance(v, str) else json.dumps(v)}`" for v in schema["enum"])
    parts = []
    if "minimum" in schema and "integer" in str(schema.get("type")):
        parts.append(f">= {schema['minimum']}")
    if "maximum" in schema:
        parts.append(f"<= {schema['maximum']}")
    return " and ".join(parts)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def rows(values: Any, schema: dict[str, Any], path: str = "") -> list[tuple[str, str, str]]:
    """(name, default, description) of every leaf under ``values``, depth first in file order."""
    out = []
    for key, value in values.items():
        sub = schema.get("properties", {}).get(key, {})
        name = f"{path}{key}"
        if isinstance(value, dict) and sub.get("properties"):
            out += rows(value, sub, f"{name}.")
            continue
        default = json.dumps(value) if not isinstance(value, str) else (f'"{value}"' if value else '""')
        description = sub.get("description", "")
        limits = _limits(sub)
        out.append((name, default, f"{description} ({limits})" if limits else description))
    return out


def table() -> str:
    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    lines = ["| Value | Default | What it does |", "| --- | --- | --- |"]
    lines += [f"| `{n}` | `{_cell(d)}` | {_cell(t)} |" for n, d, t in rows(values, schema)]
    return "\n".join(lines)


def with_table(readme: str) -> str:
    """``readme`` with the block between the markers replaced by the current table."""
    head, sep, rest = readme.partition(START)
    _, sep2, tail = rest.partition(END)
    if not sep or not sep2:
        raise ValueError(f"README.md lacks the {START} / {END} markers")
    return f"{head}{START}\n{table()}\n{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if README.md is stale, write nothing")
    args = parser.parse_args(argv)
    path = CHART / "README.md"
    current = path.read_text()
    fresh = with_table(current)
    if args.check:
        if fresh != current:
            print(f"{path}: the values table is stale; run python scripts/chart_values_table.py", file=sys.stderr)
            return 1
        return 0
    path.write_text(fresh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
