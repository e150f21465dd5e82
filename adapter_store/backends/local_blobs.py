"""Blob backend on a local directory (the embedded default).

Layout under ``root``: ``<id>@head.json`` (the head) and ``<id>@<version>.blob`` next to
it, ``<id>`` being ``name`` or ``tenant/name``. Files are written to ``root/.tmp`` and
moved in with one rename, so nothing half-written is ever visible.
"""

from __future__ import annotations

import hashlib
import os
import uuid
from pathlib import Path

from loraplex.adapter_store.backends.base import ANY_HEAD
from loraplex.adapter_store.errors import BackendUnavailable, BlobMissing, HeadChanged

HEAD_SUFFIX = "@head.json"
BLOB_SUFFIX = ".blob"
MARKER_FILE = ".store-marker"  # a dot name: list_heads skips it


class LocalBlobBackend:
    """Blobs and heads as files; atomic by write-to-temp-then-rename."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root).resolve()
        self._tmp = self.root / ".tmp"
        self._tmp.mkdir(parents=True, exist_ok=True)
        self.description = f"local directory {self.root}"

    def _path(self, name: str, suffix: str) -> Path:
        path = (self.root / (name + suffix)).resolve()
        if self.root not in path.parents:  # ids are validated upstream; this is a second guard
            raise ValueError(f"{name!r} escapes {self.root}")
        return path

    def _write(self, path: Path, data: bytes) -> None:
        tmp = self._tmp / uuid.uuid4().hex
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            path.parent.mkdir(parents=True, exist_ok=True)
            os.replace(tmp, path)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise BackendUnavailable(self.description, str(e)) from e

    def write_blob(self, key: str, data: bytes) -> None:
        self._write(self._path(key, BLOB_SUFFIX), data)

    def read_blob(self, key: str) -> bytes:
        try:
            return self._path(key, BLOB_SUFFIX).read_bytes()
        except FileNotFoundError:
            raise BlobMissing(key) from None

    def delete_blob(self, key: str) -> None:
        self._path(key, BLOB_SUFFIX).unlink(missing_ok=True)

    def list_blobs(self, adapter_id: str, modified_before: float | None = None) -> list[str]:
        path = self._path(adapter_id, "")
        if not path.parent.is_dir():
            return []
        stem = f"{path.name}@"
        names = (p.name for p in path.parent.iterdir()
                 if p.name.startswith(stem) and (modified_before is None or _mtime(p) < modified_before))
        base = adapter_id.rpartition("/")[0]
        return sorted(
            (f"{base}/" if base else "") + n[: -len(BLOB_SUFFIX)] for n in names if n.endswith(BLOB_SUFFIX)
        )

    def write_head(self, adapter_id: str, data: bytes, expect: str | None | object = ANY_HEAD) -> None:
        self._check_expected(adapter_id, expect)
        self._write(self._path(adapter_id, HEAD_SUFFIX), data)

    def read_head(self, adapter_id: str) -> bytes | None:
        try:
            return self._path(adapter_id, HEAD_SUFFIX).read_bytes()
        except FileNotFoundError:
            return None

    def read_head_tagged(self, adapter_id: str) -> tuple[bytes, str] | None:
        raw = self.read_head(adapter_id)
        return None if raw is None else (raw, _tag(raw))

    def delete_head(self, adapter_id: str, expect: str | None | object = ANY_HEAD) -> None:
        self._check_expected(adapter_id, expect)
        self._path(adapter_id, HEAD_SUFFIX).unlink(missing_ok=True)

    def create_marker(self, data: bytes) -> bytes:
        found = self.read_marker()
        if found is not None:
            return found
        self._write(self.root / MARKER_FILE, data)
        return data

    def read_marker(self) -> bytes | None:
        try:
            return (self.root / MARKER_FILE).read_bytes()
        except FileNotFoundError:
            return None

    def _check_expected(self, adapter_id: str, expect: str | None | object) -> None:
        """The condition of a head write. One process owns a local directory and holds the id's
        lock over read and write, so checking just before is enough here."""
        if expect is ANY_HEAD:
            return
        raw = self.read_head(adapter_id)
        if (None if raw is None else _tag(raw)) != expect:
            raise HeadChanged(adapter_id)

    def list_heads(self, prefix: str, start_after: str, limit: int) -> list[str]:
        ids = []
        for top in sorted(self.root.iterdir()):
            if top.name.startswith("."):
                continue
            candidates = [top] if top.is_file() else sorted(top.iterdir()) if top.is_dir() else []
            for path in candidates:
                if path.is_file() and path.name.endswith(HEAD_SUFFIX):
                    ids.append(path.relative_to(self.root).as_posix()[: -len(HEAD_SUFFIX)])
        picked = sorted(i for i in ids if i.startswith(prefix) and i > start_after)
        return picked[:limit]


def _tag(raw: bytes) -> str:
    return hashlib.sha256(raw).hexdigest()


def _mtime(path: Path) -> float:
    """Last write time (a file gone meanwhile counts as new: nothing to drop)."""
    try:
        return path.stat().st_mtime
    except FileNotFoundError:
        return float("inf")
