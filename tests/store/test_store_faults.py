"""Faults with real services: Redis killed, S3 stopped, uploads cancelled, stored bytes flipped."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
from store_adapters import WEIGHTS, peft_files
from store_services import MotoProcess, RedisProcess

from loraplex.adapter_store.errors import AdapterCorruptError, UnavailableError
from loraplex.v1 import store_pb2 as pb, store_pb2_grpc

pytestmark = pytest.mark.slow


def _wait_for(predicate, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.05)


def test_redis_killed_mid_run_reads_fall_back_to_s3(make_env, redis_bin, shared_moto, adapters):
    redis = RedisProcess(redis_bin).start()
    try:
        env = make_env("s3-redis", redis_proc=redis, moto_proc=shared_moto)
        events = []
        env.store.subscribe(events.append)
        env.client.put("acme/a", adapters["r4-fp32"])
        env.client.put("acme/b", adapters["r16-bf16"])
        env.client.resolve("acme/a")

        redis.kill()
        assert env.client.resolve("acme/a").files == peft_files(adapters["r4-fp32"])
        assert env.client.resolve("acme/b").files == peft_files(adapters["r16-bf16"])
        assert env.client.get("acme/b").rank == 16
        assert [i.adapter_id for i in env.client.list()] == ["acme/a", "acme/b"]
        assert env.store.metrics.value("loraplex_store_degraded_total", dependency="index") > 0
        assert env.store.metrics.value("loraplex_store_reads_total", source="blobs") >= 2
        env.client.put("acme/c", adapters["r32-bf16"])  # S3 is the truth: uploads go on
        assert env.client.resolve("acme/c").info.rank == 32
        assert ("put", "acme/c") in [(e.kind, e.adapter_id) for e in events]  # local watchers still hear it
        resyncs = sum(e.kind == "resync" for e in events)

        redis.start()  # same port, empty, like a restarted Redis without persistence
        ns = env.settings.redis.namespace
        client = redis.client()
        _wait_for(lambda: client.exists(f"{ns}:complete") and client.exists(f"{ns}:rec:acme/c"))
        assert [i.adapter_id for i in env.client.list()] == ["acme/a", "acme/b", "acme/c"]
        _wait_for(lambda: sum(e.kind == "resync" for e in events) > resyncs)  # events may have been lost
        assert env.client.resolve("acme/c").files == peft_files(adapters["r32-bf16"])
        client.close()
    finally:
        redis.kill()


@pytest.mark.parametrize("kind", ["s3-memory", "s3-redis"])
def test_s3_stopped_cached_reads_serve_and_uploads_fail(make_env, request, adapters, kind):
    moto = MotoProcess().start()
    try:
        redis = request.getfixturevalue("shared_redis") if "redis" in kind else None
        env = make_env(kind, redis_proc=redis, moto_proc=moto)
        hot = env.client.put("acme/hot", adapters["r16-bf16"])  # an upload fills the cache
        cold = env.client.put("acme/cold", adapters["r4-fp32"])
        env.store.cache.discard(f"acme/cold@{cold.version}")

        moto.stop()
        got = env.client.resolve("acme/hot")
        assert got.info.version == hot.version and got.files == peft_files(adapters["r16-bf16"])
        assert [i.adapter_id for i in env.client.list()] == ["acme/cold", "acme/hot"]
        with pytest.raises(UnavailableError, match=r"cannot store 'acme/new'.*S3 bucket .* is unavailable"):
            env.client.put("acme/new", adapters["r32-bf16"])
        with pytest.raises(UnavailableError, match="not cached"):
            env.client.resolve("acme/cold")
        with pytest.raises(UnavailableError, match="cannot delete"):
            env.client.delete("acme/hot")
        assert env.store.metrics.value("loraplex_store_uploads_total", outcome="unavailable") == 1
    finally:
        moto.stop()


def test_s3_unavailable_is_the_grpc_status(make_env, adapters):
    moto = MotoProcess().start()
    try:
        env = make_env("s3-memory", moto_proc=moto)
        moto.stop()
        files = peft_files(adapters["r4-fp32"])
        stub = store_pb2_grpc.AdapterStoreStub(grpc.insecure_channel(env.server.target))
        with pytest.raises(grpc.RpcError) as err:
            stub.Put(iter(_put_messages("acme/x", files)), timeout=20)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "unavailable" in err.value.details()
    finally:
        moto.stop()


def _put_messages(adapter_id, files, chunk=4096):
    yield pb.StorePutRequest(metadata=pb.StorePutMetadata(
        adapter_id=adapter_id, files=[pb.StoredFile(name=n, size=len(d)) for n, d in files.items()]))
    for data in files.values():
        for i in range(0, len(data), chunk):
            yield pb.StorePutRequest(chunk=data[i : i + chunk])


def test_upload_cancelled_half_way_leaves_no_trace(env, adapters):
    files = peft_files(adapters["r16-bf16"])
    messages = list(_put_messages("acme/cancelled", files))
    half, release = len(messages) // 2, threading.Event()
    sent = threading.Event()

    def stream():
        yield from messages[:half]
        sent.set()
        release.wait(10)  # the client cancels while the server waits for the rest

    stub = store_pb2_grpc.AdapterStoreStub(grpc.insecure_channel(env.server.target))
    future = stub.Put.future(stream(), timeout=20)
    assert sent.wait(10)
    time.sleep(0.3)
    future.cancel()
    release.set()
    with pytest.raises(grpc.FutureCancelledError):
        future.result()
    time.sleep(0.3)
    assert env.client.list() == []
    assert env.stored_objects() == []
    assert env.redis_keys() == []
    assert env.client.put("acme/cancelled", files).rank == 16  # and the name is free to use


def _flip_stored_blob(env, key_part: str) -> None:
    [key] = [k for k in env.stored_objects() if key_part in k and "head" not in k]
    if env.settings.blob_backend == "s3":
        s3 = env.moto.s3()
        data = bytearray(s3.get_object(Bucket=env.settings.s3.bucket, Key=key)["Body"].read())
        data[len(data) // 2] ^= 0x40
        s3.put_object(Bucket=env.settings.s3.bucket, Key=key, Body=bytes(data))
    else:
        path = f"{env.settings.local_dir}/{key}"
        data = bytearray(open(path, "rb").read())
        data[len(data) // 2] ^= 0x40
        open(path, "wb").write(bytes(data))


def test_flipped_bytes_in_the_blob_store_are_caught_not_served(env, adapters):
    info = env.client.put("acme/flip", adapters["r64-fp32"])
    _flip_stored_blob(env, "acme/flip@")
    env.store.cache.discard(f"acme/flip@{info.version}")
    with pytest.raises(AdapterCorruptError, match="fails its sha256 check"):
        env.client.resolve("acme/flip")
    stub = store_pb2_grpc.AdapterStoreStub(grpc.insecure_channel(env.server.target))
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Get(pb.StoreGetRequest(adapter_id="acme/flip"), timeout=20))
    assert err.value.code() == grpc.StatusCode.DATA_LOSS
    assert env.store.metrics.value("loraplex_store_checksum_failures_total", where="blobs") == 2
    env.client.put("acme/flip", adapters["r16-bf16"])  # a re-upload repairs it
    assert env.client.resolve("acme/flip").files[WEIGHTS] == adapters["r16-bf16"][WEIGHTS]


def test_a_corrupt_cache_entry_is_dropped_and_read_from_the_blob_store(env, adapters):
    info = env.client.put("acme/cached", adapters["r32-bf16"])
    key = f"acme/cached@{info.version}"
    blob = bytearray(env.store.cache.get(key))
    blob[-5] ^= 0x01
    env.store.cache.put(key, bytes(blob))
    assert env.client.resolve("acme/cached").files == peft_files(adapters["r32-bf16"])
    assert env.store.metrics.value("loraplex_store_checksum_failures_total", where="cache") == 1
    assert env.store.metrics.value("loraplex_store_reads_total", source="blobs") == 1
    assert env.client.resolve("acme/cached").info.version == info.version
    assert env.store.metrics.value("loraplex_store_reads_total", source="cache") == 1  # refilled with good bytes


def test_an_unreadable_head_is_data_loss_until_a_reupload_replaces_it(env, adapters):
    env.client.put("acme/hd", adapters["r4-fp32"])
    [key] = [k for k in env.stored_objects() if k.endswith("@head.json") or "/heads/" in k]
    if env.settings.blob_backend == "s3":
        env.moto.s3().put_object(Bucket=env.settings.s3.bucket, Key=key, Body=b"{garbage")
    else:
        open(f"{env.settings.local_dir}/{key}", "wb").write(b"{garbage")
    env.store.keeper.index.remove("acme/hd")  # as after an index rebuild: the head is read again
    with pytest.raises(AdapterCorruptError, match="head record is unreadable"):
        env.client.resolve("acme/hd")
    env.client.put("acme/hd", adapters["r16-bf16"])
    assert env.client.resolve("acme/hd").files == peft_files(adapters["r16-bf16"])


def test_redis_out_of_memory_leaves_uploads_stored_and_reads_whole(make_env, redis_bin, shared_moto, adapters):
    """A Redis at maxmemory under noeviction (the chart's policy) refuses writes with OOM: the
    cache and index are optional, so an upload is still committed to S3 and answered OK (not
    INTERNAL after the commit, with its old blob orphaned and no change event), and reads go on."""
    redis = RedisProcess(redis_bin).start()
    try:
        env = make_env("s3-redis", redis_proc=redis, moto_proc=shared_moto)
        events = []
        env.store.subscribe(events.append)
        first = env.client.put("acme/a", adapters["r4-fp32"])
        admin = redis.client()
        admin.config_set("maxmemory-policy", "noeviction")
        admin.config_set("maxmemory", str(admin.info("memory")["used_memory"] + 20_000))
        second = env.client.put("acme/a", adapters["r16-bf16"])  # the cache write is refused
        assert second.version != first.version
        assert env.client.get("acme/a").version == second.version
        assert env.client.resolve("acme/a").files == peft_files(adapters["r16-bf16"])
        blobs = {k.rpartition("@")[2] for k in env.stored_objects() if "blobs/acme/a@" in k}
        # the current version is whole; the old one goes where the lease was taken (its write may fit
        # under maxmemory) and stays, for a later guarded write's sweep, where it was refused
        assert second.version in blobs and blobs <= {first.version, second.version}
        assert ("put", "acme/a") in [(e.kind, e.adapter_id) for e in events[-2:]]
        assert env.store.metrics.value("loraplex_store_degraded_total", dependency="cache") > 0
        admin.config_set("maxmemory", "0")
        admin.close()
    finally:
        redis.kill()


def test_a_put_without_redis_never_drops_the_version_another_writer_made_current_again(
        make_env, redis_bin, shared_moto, adapters, base_config, monkeypatch):
    """Redis (the writers' leases) down, two store processes over one bucket: this one replaces
    v1 by v2 while the other uploads v1's content again and commits it right after (its head
    write expects v2's). A version's blob key is its content's, so "the version v2 replaced" is
    the blob the head names now: it must stay (it was dropped, leaving the adapter unreadable
    until someone re-uploaded it). What unguarded puts leave goes with a later guarded write."""
    from loraplex.adapter_store import old_versions
    from loraplex.adapter_store.factory import build_store
    from loraplex.adapter_store.metrics import StoreMetrics

    redis = RedisProcess(redis_bin).start()
    try:
        env = make_env("s3-redis", redis_proc=redis, moto_proc=shared_moto)
        other = build_store(env.settings, base=base_config, metrics=StoreMetrics())  # the other process's
        v1 = env.client.put("acme/flip", adapters["r4-fp32"]).version
        redis.kill()
        raced = []
        write_head = env.store.blobs.write_head

        def then_the_other_writer(adapter_id, data, **kwargs):
            write_head(adapter_id, data, **kwargs)
            if not raced:
                raced.append(other.put("acme/flip", adapters["r4-fp32"]).version)

        monkeypatch.setattr(env.store.blobs, "write_head", then_the_other_writer)
        v2 = env.client.put("acme/flip", adapters["r16-bf16"]).version
        monkeypatch.undo()
        assert raced == [v1] != [v2]
        record, files = other.fetch("acme/flip")
        assert record.version == v1 and files == peft_files(adapters["r4-fp32"])
        assert env.client.resolve("acme/flip").files == peft_files(adapters["r4-fp32"])
        blobs = sorted(k.rpartition("@")[2] for k in env.stored_objects() if "blobs/acme/flip@" in k)
        assert blobs == sorted([v1, v2])  # v2 left behind: no writer could know it was safe to drop

        redis.start()  # back: once the store uses it again, writes hold leases and sweep what is old enough
        client = redis.client()
        _wait_for(lambda: client.exists(f"{env.settings.redis.namespace}:complete"))
        client.close()
        monkeypatch.setattr(old_versions, "ORPHAN_GRACE_S", -3600.0)  # as if an hour had gone by
        v3 = env.client.put("acme/flip", adapters["r32-bf16"]).version
        blobs = [k.rpartition("@")[2] for k in env.stored_objects() if "blobs/acme/flip@" in k]
        assert blobs == [v3]
        assert env.client.resolve("acme/flip").files == peft_files(adapters["r32-bf16"])
        other.close()
    finally:
        redis.kill()


def test_failed_uploads_free_their_bytes_without_the_cycle_collector(make_env, adapters):
    """A refused upload's bytes are freed when the call ends, not when Python's cycle collector
    happens to run (the abort used to chain the error, and so the frames holding the buffer, to
    an AbortError that gRPC keeps in a cycle: QA saw 1.4 GB held after 7 truncated uploads), and a
    declaration alone allocates nothing (a buffer of the declared size was made up front)."""
    import gc
    import tracemalloc

    env = make_env("local-memory")
    stub = store_pb2_grpc.AdapterStoreStub(grpc.insecure_channel(env.server.target))
    declared = 8 << 20

    def truncated(i):
        yield pb.StorePutRequest(metadata=pb.StorePutMetadata(
            adapter_id=f"acme/t{i}", files=[pb.StoredFile(name="adapter_config.json", size=2),
                                            pb.StoredFile(name="adapter_model.safetensors", size=declared)]))
        for _ in range(16):
            yield pb.StorePutRequest(chunk=b"\\0" * (256 << 10))  # 4 of the 8 declared MiB

    gc.collect()
    gc.disable()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(4):
            with pytest.raises(grpc.RpcError) as err:
                stub.Put(truncated(i), timeout=20)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "truncated" in err.value.details()
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
        gc.enable()
    assert held < 4 << 20, f"{held / 2**20:.1f} MiB still held after 4 refused uploads of 4 MiB each"
