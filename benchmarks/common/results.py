"""A benchmark's current section of benchmarks/RESULTS.md, written in place.

RESULTS.md is a page of current standing: the targets table first, then one section per
benchmark configuration, each headed ``## <title>`` and holding the date, commit, machine and
command of its newest run, its table and its notes. ``record_results`` writes a run's section
where the page already has one of that title (the title is the key: the same benchmark with
the same configuration writes the same title), and appends it where the page has none; every
other part of the page is left as it is, byte for byte.

History is left to git, not to a second file: the page is committed with the figures it
reports, so ``git log -p benchmarks/RESULTS.md`` holds every section a run replaced, with the
commit that replaced it. A history file appended to by every run would be the dated diary again
under another name. The log kept before this page existed is frozen in
benchmarks/history/RESULTS-2026.md.
"""

from __future__ import annotations

import datetime as dt
import os
import platform
import subprocess
from pathlib import Path

from benchmarks import ROOT as REPO


def machine() -> str:
    """The GPU's name, or the CPU's architecture and core count where there is none."""
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return f"{platform.machine()} CPU, {os.cpu_count()} cores"


def commit() -> str:
    """The short hash of the repository's HEAD, or "unknown"."""
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True, cwd=REPO).stdout.strip() or "unknown"
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def format_section(title: str, command: str, lines: list[str], notes: str = "",
                   machine_name: str | None = None) -> str:
    """'## title', then date, commit, machine (``machine_name`` or ``machine()``) and command, the
    table ``lines`` and ``notes``; ends with a blank line."""
    head = [
        f"## {title}",
        "",
        f"- date: {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC",
        f"- commit: {commit()}",
        f"- machine: {machine_name or machine()}",
        f"- command: `{command}`",
        "",
    ]
    return "\n".join(head + lines + ([""] + [notes] if notes else []) + ["", ""])


def record_results(path: Path, title: str, command: str, lines: list[str], notes: str = "",
                   machine_name: str | None = None) -> None:
    """Write this run's section '## title' into the page at ``path``: in place of the section of
    that title (replace_section), or at the end where there is none."""
    replace_section(path, title, format_section(title, command, lines, notes, machine_name))


def _heading_offsets(text: str) -> list[tuple[int, str]]:
    """(character offset, line) of every line that starts a section: a '# ' or '## ' heading
    outside fenced code blocks. Deeper headings ('### ') stay inside their section."""
    out, offset, fenced = [], 0, False
    for line in text.splitlines(keepends=True):
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (line.startswith("# ") or line.startswith("## ")):
            out.append((offset, line.rstrip("\r\n")))
        offset += len(line)
    return out


def replace_section(path: Path, title: str, text: str) -> None:
    """Put ``text`` (a section that starts with '## title') in place of the page's section of that
    title: from its heading to the next '#' or '##' heading, or the end of the page. Where the page
    holds several sections of that title (the old diary did), the first takes ``text`` and the later
    ones are removed. Where it holds none, ``text`` is appended (append_section). The rest of the
    page is not changed; a blank line is put before the heading if the text above ran into it."""
    page = path.read_text(encoding="utf-8") if path.exists() else ""
    heading = f"## {title}"
    starts = _heading_offsets(page)
    spans = [(start, starts[i + 1][0] if i + 1 < len(starts) else len(page))
             for i, (start, line) in enumerate(starts) if line.rstrip() == heading]
    if not spans:
        append_section(path, text)
        return
    for start, end in reversed(spans[1:]):
        page = page[:start] + page[end:]
    start, end = spans[0]
    before, after = page[:start], page[end:]
    if before and not before.endswith("\n\n"):
        before += "\n"
    path.write_text(before + text.rstrip("\n") + "\n\n" + after, encoding="utf-8")


def append_section(path: Path, text: str) -> None:
    """Append ``text`` as a section of its own: a blank line before it whatever the file ends with."""
    tail = path.read_bytes()[-2:] if path.exists() else b"\n\n"
    gap = "" if tail == b"\n\n" else ("\n" if tail.endswith(b"\n") else "\n\n")
    with open(path, "a", encoding="utf-8") as f:
        f.write(gap + text)
