"""The seams inside the server and the store are typed (#43): a capability is a Protocol the
caller checks by name (``isinstance(source, TenantScopedSource)``) or a constructor argument,
never a ``hasattr`` / ``getattr(obj, "name", default)`` probe, and the edge core's caller is a
``Caller``, not ``Any``. Read from the sources. Probes of objects this project does not define
(a transformers tokenizer, a gRPC request iterator, a logged callable) are listed with why."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("inference_server", "adapter_store")
FOREIGN_PROBES = {  # (file, the probed attribute): why it is not one of our seams
    ("inference_server/model/tokenizer.py", "is_fast"): "a transformers tokenizer",
    ("adapter_store/decoding.py", "__aiter__"): "gRPC hands a request or a request iterator",
    ("adapter_store/store.py", "__name__"): "the name of a callable, for a log line",
}


def probes(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, attribute) of each hasattr(x, "a") and getattr(x, "a", default) in ``tree``."""
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
            continue
        name, args = node.func.id, node.args
        literal = len(args) >= 2 and isinstance(args[1], ast.Constant) and isinstance(args[1].value, str)
        if literal and (name == "hasattr" or (name == "getattr" and len(args) == 3)):
            found.append((node.lineno, args[1].value))
    return found


def test_no_capability_probes_in_the_server_or_the_store() -> None:
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            found += [f"{rel}:{line}: probes {attr!r}" for line, attr in probes(ast.parse(path.read_text()))
                      if (rel, attr) not in FOREIGN_PROBES]
    assert not found, "capability probes (make them a Protocol or an argument):\n" + "\n".join(found)


@pytest.mark.parametrize("source, count", [
    ('if hasattr(source, "watch"):\n    pass\n', 1),
    ('make = getattr(source, "for_caller", None)\n', 1),
    ("value = getattr(self, name)\n", 0),  # reading a field by a computed name is no probe
    ("if isinstance(source, ChangeFollowedSource):\n    pass\n", 0),
])
def test_the_probe_finder_finds_probes(source: str, count: int) -> None:
    assert len(probes(ast.parse(source))) == count


def test_the_edge_core_takes_a_caller_not_any() -> None:
    untyped = []
    for path in sorted((ROOT / "inference_server" / "edge").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.arg) and node.arg == "context" and ast.unparse(node.annotation or ast.Name("?")) != "Caller":
                untyped.append(f"{path.name}:{node.lineno}")
    assert not untyped, f"context parameters not typed Caller: {untyped}"
