"""An upload's files, declared up front and filled by chunks: the one assembler both upload
streams use, and its relay (``Relay``: the same checks, the bytes passed on instead of kept). The inference server's UploadAdapter sends chunks that name their file; the store's
Put sends the files back to back in declared order. Either way the declaration bounds what is
taken (a chunk past a file's declared size is refused as it arrives), memory grows only as bytes
arrive, and ``finish`` checks every size and declared sha256 and hashes each file once.

Failures are facts (``AssemblyError``: what, which file, how many bytes); each edge words them in
its own API's fields and messages (inference_server/server/upload.py, adapter_store/upload.py).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum


@dataclass(frozen=True, slots=True)
class DeclaredFile:
    name: str
    size: int
    sha256: str = ""  # lowercase hex; "" = the sender declared none


class Fault(Enum):
    UNDECLARED = "undeclared"  # a chunk names a file the metadata did not declare
    OVERLONG = "overlong"  # more bytes than declared (for a file, or for the whole stream)
    TRUNCATED = "truncated"  # a file ended short of its declared size
    DIGEST = "digest"  # a file's bytes do not hash to its declared sha256


class AssemblyError(Exception):
    def __init__(self, fault: Fault, name: str | None, got: int = 0, declared: int = 0) -> None:
        super().__init__(f"{fault.value}: {name!r} ({got} of {declared} bytes)")
        self.fault, self.name, self.got, self.declared = fault, name, got, declared


class Assembly:
    """The declared files, filled by ``add``; ``finish`` hands them over, checked."""

    def __init__(self, declared: Sequence[DeclaredFile]) -> None:
        self.declared = tuple(declared)
        self._data = {f.name: bytearray() for f in self.declared}
        self._cursor = 0  # back-to-back streams: the declared file now filling
        self.received = 0

    @property
    def total(self) -> int:
        return sum(f.size for f in self.declared)

    @property
    def complete(self) -> bool:
        return all(len(self._data[f.name]) == f.size for f in self.declared)

    def add(self, data: bytes, name: str | None = None) -> None:
        """Take ``data`` for file ``name``, or (None) for the files in declared order, back to back."""
        if name is None:
            self._add_in_order(memoryview(data))
        else:
            self._add_to(name, data)

    def _add_to(self, name: str, data: bytes) -> None:
        entry = self._data.get(name)
        if entry is None:
            raise AssemblyError(Fault.UNDECLARED, name)
        size = self._size(name)
        if len(entry) + len(data) > size:
            raise AssemblyError(Fault.OVERLONG, name, len(entry) + len(data), size)
        entry += data
        self.received += len(data)

    def _add_in_order(self, data: memoryview) -> None:
        if self.received + len(data) > self.total:
            raise AssemblyError(Fault.OVERLONG, None, self.received + len(data), self.total)
        while len(data):
            file = self.declared[self._cursor]
            entry = self._data[file.name]
            take = min(file.size - len(entry), len(data))
            entry += data[:take]
            data = data[take:]
            self.received += take
            if len(entry) == file.size:
                self._cursor += 1

    def _size(self, name: str) -> int:
        return next(f.size for f in self.declared if f.name == name)

    def finish(self) -> tuple[dict[str, bytes], dict[str, str]]:
        """(files, their sha256 hex): every declared byte arrived and every declared digest holds.
        The buffers are released as each file is copied out (an 80 MB upload: hash off the loop)."""
        files: dict[str, bytes] = {}
        digests: dict[str, str] = {}
        for f in self.declared:
            entry = self._data[f.name]
            if len(entry) != f.size:
                raise AssemblyError(Fault.TRUNCATED, f.name, len(entry), f.size)
            data = bytes(entry)
            entry.clear()
            digest = hashlib.sha256(data).hexdigest()
            if f.sha256 and digest != f.sha256:
                raise AssemblyError(Fault.DIGEST, f.name, len(data), f.size)
            files[f.name], digests[f.name] = data, digest
        return files, digests


class Relay:
    """The declared files passed on, back to back in declared order, as chunks that name their
    file arrive (in any order): ``add`` returns what can go on now. A file's bytes wait here only
    while an earlier file is incomplete, so a sender that keeps declared order holds nothing here.
    The same faults as Assembly: UNDECLARED and OVERLONG as a chunk arrives, TRUNCATED and DIGEST
    from ``finish`` (each file hashed once, as it passes)."""

    def __init__(self, declared: Sequence[DeclaredFile]) -> None:
        self.declared = tuple(declared)
        self._sizes = {f.name: f.size for f in self.declared}
        self._got = dict.fromkeys(self._sizes, 0)
        self._waiting: dict[str, list[bytes]] = {f.name: [] for f in self.declared}
        self._hashes = {f.name: hashlib.sha256() for f in self.declared}
        self._cursor = 0  # the declared file now passing
        self.received = 0

    @property
    def total(self) -> int:
        return sum(self._sizes.values())

    @property
    def complete(self) -> bool:
        return self._got == self._sizes

    def add(self, data: bytes, name: str) -> list[bytes]:
        """Take ``data`` for file ``name``; the bytes that can now be passed on, in order."""
        size = self._sizes.get(name)
        if size is None:
            raise AssemblyError(Fault.UNDECLARED, name)
        if self._got[name] + len(data) > size:
            raise AssemblyError(Fault.OVERLONG, name, self._got[name] + len(data), size)
        self._got[name] += len(data)
        self.received += len(data)
        self._hashes[name].update(data)
        self._waiting[name].append(data)
        return self._ready()

    def _ready(self) -> list[bytes]:
        out: list[bytes] = []
        while self._cursor < len(self.declared):
            file = self.declared[self._cursor]
            out += self._waiting[file.name]
            self._waiting[file.name] = []
            if self._got[file.name] < file.size:
                break
            self._cursor += 1
        return [piece for piece in out if piece]

    def finish(self) -> dict[str, str]:
        """The files' sha256 hex, once every declared byte passed and every declared digest holds."""
        digests: dict[str, str] = {}
        for f in self.declared:
            if self._got[f.name] != f.size:
                raise AssemblyError(Fault.TRUNCATED, f.name, self._got[f.name], f.size)
            digests[f.name] = self._hashes[f.name].hexdigest()
            if f.sha256 and digests[f.name] != f.sha256:
                raise AssemblyError(Fault.DIGEST, f.name, f.size, f.size)
        return digests
