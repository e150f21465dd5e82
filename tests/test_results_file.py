"""benchmarks/results.py appends each benchmark's section to RESULTS.md as a section of its own,
whatever the file ended with (a hand-written note ending without a blank line must not run
into the next heading)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from results import append_results, append_section  # noqa: E402


@pytest.mark.parametrize("before", [None, "", "note", "note\n", "note\n\n"])
def test_a_section_starts_after_a_blank_line(tmp_path, before) -> None:
    path = tmp_path / "RESULTS.md"
    if before is not None:
        path.write_text(before)
    append_section(path, "## new\n\nbody\n\n")
    text = path.read_text()
    assert text.endswith("## new\n\nbody\n\n")
    head = text[: -len("## new\n\nbody\n\n")]
    assert head == "" or head.endswith("\n\n")
    assert head.rstrip("\n") == (before or "").rstrip("\n")


def test_append_results_writes_date_commit_machine_command_and_table(tmp_path) -> None:
    path = tmp_path / "RESULTS.md"
    path.write_text("earlier note")
    append_results(path, "Title", "python bench.py --x", ["| a | b |", "| --- | --- |", "| 1 | 2 |"], notes="why")
    lines = path.read_text().split("\n")
    start = lines.index("## Title")
    assert lines[start - 1] == "" and lines[0] == "earlier note"
    assert any(ln.startswith("- date: ") for ln in lines) and any(ln.startswith("- commit: ") for ln in lines)
    assert "- command: `python bench.py --x`" in lines and "| 1 | 2 |" in lines and "why" in lines
