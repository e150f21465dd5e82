"""BlobMarker on the local backend and the memory index: a marker that vanishes or changes
under an index that remembers it is reported once, and the index follows the new one."""

from __future__ import annotations

from loraplex.adapter_store.backends.local_blobs import MARKER_FILE, LocalBlobBackend
from loraplex.adapter_store.backends.memory_index import MemoryIndex
from loraplex.adapter_store.blob_marker import BlobMarker


def _marker(tmp_path):  # noqa: ANN001, ANN202
    blobs, index, reports = LocalBlobBackend(tmp_path), MemoryIndex(), []
    return blobs, index, reports, BlobMarker(blobs, index, reports.append)


def test_first_check_creates_the_marker_and_reports_nothing(tmp_path):
    blobs, index, reports, marker = _marker(tmp_path)
    marker.check()
    marker.check()
    assert blobs.read_marker() is not None and index.marker() == blobs.read_marker()
    assert reports == [] and marker.lost is None


def test_a_vanished_marker_is_reported_once(tmp_path):
    blobs, index, reports, marker = _marker(tmp_path)
    marker.check()
    (tmp_path / MARKER_FILE).unlink()  # the directory was emptied behind the store's back
    marker.check()
    marker.check()
    assert len(reports) == 1 and "lost its objects" in reports[0] and marker.lost == reports[0]
    assert index.marker() == blobs.read_marker() is not None


def test_a_changed_marker_is_reported(tmp_path):
    blobs, index, reports, marker = _marker(tmp_path)
    marker.check()
    (tmp_path / MARKER_FILE).write_bytes(b"another store")
    marker.check()
    assert len(reports) == 1 and "another store's objects" in reports[0]
    assert index.marker() == b"another store"


def test_an_index_that_forgot_the_marker_adopts_it_without_a_report(tmp_path):
    blobs, index, reports, marker = _marker(tmp_path)
    marker.check()
    fresh = MemoryIndex()  # like a Redis restarted empty
    BlobMarker(blobs, fresh, reports.append).check()
    assert reports == [] and fresh.marker() == blobs.read_marker()
