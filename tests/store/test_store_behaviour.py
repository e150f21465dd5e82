"""What a user of the store relies on, over every backend combination (local/in-memory,
S3/in-memory, S3/Redis), through the gRPC service and its client."""

from __future__ import annotations

import hashlib
import time
import threading

import pytest
from store_adapters import ADAPTERS, WEIGHTS, peft_files

from loraplex.adapter_store.call_deadline import CallDeadline
from loraplex.adapter_store.errors import AdapterNotFoundError, InvalidRequestError, UnavailableError
from loraplex.adapter_store.records import KIND_DELETE, KIND_PUT, KIND_RESYNC

pytestmark = pytest.mark.slow  # starts gRPC servers (and Redis / moto)


@pytest.mark.parametrize("name", sorted(ADAPTERS))
def test_round_trip_of_real_peft_adapters(env, adapters, name):
    rank, dtype, targets = ADAPTERS[name]
    files = adapters[name]  # as peft saved them, README.md included
    info = env.client.put("acme/" + name, files)
    assert info.rank == rank
    assert info.dtype == {"float32": "F32", "bfloat16": "BF16"}[dtype]
    assert list(info.target_modules) == [t for t in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                      "up_proj", "down_proj") if t in targets]
    assert info.sha256 == hashlib.sha256(files[WEIGHTS]).hexdigest()
    assert info.size_bytes == len(files[WEIGHTS])

    got = env.client.resolve("acme/" + name)
    assert dict(got.files) == peft_files(files)  # byte for byte; README.md is not kept
    assert got.info.version == info.version
    assert got.spec.rank == rank and got.spec.dtype == info.dtype
    assert env.client.get("acme/" + name) == got.info


def test_reupload_makes_a_new_version_and_drops_the_old_blob(env, adapters):
    first = env.client.put("acme/model", adapters["r4-fp32"])
    again = env.client.put("acme/model", adapters["r4-fp32"])
    assert again.version == first.version  # same bytes, same version
    second = env.client.put("acme/model", adapters["r16-bf16"])
    assert second.version != first.version
    record, files = env.client.fetch("acme/model")
    assert record.version == second.version
    assert files == peft_files(adapters["r16-bf16"])
    blobs = [k for k in env.stored_objects() if "model@" in k and not k.endswith("@head.json")]
    assert len(blobs) == 1 and second.version in blobs[0]


def test_list_pages_by_tenant_and_prefix(env, adapters):
    ids = ["acme/a1", "acme/a2", "acme/b1", "acme/b2", "acme/b3", "beta/a1", "solo"]
    for i, adapter_id in enumerate(ids):
        env.client.put(adapter_id, adapters[sorted(ADAPTERS)[i % len(ADAPTERS)]])
    assert [i.adapter_id for i in env.client.list()] == sorted(ids)

    pages, token = [], ""
    while True:
        page, token = env.client.list_page(tenant="acme", page_size=2, page_token=token)
        pages.append([r.adapter_id for r in page])
        if not token:
            break
    assert pages == [["acme/a1", "acme/a2"], ["acme/b1", "acme/b2"], ["acme/b3"]]
    assert [r.adapter_id for r in env.client.iter_records(tenant="acme", prefix="b")] == ["acme/b1", "acme/b2",
                                                                                           "acme/b3"]
    assert [r.adapter_id for r in env.client.iter_records(prefix="s")] == ["solo"]
    assert list(env.client.iter_records(tenant="nobody")) == []
    for bad in ("!!!", "YWNtZS9hMg", "YWNtZS9hMg==x", "Li4vZXRj"):  # junk, unpadded, trailing junk, '../etc'
        with pytest.raises(InvalidRequestError, match="not a token this store issued"):
            env.client.list_page(page_token=bad)


def test_delete_removes_the_name_and_every_version(env, adapters):
    env.client.put("acme/gone", adapters["r4-fp32"])
    env.client.put("acme/gone", adapters["r32-bf16"])
    env.client.put("acme/kept", adapters["r4-fp32"])
    env.client.delete("acme/gone")
    for call in (env.client.resolve, env.client.get, env.client.delete):
        with pytest.raises(AdapterNotFoundError):
            call("acme/gone")
    assert [i.adapter_id for i in env.client.list()] == ["acme/kept"]
    assert not [k for k in env.stored_objects() if "gone" in k]
    assert not [k for k in env.redis_keys() if "gone" in k]
    assert env.client.resolve("acme/kept").files[WEIGHTS] == adapters["r4-fp32"][WEIGHTS]


def test_unknown_adapter_is_not_found(env):
    with pytest.raises(AdapterNotFoundError, match="acme/missing"):
        env.client.resolve("acme/missing")
    with pytest.raises(AdapterNotFoundError):
        env.client.get("acme/missing")


def test_a_restarted_store_finds_what_was_stored(env, make_env, adapters):
    info = env.client.put("acme/durable", adapters["r64-fp32"])
    env.close()
    again = make_env(env.kind, redis_proc=env.redis, moto_proc=env.moto, **_same_place(env.settings))
    assert again.client.get("acme/durable").version == info.version
    assert again.client.resolve("acme/durable").files == peft_files(adapters["r64-fp32"])
    assert [i.adapter_id for i in again.client.list()] == ["acme/durable"]


def _same_place(settings):
    return dict(local_dir=settings.local_dir, s3=settings.s3, redis=settings.redis)


def test_watch_sees_puts_and_deletes(env, adapters):
    watch = env.client.watch(tenant="acme")
    events, got = [], threading.Event()

    def follow():
        for ev in watch:
            events.append(ev)
            if ev.kind == KIND_DELETE:
                got.set()

    thread = threading.Thread(target=follow, daemon=True)
    thread.start()
    _wait_for(lambda: events and events[0].kind == KIND_RESYNC)
    v1 = env.client.put("acme/w", adapters["r4-fp32"]).version
    env.client.put("other/w", adapters["r4-fp32"])  # filtered out
    v2 = env.client.put("acme/w", adapters["r16-bf16"]).version
    env.client.delete("acme/w")
    assert got.wait(10)
    watch.cancel()
    thread.join(5)
    changes = [(e.kind, e.adapter_id, e.version) for e in events if e.kind != KIND_RESYNC]
    assert changes == [(KIND_PUT, "acme/w", v1), (KIND_PUT, "acme/w", v2), (KIND_DELETE, "acme/w", v2)]


def test_redis_hit_serves_without_touching_the_blob_store(make_env, shared_redis, shared_moto, adapters, monkeypatch):
    import loraplex.adapter_store.backends.redis_cache as redis_cache  # noqa: PLC0415

    monkeypatch.setattr(redis_cache, "RANGE_BYTES", 4096)  # the hit is read as many ranges at once
    env = make_env("s3-redis", redis_proc=shared_redis, moto_proc=shared_moto)
    env.client.put("acme/hot", adapters["r16-bf16"])
    env.client.resolve("acme/hot")
    metrics = env.store.metrics
    assert metrics.value("loraplex_store_reads_total", source="cache") == 1
    assert metrics.value("loraplex_store_reads_total", source="blobs") == 0
    assert any(k.startswith(f"{env.settings.redis.namespace}:blob:acme/hot@") for k in env.redis_keys())


def _wait_for(predicate, timeout: float = 10.0) -> None:
    import time  # noqa: PLC0415

    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.02)


def test_watcher_invalidates_held_copies_that_changed(env, adapters):
    from loraplex.adapter_store.watcher import StoreWatcher  # noqa: PLC0415

    v1 = env.client.put("acme/held", adapters["r4-fp32"]).version
    env.client.put("acme/other", adapters["r4-fp32"])
    held = {"acme/held": v1, "acme/other": "a-version-the-store-never-had"}
    dropped = []

    def invalidate(adapter_id):
        dropped.append(adapter_id)
        held.pop(adapter_id, None)

    watcher = StoreWatcher(env.client, lambda: dict(held), invalidate, retry_s=0.1).start()
    try:
        _wait_for(lambda: watcher.resyncs >= 1)
        assert dropped == ["acme/other"]  # the first resync re-checks every held copy
        env.client.put("acme/held", adapters["r4-fp32"])  # same bytes, same version: kept
        env.client.put("acme/unheld", adapters["r16-bf16"])
        v2 = env.client.put("acme/held", adapters["r16-bf16"]).version
        _wait_for(lambda: "acme/held" in dropped)
        held["acme/held"] = v2
        env.client.delete("acme/held")
        _wait_for(lambda: dropped.count("acme/held") == 2)
        assert dropped == ["acme/other", "acme/held", "acme/held"]
    finally:
        watcher.stop()


def test_client_reads_cached_blobs_straight_from_redis(make_env, shared_redis, shared_moto, adapters, monkeypatch):
    import loraplex.adapter_store.backends.redis_cache as redis_cache  # noqa: PLC0415
    from loraplex.adapter_store.backends.redis_cache import RedisBlobCache  # noqa: PLC0415
    from loraplex.adapter_store.backends.redis_conn import connect  # noqa: PLC0415
    from loraplex.adapter_store.client import StoreClient  # noqa: PLC0415

    monkeypatch.setattr(redis_cache, "RANGE_BYTES", 4096)  # ranged reads, the corrupt one included
    env = make_env("s3-redis", redis_proc=shared_redis, moto_proc=shared_moto)
    info = env.client.put("acme/direct", adapters["r16-bf16"])
    cache = RedisBlobCache(connect(env.settings.redis), env.settings.redis.namespace, 0)
    with StoreClient(env.server.target, cache=cache) as direct:
        assert direct.resolve("acme/direct").files == peft_files(adapters["r16-bf16"])
        assert env.store.metrics.value("loraplex_store_read_bytes_total") == 0  # the store sent no bytes
        key = f"acme/direct@{info.version}"
        blob = bytearray(cache.get(key))
        blob[100] ^= 0xFF
        env.store.cache.put(key, bytes(blob))
        assert direct.resolve("acme/direct").files == peft_files(adapters["r16-bf16"])  # via the store's Get
        assert env.store.metrics.value("loraplex_store_checksum_failures_total", where="cache") == 1
        assert direct.resolve("acme/direct").info.version == info.version  # the store refilled the cache
        with pytest.raises(AdapterNotFoundError):
            direct.resolve("acme/nothing")


def _follow(env):
    """(events, the watch): a thread collecting the store's change events for tenant acme."""
    watch = env.client.watch(tenant="acme")
    events: list = []
    threading.Thread(target=lambda: events.extend(watch), daemon=True).start()
    _wait_for(lambda: events and events[0].kind == KIND_RESYNC)
    return events, watch


def test_a_delete_cut_off_after_its_commit_is_finished_by_the_next_one(env, adapters):
    """A store killed between a delete's commit point (the head gone) and the rest: the index still
    names the adapter. Deleting it again finishes the job: the index entry and the blob go, and the
    change event goes out, so servers holding the old version drop it (it answers as the delete)."""
    info = env.client.put("acme/cut", adapters["r4-fp32"])
    events, watch = _follow(env)
    env.store.blobs.delete_head("acme/cut")  # the delete's commit point, and nothing after it
    env.client.delete("acme/cut")  # answers as the delete: no error
    _wait_for(lambda: any(e.kind == KIND_DELETE for e in events))
    watch.cancel()
    assert [(e.kind, e.adapter_id, e.version) for e in events if e.kind != KIND_RESYNC] == [
        (KIND_DELETE, "acme/cut", info.version)]
    for call in (env.client.get, env.client.resolve, env.client.delete):
        with pytest.raises(AdapterNotFoundError):
            call("acme/cut")
    assert env.client.list() == []
    assert not [k for k in env.stored_objects() if "cut" in k]


def test_a_delete_leaves_a_version_another_writer_just_wrote(env, adapters, monkeypatch):
    """A delete drops the deleted version and older leftovers of the id, never a blob written
    since (another writer's upload on its way to its head, when its lease ran out or no Redis
    holds one): that upload must not lose its bytes. Once old, a leftover goes with the next delete."""
    from loraplex.adapter_store import old_versions
    from loraplex.adapter_store.records import blob_key

    env.client.put("acme/race", adapters["r4-fp32"])
    fresh = blob_key("acme/race", "0123456789abcdef")
    env.store.blobs.write_blob(fresh, b"another writer's version")
    env.client.delete("acme/race")
    assert [k for k in env.stored_objects() if "race@" in k] and fresh in env.store.blobs.list_blobs("acme/race")
    env.client.put("acme/race", adapters["r16-bf16"])
    monkeypatch.setattr(old_versions, "ORPHAN_GRACE_S", -3600.0)  # as if an hour had gone by
    env.client.delete("acme/race")
    assert not [k for k in env.stored_objects() if "race" in k]


def test_the_index_is_reconciled_with_the_heads_whatever_it_says(env, adapters, monkeypatch):
    """A store killed between a head and its index write (here: the index write lost and the
    process's memory of it gone) leaves an index that names the old version and says nothing is
    wrong. At start and every reconcile interval the store rebuilds it from the heads, and tells
    watchers to re-check their copies."""
    from loraplex.adapter_store.errors import BackendUnavailable

    from loraplex.adapter_store.store import Store

    # the server's background upkeep (every 0.2 s) off: a tick between the lost write and the
    # process "forgetting" it below rebuilt the index first, so the stale read saw no stale index
    monkeypatch.setattr(env.store, "maintain", lambda: None)
    v1 = env.client.put("acme/stale", adapters["r4-fp32"]).version
    real_put = env.store.index.put

    def lost(record):
        raise BackendUnavailable("index", "killed before the write")

    monkeypatch.setattr(env.store.index, "put", lost)
    v2 = env.client.put("acme/stale", adapters["r16-bf16"]).version
    monkeypatch.setattr(env.store.index, "put", real_put)
    env.store.keeper._dirty.clear()  # a restarted process does not know the write was lost
    assert env.client.get("acme/stale").version == v1  # the index, trusted: stale
    events, watch = _follow(env)
    env.store.keeper._reconciled_at = time.time() - env.settings.reconcile_interval_s - 1  # the interval is up
    Store.maintain(env.store)
    assert env.client.get("acme/stale").version == v2
    assert env.client.resolve("acme/stale").files == peft_files(adapters["r16-bf16"])
    _wait_for(lambda: len([e for e in events if e.kind == KIND_RESYNC]) >= 2)  # the first comes with the watch
    watch.cancel()


def test_an_upload_that_waits_out_its_deadline_for_the_writer_counts_as_unavailable(env, adapters):
    """The store's upload outcomes add up: a put refused because another writer held the id past
    its caller's deadline is an "unavailable" one, as a put refused for a blob store that is down."""
    files = peft_files(adapters["r4-fp32"])
    with env.store._writers.hold("acme/busy", 5.0):  # another upload of the id, in this process
        with pytest.raises(UnavailableError, match="being written by another upload"):
            env.store.put("acme/busy", files, deadline=CallDeadline(1.5))
    assert env.store.metrics.value("loraplex_store_uploads_total", outcome="unavailable") == 1
    env.store.put("acme/busy", files)
    assert env.store.metrics.value("loraplex_store_uploads_total", outcome="stored") == 1
    assert env.store.metrics.value("loraplex_store_uploads_total", outcome="unavailable") == 1
