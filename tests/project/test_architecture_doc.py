"""docs/ARCHITECTURE.md is the map of the code: every file it names exists, so a move that
forgets the map fails here."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("inference_server", "adapter_store", "kernels", "clients")


def test_every_file_the_map_names_exists() -> None:
    text = (REPO / "docs" / "ARCHITECTURE.md").read_text()
    named = set(re.findall(r"\b([a-z_]+(?:/[a-z_<>]+)*/[a-z_]+\.py)\b", text))
    assert len(named) > 20, named
    missing = []
    for path in sorted(named):
        if "<" in path:
            continue
        candidates = [REPO / path] + [REPO / package / path for package in PACKAGES]
        if not any(c.is_file() for c in candidates):
            missing.append(path)
    assert not missing, f"docs/ARCHITECTURE.md names files that do not exist: {missing}"
