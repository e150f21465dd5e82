"""Writer locks across sidecars: a sidecar killed mid-upload frees the id within seconds, a
waiter never outlives its caller's deadline nor commits after its caller was told it failed,
unrelated ids never wait on each other, and a writer whose lease was taken over never
overwrites the upload acknowledged meanwhile; an upload through the inference server is held to
its own client's deadline. Real redis-server, moto S3 and sidecar processes;
the relays hold transfers at a chosen byte so "mid-upload" is exact."""

from __future__ import annotations

import threading
import time
import zlib

import pytest
from server_helpers import FakeEngine, ServerThread
from store_adapters import peft_files

from loraplex.adapter_store.client import StoreClient
from loraplex.adapter_store.errors import UnavailableError
from loraplex.adapter_store.records import StoredRecord
from loraplex.clients import LoraplexClient
from loraplex.clients.errors import UnavailableError as ClientUnavailableError
from loraplex.inference_server.server.app import ServerOptions

BIG, SMALL = "r64-fp32", "r4-fp32"  # 237 KB and 9 KB of files
MID_BLOB = 50_000  # bytes into BIG's blob (on its way to S3, or into the Redis cache) where it is held
LEASE_S = 5.0  # RedisIndex's default lease


class Background:
    """A client call in a thread: ``result`` or ``error`` once ``done``."""

    def __init__(self, fn, *args, **kwargs) -> None:  # noqa: ANN001
        self.result = self.error = None
        self.done = threading.Event()
        self.elapsed = 0.0
        threading.Thread(target=self._run, args=(fn, args, kwargs), daemon=True).start()

    def _run(self, fn, args, kwargs) -> None:  # noqa: ANN001
        started = time.monotonic()
        try:
            self.result = fn(*args, **kwargs)
        except Exception as e:  # noqa: BLE001  (the test reads it)
            self.error = e
        self.elapsed = time.monotonic() - started
        self.done.set()


def _timed(fn, *args, **kwargs):  # noqa: ANN001, ANN202
    started = time.monotonic()
    out = fn(*args, **kwargs)
    return out, time.monotonic() - started


def _assert_whole(client, adapter_id: str, expected: dict[str, bytes], record: StoredRecord) -> None:  # noqa: ANN001
    """Listed, and its bytes read back equal to what was uploaded (checked against their sha256)."""
    assert adapter_id in [i.adapter_id for i in client.list()]
    got = client.resolve(adapter_id)
    assert got.info.version == record.version
    assert got.files == peft_files(expected)


def _hold_upload(rig, car, adapter_id: str, files, relay: str = "s3"):  # noqa: ANN001, ANN202
    """Start uploading ``files`` through ``car``; return (the upload, its trap) once the blob's
    transfer (to S3, or the cache write to Redis) is held ``MID_BLOB`` bytes into the blob."""
    if relay == "s3":
        trap = car.s3_relay.trap(f"/blobs/{adapter_id}".encode(), extra=MID_BLOB)
    else:
        trap = car.redis_relay.trap(f"{rig.namespace}:blob:{adapter_id}@".encode(), extra=MID_BLOB)
    upload = Background(car.client(timeout_s=60).put_record, adapter_id, files)
    trap.wait_hit(20)
    return upload, trap


def test_sidecar_killed_during_the_s3_write_frees_the_id_within_the_lease(rig, fault_adapters):
    a, b = rig.sidecar(), rig.sidecar()
    _hold_upload(rig, a, "acme/x", fault_adapters[BIG])
    assert 0 < rig.lease_ttl_ms("acme/x") <= LEASE_S * 1000  # a short lease, not a long lock
    a.sigkill()

    with b.client(timeout_s=20) as client:
        record, took = _timed(client.put_record, "acme/x", fault_adapters[SMALL])
        assert took < LEASE_S + 3, f"the next upload waited {took:.1f}s for a dead writer's lock"
        _assert_whole(client, "acme/x", fault_adapters[SMALL], record)
        _, took = _timed(client.delete, "acme/x")
        assert took < 3
        assert rig.head("acme/x") is None and rig.blob_keys() == []


def test_sidecar_killed_after_the_s3_commit_during_the_cache_write(rig, fault_adapters):
    a, b = rig.sidecar(), rig.sidecar()
    with b.client() as client:
        first = client.put_record("acme/y", fault_adapters[SMALL])
    _hold_upload(rig, a, "acme/y", fault_adapters[BIG], relay="redis")  # held in the cache SET
    committed = rig.head("acme/y")
    assert committed is not None and committed.version != first.version, "the head was not written first"
    a.sigkill()

    with b.client(timeout_s=20) as client:
        record, took = _timed(client.put_record, "acme/y", fault_adapters[SMALL])
        assert took < LEASE_S + 3, f"the next upload waited {took:.1f}s for a dead writer's lock"
        _assert_whole(client, "acme/y", fault_adapters[SMALL], record)


def test_a_waiter_gives_up_before_its_deadline_and_never_commits_later(rig, fault_adapters):
    a, b = rig.sidecar(), rig.sidecar()
    holder, trap = _hold_upload(rig, a, "acme/z", fault_adapters[BIG])  # a live writer holds the id

    with b.client(timeout_s=4) as client:
        started = time.monotonic()
        with pytest.raises(UnavailableError) as failed:
            client.put_record("acme/z", fault_adapters[SMALL])
        took = time.monotonic() - started
    assert "being written by another upload" in str(failed.value), str(failed.value)
    assert took < 4, f"the lock wait outlived the caller's 4s deadline ({took:.1f}s)"

    trap.release()
    assert holder.done.wait(30) and holder.error is None, holder.error
    acknowledged = holder.result
    time.sleep(2.0)  # long enough for a waiter that was not stopped to take the lock and commit
    head = rig.head("acme/z")
    assert head is not None and head.version == acknowledged.version, "a write whose caller failed committed later"
    with b.client() as client:
        _assert_whole(client, "acme/z", fault_adapters[BIG], acknowledged)


def test_an_upload_through_the_server_is_held_to_its_clients_deadline(rig, fault_adapters, tmp_path):
    """The inference server streams an upload into the store under its client's own deadline, not
    its store client's longer one: with the id held by a live writer, the store gives up its lock
    wait before that deadline, the client hears why (not a bare DEADLINE_EXCEEDED), and the write
    never lands later."""
    a, b = rig.sidecar(), rig.sidecar()
    holder, trap = _hold_upload(rig, a, "acme/v", fault_adapters[BIG])
    folder = tmp_path / "small"
    folder.mkdir()
    for name, data in fault_adapters[SMALL].items():
        (folder / name).write_bytes(data)
    engine = FakeEngine(tmp_path / "unused")
    engine.use_store(StoreClient(b.target, retries=0, timeout_s=60))
    srv = ServerThread(ServerOptions(port=0))
    srv.attach(engine)
    try:
        with LoraplexClient(srv.address) as client:
            started = time.monotonic()
            with pytest.raises(ClientUnavailableError) as failed:
                client.upload_adapter("acme/v", folder, timeout=4)
            took = time.monotonic() - started
    finally:
        srv.close()
    assert "being written by another upload" in str(failed.value), str(failed.value)
    assert took < 4, f"the lock wait outlived the client's 4s deadline ({took:.1f}s)"

    trap.release()
    assert holder.done.wait(30) and holder.error is None, holder.error
    time.sleep(2.0)  # long enough for a waiter that was not stopped to take the lock and commit
    head = rig.head("acme/v")
    assert head is not None and head.version == holder.result.version, "a write whose caller failed committed later"


def _same_slot_ids() -> tuple[str, str]:
    """Two ids the old striped lock (crc32 % 64) put in one slot."""
    first = "acme/slot-0"
    slot = zlib.crc32(first.encode()) % 64
    for n in range(1, 10_000):
        other = f"acme/slot-{n}"
        if zlib.crc32(other.encode()) % 64 == slot:
            return first, other
    raise AssertionError("no id shares the slot")


def test_unrelated_ids_never_wait_on_each_other(rig, fault_adapters):
    a = rig.sidecar()
    busy, other = _same_slot_ids()
    holder, trap = _hold_upload(rig, a, busy, fault_adapters[BIG])
    with a.client(timeout_s=10) as client:
        record, took = _timed(client.put_record, other, fault_adapters[SMALL])
        assert took < 3, f"{other!r} waited {took:.1f}s behind {busy!r}"
        trap.release()
        assert holder.done.wait(30) and holder.error is None, holder.error
        _assert_whole(client, other, fault_adapters[SMALL], record)
        _assert_whole(client, busy, fault_adapters[BIG], holder.result)


def test_a_writer_whose_lease_was_taken_over_does_not_overwrite_the_newer_upload(rig, fault_adapters):
    a, b = rig.sidecar(), rig.sidecar()
    stale, trap = _hold_upload(rig, a, "acme/w", fault_adapters[BIG])
    a.redis_relay.pause()  # a cannot renew: its lease runs out, b takes the id over

    with b.client(timeout_s=20) as client:
        acknowledged, took = _timed(client.put_record, "acme/w", fault_adapters[SMALL])
        assert took < LEASE_S + 3
    a.redis_relay.resume()
    trap.release()
    assert stale.done.wait(30)
    assert isinstance(stale.error, UnavailableError), f"the stale writer reported {stale.result or stale.error}"
    head = rig.head("acme/w")
    assert head is not None and head.version == acknowledged.version, "an older upload overwrote an acknowledged one"
    with b.client() as client:
        _assert_whole(client, "acme/w", fault_adapters[SMALL], acknowledged)


def test_a_head_write_is_conditional_on_the_head_it_read(rig):
    """The fencing under the lease: S3 refuses a head write (or delete) whose expected head is not
    the current one, so even a writer that passed its lease check late cannot overwrite."""
    from loraplex.adapter_store.backends.s3_blobs import S3BlobBackend  # noqa: PLC0415
    from loraplex.adapter_store.errors import HeadChanged  # noqa: PLC0415
    from loraplex.adapter_store.settings import S3Settings  # noqa: PLC0415

    blobs = S3BlobBackend(S3Settings(bucket=rig.bucket, endpoint_url=rig.moto.endpoint, region="us-east-1"))
    blobs.write_head("acme/h", b'{"v": 1}', expect=None)
    with pytest.raises(HeadChanged):
        blobs.write_head("acme/h", b'{"v": 2}', expect=None)  # "no head yet" no longer holds
    _, first = blobs.read_head_tagged("acme/h")
    blobs.write_head("acme/h", b'{"v": 2}', expect=first)
    with pytest.raises(HeadChanged):
        blobs.write_head("acme/h", b'{"v": 3}', expect=first)  # written by someone since
    with pytest.raises(HeadChanged):
        blobs.delete_head("acme/h", expect=first)
    assert blobs.read_head("acme/h") == b'{"v": 2}'
    blobs.delete_head("acme/h", expect=blobs.read_head_tagged("acme/h")[1])
    assert blobs.read_head("acme/h") is None
