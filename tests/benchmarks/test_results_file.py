"""benchmarks/common/results.py writes each benchmark's section of RESULTS.md: a run replaces the
section of its title and leaves the rest of the page as it was; a title the page does not have
yet is appended as a section of its own, whatever the file ended with (a hand-written note
ending without a blank line must not run into the next heading). And benchmarks/RESULTS.md
itself reads as a report: short, the targets table first, no session diary."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import pytest

from benchmarks.common.results import append_section, format_section, record_results, replace_section

REPO = Path(__file__).resolve().parents[2]

TABLE = ["| a | b |", "| --- | --- |", "| 1 | 2 |"]
PAGE_HEAD = "# Results\n\n## Targets\n\n| target | current |\n| --- | --- |\n| x <= 1 | 0.9 |\n\n"
OTHER = "## Other benchmark\n\n- date: 2026-01-01 00:00 UTC\n\n| c |\n| --- |\n| 7 |\n\nits why\n\n"


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


@pytest.mark.parametrize("before", [None, "", "note", "note\n", "note\n\n"])
def test_a_new_title_is_appended_after_a_blank_line(tmp_path, before) -> None:
    path = tmp_path / "RESULTS.md"
    if before is not None:
        path.write_text(before)
    record_results(path, "New", "python bench.py", TABLE)
    text = path.read_text()
    head, sep, _ = text.partition("## New\n")
    assert sep and (head == "" or head.endswith("\n\n"))
    assert head.rstrip("\n") == (before or "").rstrip("\n")
    assert text.endswith("| 1 | 2 |\n\n")


def test_record_results_writes_date_commit_machine_command_table_and_notes(tmp_path) -> None:
    path = tmp_path / "RESULTS.md"
    path.write_text("earlier note")
    record_results(path, "Title", "python bench.py --x", TABLE, notes="why")
    lines = path.read_text().split("\n")
    start = lines.index("## Title")
    assert lines[start - 1] == "" and lines[0] == "earlier note"
    section = lines[start:]
    assert any(ln.startswith("- date: ") and ln.endswith(" UTC") for ln in section)
    assert any(ln.startswith("- commit: ") and len(ln) > len("- commit: ") for ln in section)
    assert any(ln.startswith("- machine: ") and len(ln) > len("- machine: ") for ln in section)
    assert "- command: `python bench.py --x`" in section and "| 1 | 2 |" in section and "why" in section
    assert section.index("- command: `python bench.py --x`") < section.index("| a | b |") < section.index("why")


def test_a_second_run_replaces_its_section_and_leaves_the_others(tmp_path) -> None:
    path = tmp_path / "RESULTS.md"
    path.write_text(PAGE_HEAD)
    record_results(path, "Bench A", "python a.py", ["| t |", "| --- |", "| old figure |"], notes="first run")
    append_section(path, OTHER)
    before = path.read_text()
    record_results(path, "Bench A", "python a.py --again", ["| t |", "| --- |", "| new figure |"],
                   notes="second run")
    text = path.read_text()
    assert text.count("## Bench A\n") == 1
    assert "new figure" in text and "second run" in text and "--again" in text
    assert "old figure" not in text and "first run" not in text
    # the page's head and the other section are byte for byte what they were, in their places
    assert text.startswith(PAGE_HEAD) and text.endswith(OTHER)
    assert text.index("## Bench A") < text.index("## Other benchmark")
    assert before.startswith(PAGE_HEAD) and before.endswith(OTHER)
    # and the section between them is exactly what a run writes
    section = text[len(PAGE_HEAD): len(text) - len(OTHER)]
    assert section.startswith("## Bench A\n\n- date: ") and section.endswith("second run\n\n")


def test_a_title_that_extends_another_is_another_section(tmp_path) -> None:
    path = tmp_path / "RESULTS.md"
    path.write_text("## Kernels: add_lora\n\nkept\n\n## Kernels\n\nold\n\n")
    record_results(path, "Kernels", "python k.py", TABLE)
    text = path.read_text()
    assert text.startswith("## Kernels: add_lora\n\nkept\n\n## Kernels\n\n- date: ") and "old" not in text


def test_the_last_section_and_one_that_ran_into_the_text_above(tmp_path) -> None:
    path = tmp_path / "RESULTS.md"
    path.write_text("intro\n## Last\n\nold\n")  # the heading follows the text without a blank line
    replace_section(path, "Last", "## Last\n\nnew\n")
    assert path.read_text() == "intro\n\n## Last\n\nnew\n\n"


def test_subsections_belong_to_their_section_and_fenced_headings_do_not_end_one(tmp_path) -> None:
    path = tmp_path / "RESULTS.md"
    path.write_text("## A\n\n### sub\n\nold\n\n```\n## not a heading\n```\n\n## B\n\nkept\n")
    replace_section(path, "A", "## A\n\nnew\n\n")
    assert path.read_text() == "## A\n\nnew\n\n## B\n\nkept\n"


def test_duplicate_sections_of_one_title_become_one_in_the_first_place(tmp_path) -> None:
    path = tmp_path / "RESULTS.md"
    path.write_text("## A\n\nold 1\n\n## B\n\nkept\n\n## A\n\nold 2\n\n## C\n\nkept too\n\n")
    replace_section(path, "A", format_section("A", "python a.py", TABLE))
    text = path.read_text()
    assert text.count("## A\n") == 1 and "old 1" not in text and "old 2" not in text
    assert text.index("## A") < text.index("## B\n\nkept\n\n## C\n\nkept too\n\n")
    assert text.endswith("## B\n\nkept\n\n## C\n\nkept too\n\n")


# The page itself (benchmarks/RESULTS.md): a report of current standing.
PAGE = REPO / "benchmarks" / "RESULTS.md"


def test_results_page_is_short_and_starts_with_the_targets_table() -> None:
    lines = PAGE.read_text(encoding="utf-8").split("\n")
    assert len(lines) <= 260
    headings = [ln for ln in lines if ln.startswith("## ")]
    assert headings and headings[0] == "## Targets"
    first_table = next(ln for ln in lines if ln.startswith("|"))
    assert first_table.lower().startswith("| target |")
    assert lines.index(first_table) < lines.index(headings[1])  # the table is in the first section


def test_results_page_has_no_session_diary_and_links_its_history_and_method() -> None:
    text = PAGE.read_text(encoding="utf-8")
    assert not re.search(r"\bsession \d+", text, re.IGNORECASE)
    assert "QA:" not in text
    assert "history/RESULTS-2026.md" in text and (REPO / "benchmarks" / "history" / "RESULTS-2026.md").is_file()
    assert "docs/PERFORMANCE.md" in text and (REPO / "docs" / "PERFORMANCE.md").is_file()


# The dated log kept before RESULTS.md existed: closed for good. New figures go to RESULTS.md (a run
# replaces its own section there) and its history to git; this file does not change again.
HISTORY_SHA256 = "87c1b242a47bdf4e9f5f9109e28d5f2eb5ad30340fba2fae7813e16b4ef4fe3f"


def test_the_2026_history_is_closed() -> None:
    digest = hashlib.sha256((REPO / "benchmarks" / "history" / "RESULTS-2026.md").read_bytes()).hexdigest()
    assert digest == HISTORY_SHA256, (
        "benchmarks/history/RESULTS-2026.md changed: it is closed; record new runs in benchmarks/RESULTS.md")
