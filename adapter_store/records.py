"""What the store keeps about one adapter version, and the change events it publishes.

A version's files are stored as one blob: the files' bytes back to back, in the order of
``StoredRecord.files``. The record (JSON) carries each file's size and sha256, so every
read can split the blob and check it before anything is served. It also carries the
adapter's ``public`` flag (docs/TENANTS.md): a visibility change is a new record, published
by the same head write as the bytes; records written before the flag existed read as private.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from loraplex.adapter_store.errors import AdapterCorruptError, AdapterValidationError
from loraplex.adapter_store.format.files import ADAPTER_FILES, AdapterInfo, make_info
from loraplex.adapter_store.format.pattern_decisions import PatternValue
from loraplex.adapter_store.format.peft_format import WEIGHTS_FILE, AdapterSpec

MAX_FILE_NAME_LEN = 255
KIND_PUT, KIND_DELETE, KIND_RESYNC = "put", "delete", "resync"


@dataclass(frozen=True, slots=True)
class FileEntry:
    name: str
    size: int
    sha256: str


@dataclass(frozen=True, slots=True)
class StoredRecord:
    """One immutable version of an adapter: its AdapterInfo and the manifest of its blob."""

    info: AdapterInfo
    files: tuple[FileEntry, ...]

    @property
    def adapter_id(self) -> str:
        return self.info.adapter_id

    @property
    def version(self) -> str:
        return self.info.version

    @property
    def public(self) -> bool:
        return self.info.public

    @property
    def blob_key(self) -> str:
        return blob_key(self.info.adapter_id, self.info.version)

    @property
    def blob_size(self) -> int:
        return sum(f.size for f in self.files)

    @classmethod
    def build(
        cls, adapter_id: str, files: Mapping[str, bytes], spec: AdapterSpec, created_at: float, public: bool = False,
        digests: Mapping[str, str] | None = None,
    ) -> "StoredRecord":
        """The record of a validated upload; only the PEFT files are kept, in a fixed order.
        ``digests``: sha256 hex of files already hashed from these bytes (the others are hashed here)."""
        digests = digests or {}
        shas = {name: digests.get(name) or hashlib.sha256(files[name]).hexdigest() for name in ADAPTER_FILES}
        entries = tuple(FileEntry(name, len(files[name]), shas[name]) for name in ADAPTER_FILES)
        return cls(make_info(adapter_id, files, spec, created_at, public, weights_sha256=shas[WEIGHTS_FILE]), entries)

    def pack(self, files: Mapping[str, bytes]) -> bytes:
        """The blob: the manifest's files back to back."""
        return b"".join(files[f.name] for f in self.files)

    def unpack(self, blob: bytes) -> dict[str, bytes]:
        """Split a blob into files, checking its size and every file's sha256."""
        return self.unpack_pieces([blob])

    def unpack_pieces(self, pieces: Iterable[bytes]) -> dict[str, bytes]:
        """``unpack`` of the blob given as consecutive pieces (e.g. ranges still being read):
        each piece is hashed as it comes, so checking overlaps the reads of later pieces; each
        file is joined once (no copy for a file that is one whole piece)."""
        entries = iter(self.files)
        f = next(entries, None)
        parts: list[memoryview] = []
        held, total = 0, 0
        digest = hashlib.sha256()
        out: dict[str, bytes] = {}
        for piece in pieces:
            view = memoryview(piece)
            total += len(view)
            while len(view) and f is not None:
                take = view[: f.size - held]
                view = view[len(take):]
                digest.update(take)
                parts.append(take)
                held += len(take)
                if held == f.size:
                    out[f.name] = self._checked_file(f, parts, digest, piece)
                    f, parts, held, digest = next(entries, None), [], 0, hashlib.sha256()
        while f is not None and f.size == 0 and held == 0:  # empty files after the last byte
            out[f.name] = self._checked_file(f, [], digest, b"")
            f, digest = next(entries, None), hashlib.sha256()
        if f is not None or total != self.blob_size:
            raise AdapterCorruptError(
                f"adapter {self.adapter_id!r} version {self.version}: stored blob has {total} bytes, "
                f"its record says {self.blob_size}"
            )
        return out

    def _checked_file(self, f: FileEntry, parts: list[memoryview], digest: "hashlib._Hash", piece: bytes) -> bytes:
        if digest.hexdigest() != f.sha256:
            raise AdapterCorruptError(
                f"adapter {self.adapter_id!r} version {self.version}: {f.name} fails its sha256 check "
                "(stored bytes are corrupt; not served)"
            )
        if len(parts) == 1 and len(parts[0]) == len(piece) and isinstance(piece, bytes):
            return piece  # the file is the whole piece: no copy
        return b"".join(parts)

    def to_json(self) -> bytes:
        body = asdict(self.info)
        body["target_modules"] = list(self.info.target_modules)
        body["files"] = [asdict(f) for f in self.files]
        return json.dumps(body, sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes | str) -> "StoredRecord":
        body: dict[str, Any] = json.loads(raw)
        files = tuple(FileEntry(**f) for f in body.pop("files"))
        body["target_modules"] = tuple(body["target_modules"])
        public = body.setdefault("public", False)  # written before the flag existed: private
        if not isinstance(public, bool):
            raise TypeError(f"'public' must be true or false, got {public!r}")
        values = body.get("pattern_values")  # None: written before they were kept
        body["pattern_values"] = None if values is None else tuple(PatternValue.from_dict(v) for v in values)
        return cls(AdapterInfo(**body), files)


@dataclass(frozen=True, slots=True)
class ChangeEvent:
    """A change to the store: ``put`` (the id now names ``version``), ``delete``, or ``resync``
    (events may have been missed: whoever holds copies should re-check them)."""

    kind: str
    adapter_id: str = ""
    version: str = ""
    sha256: str = ""
    time: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in (KIND_PUT, KIND_DELETE, KIND_RESYNC):
            raise ValueError(f"unknown change kind {self.kind!r}")

    def to_json(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def from_json(cls, raw: bytes | str) -> "ChangeEvent":
        return cls(**json.loads(raw))


def blob_key(adapter_id: str, version: str) -> str:
    """Blob name of one version. '@' never appears in adapter ids, so keys cannot collide."""
    return f"{adapter_id}@{version}"


def check_file_name(name: str) -> str:
    """A plain file name (no directories, no traversal, printable); raise AdapterValidationError."""
    if not name or len(name) > MAX_FILE_NAME_LEN:
        raise AdapterValidationError(f"file name must be 1-{MAX_FILE_NAME_LEN} characters, got {len(name)}")
    if name in (".", "..") or any(c in name for c in "/\\") or not name.isprintable():
        raise AdapterValidationError(f"file name {name!r} must be a plain file name (no directories or '..')")
    return name


def check_upload_files(files: Mapping[str, bytes], max_bytes: int) -> None:
    """Names and total size of an upload, before any parsing."""
    for name in files:
        check_file_name(name)
    total = sum(len(v) for v in files.values())
    if total > max_bytes:
        raise AdapterValidationError(f"adapter is {total} bytes, over the store's limit of {max_bytes} bytes")
