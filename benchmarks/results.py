"""Append a dated, attributable section to benchmarks/RESULTS.md."""

from __future__ import annotations

import datetime as dt
import platform
import subprocess
from pathlib import Path


def machine() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name(0)
    except ImportError:
        pass
    import os

    return f"{platform.machine()} CPU, {os.cpu_count()} cores"


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def append_results(path: Path, title: str, command: str, lines: list[str], notes: str = "") -> None:
    """Add '## title' with date, commit, machine, command, the table and notes."""
    head = [
        f"## {title}",
        "",
        f"- date: {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC",
        f"- commit: {commit()}",
        f"- machine: {machine()}",
        f"- command: `{command}`",
        "",
    ]
    body = head + lines + ([""] + [notes] if notes else []) + ["", ""]
    append_section(path, "\n".join(body))


def append_section(path: Path, text: str) -> None:
    """Append ``text`` as a section of its own: a blank line before it whatever the file ends with."""
    tail = path.read_bytes()[-2:] if path.exists() else b"\n\n"
    gap = "" if tail == b"\n\n" else ("\n" if tail.endswith(b"\n") else "\n\n")
    with open(path, "a", encoding="utf-8") as f:
        f.write(gap + text)
