"""A read of the local adapter directory racing an upload or delete of the same id (a chaos run's
finding: a Generate for an adapter being deleted and re-uploaded failed with INTERNAL
(FileNotFoundError) or INVALID_ARGUMENT ('incomplete on disk')). The read sees the version the
link named when it looked, or NOT_FOUND; never an error of its own. Each race is replayed at the
exact point it hit, by running the other caller's call inside the file-system call it raced."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from loraplex.adapter_store.errors import AdapterNotFoundError
from loraplex.adapter_store.format.files import ADAPTER_FILES
from loraplex.inference_server.lora.local_directory import LocalAdapterDirectory
from server_helpers import FAKE_BASE, write_fake_adapter


def _files(folder: Path) -> dict[str, bytes]:
    return {name: (folder / name).read_bytes() for name in ADAPTER_FILES}


@pytest.fixture
def directory(tmp_path: Path) -> tuple[LocalAdapterDirectory, dict[str, bytes]]:
    files = _files(write_fake_adapter(tmp_path / "src", rank=4))
    return LocalAdapterDirectory(tmp_path / "adapters", FAKE_BASE, max_rank=64), files


@pytest.mark.parametrize("call", ["resolve", "get"])
def test_a_delete_between_lstat_and_readlink_is_not_found(directory, monkeypatch, call: str) -> None:
    """os.path.realpath saw the link (lstat), the delete removed it, its readlink raised
    FileNotFoundError: the server answered INTERNAL instead of NOT_FOUND."""
    source, files = directory
    source.put("x", files)
    readlink = os.readlink

    def delete_first(path, *args, **kwargs):
        if os.path.basename(path) == "x":
            monkeypatch.setattr(os, "readlink", readlink)
            source.delete("x")  # the other caller's delete lands here
        return readlink(path, *args, **kwargs)

    monkeypatch.setattr(os, "readlink", delete_first)
    with pytest.raises(AdapterNotFoundError):
        getattr(source, call)("x")


def test_a_read_of_a_deleted_id_is_not_found_whatever_an_upload_does_next(directory, monkeypatch) -> None:
    """The link was gone when the read resolved it (so it kept the unresolved path), its first file
    read failed, and an upload made the link again before the read judged the failure: the
    adapter was called 'incomplete on disk' (INVALID_ARGUMENT) though it was absent, then whole."""
    source, files = directory
    source.put("x", files)
    source.delete("x")
    read_bytes = Path.read_bytes

    def upload_after(self: Path) -> bytes:
        if self.parent.name == "x":
            monkeypatch.setattr(Path, "read_bytes", read_bytes)
            try:
                return read_bytes(self)
            finally:
                source.put("x", files)  # the other caller's upload lands here
        return read_bytes(self)

    monkeypatch.setattr(Path, "read_bytes", upload_after)
    with pytest.raises(AdapterNotFoundError):
        source.resolve("x")


def test_a_version_pinned_before_a_replace_is_read_whole(directory, monkeypatch) -> None:
    """An upload over the id between the read's resolution and its file reads: the read is the
    version it pinned (kept RETIRE_S), all its files from that one version."""
    source, files = directory
    first = source.put("x", files)
    other = _files(write_fake_adapter(Path(source.root).parent / "src2", rank=2))
    read_bytes = Path.read_bytes

    def replace_first(self: Path) -> bytes:
        if self.name == ADAPTER_FILES[0] and ".versions" in self.parts:
            monkeypatch.setattr(Path, "read_bytes", read_bytes)
            source.put("x", other)  # the other caller's upload lands here
        return read_bytes(self)

    monkeypatch.setattr(Path, "read_bytes", replace_first)
    read = source.resolve("x")
    assert read.info.version == first.version and read.files == files
    assert source.get("x").rank == 2
