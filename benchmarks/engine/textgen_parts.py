"""bench_textgen's results kept per workload across runs (``--parts-dir``).

The whole benchmark (five workloads of 1000 requests and the transformers + PEFT batch) takes
longer than one call on a lent GPU may run. With a parts folder, each run writes what it
measured there (one file per workload, one for the fixed batch), and the table is built from
every part in the folder: runs made back to back on one machine add up to the one table. Each
part names the command and the host that made it, so a table mixing machines says so.
"""

from __future__ import annotations

import json
import re
import socket
from dataclasses import dataclass, field
from pathlib import Path

FIXED_FILE = "fixed-batch.json"


def host() -> str:
    """This machine and its GPU, as the parts record it."""
    try:
        import torch

        if torch.cuda.is_available():  # the uuid tells apart the GPUs of one host
            props = torch.cuda.get_device_properties(0)
            gpu = f"{props.name}, GPU-{str(getattr(props, 'uuid', '?'))[:8]}"
        else:
            gpu = "no GPU"
    except ImportError:
        gpu = "no torch"
    return f"{socket.gethostname()} ({gpu})"


def _write(path: Path, payload: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(payload, indent=1))
    tmp.replace(path)  # a part is whole or absent


def save_row(parts_dir: Path, row: dict, command: str) -> None:
    """One workload's measured row (its ``workload`` label names the file)."""
    parts_dir.mkdir(parents=True, exist_ok=True)
    name = re.sub(r"[^a-z0-9]+", "-", row["workload"].lower()).strip("-")
    _write(parts_dir / f"row-{name}.json", {"command": command, "host": host(), "row": row})


def save_fixed(parts_dir: Path, fixed: dict, command: str) -> None:
    """The fixed batch: {new_tokens, adapters, hf: [base, mixed], loraplex: {name: tokens/s}}."""
    parts_dir.mkdir(parents=True, exist_ok=True)
    _write(parts_dir / FIXED_FILE, {"command": command, "host": host(), "fixed": fixed})


@dataclass
class Parts:
    rows: list[dict] = field(default_factory=list)
    fixed: dict | None = None
    commands: list[str] = field(default_factory=list)
    hosts: list[str] = field(default_factory=list)


def load(parts_dir: Path, order: tuple[str, ...]) -> Parts:
    """Every part in the folder: rows in ``order`` of their workload (labels that start with
    the same workload keep their file order), the fixed batch, and the distinct commands and
    hosts in the order first seen."""
    parts = Parts()
    loaded = [json.loads(p.read_text()) for p in sorted(parts_dir.glob("row-*.json"))]
    rank = {w: i for i, w in enumerate(order)}
    loaded.sort(key=lambda part: rank.get(part["row"]["workload"].split()[0], len(order)))
    fixed_path = parts_dir / FIXED_FILE
    if fixed_path.exists():
        part = json.loads(fixed_path.read_text())
        parts.fixed = part["fixed"]
        loaded.append(part)
    for part in loaded:
        if "row" in part:
            parts.rows.append(part["row"])
        for key, seen in (("command", parts.commands), ("host", parts.hosts)):
            if part[key] not in seen:
                seen.append(part[key])
    return parts
