"""The pieces a write checks before its commit, on their own: per-id locks, the caller's
deadline, and the local backend's conditional head write."""

from __future__ import annotations

import threading

import pytest

from loraplex.adapter_store.backends.local_blobs import LocalBlobBackend
from loraplex.adapter_store.call_deadline import COMMIT_MARGIN_S, DEFAULT_WAIT_S, CallDeadline
from loraplex.adapter_store.errors import HeadChanged, UnavailableError
from loraplex.adapter_store.id_locks import IdLocks


def test_one_id_excludes_itself_and_no_other():
    locks = IdLocks()
    with locks.hold("acme/a", 1.0) as held:
        assert held
        with locks.hold("acme/b", 0.0) as other:
            assert other  # unrelated ids never wait on each other
        got = []

        def wait() -> None:
            with locks.hold("acme/a", 0.05) as second:
                got.append(second)

        t = threading.Thread(target=wait)
        t.start()
        t.join(5)
        assert got == [False]  # the same id waits, and gives up when told
    assert len(locks) == 0  # nothing kept once nobody holds or waits


def test_deadline_budget_and_commit_check():
    now = [100.0]
    deadline = CallDeadline(10.0, clock=lambda: now[0])
    assert deadline.wait_budget() == pytest.approx(10.0 - COMMIT_MARGIN_S)
    deadline.check_commit("put")
    now[0] += 9.5
    with pytest.raises(UnavailableError, match="deadline leaves 0.5s"):
        deadline.check_commit("put")
    assert deadline.wait_budget() == 0.0
    assert CallDeadline().wait_budget() == DEFAULT_WAIT_S


def test_a_cancelled_caller_stops_the_commit():
    deadline = CallDeadline(60.0)
    deadline.cancel()
    with pytest.raises(UnavailableError, match="cancelled"):
        deadline.check_commit("put")


def test_local_head_write_is_conditional(tmp_path):
    blobs = LocalBlobBackend(tmp_path)
    blobs.write_head("acme/a", b"1", expect=None)
    with pytest.raises(HeadChanged):
        blobs.write_head("acme/a", b"2", expect=None)
    _, tag = blobs.read_head_tagged("acme/a")
    blobs.write_head("acme/a", b"2", expect=tag)
    with pytest.raises(HeadChanged):
        blobs.delete_head("acme/a", expect=tag)
    assert blobs.read_head("acme/a") == b"2"
