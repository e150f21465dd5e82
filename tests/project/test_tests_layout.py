"""tests/ mirrors the packages (#43): every test file sits in the folder of what it tests, the
shared helpers and fixtures in tests/support/ (pyproject's only pythonpath entry), and a test
imports another test file only from its own folder."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_no_test_file_at_the_top_of_tests() -> None:
    assert sorted(p.name for p in TESTS.glob("*.py")) == ["conftest.py"]


def test_tests_import_test_files_of_their_own_folder_only() -> None:
    bad = []
    for path in sorted(TESTS.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            module = node.module if isinstance(node, ast.ImportFrom) else None
            if module and module.startswith("test_") and not (path.parent / f"{module}.py").exists():
                bad.append(f"{path.relative_to(TESTS)}:{node.lineno} imports {module}")
    assert not bad, "move what they share into tests/support/:\n" + "\n".join(bad)
