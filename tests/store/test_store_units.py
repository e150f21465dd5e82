"""The store's parts on their own: LRU-by-size caches (memory and Redis), indexes, records,
settings and flags."""

from __future__ import annotations

import uuid

import pytest

from loraplex.adapter_store.backends.memory_cache import MemoryBlobCache
from loraplex.adapter_store.backends.memory_index import MemoryIndex
from loraplex.adapter_store.errors import AdapterCorruptError
from loraplex.adapter_store.format.files import AdapterInfo
from loraplex.adapter_store.main import parse_args
from loraplex.adapter_store.records import FileEntry, StoredRecord
from loraplex.adapter_store.settings import MIB, RedisSettings, S3Settings, StoreSettings


@pytest.fixture(params=["memory", pytest.param("redis", marks=pytest.mark.slow)])
def make_cache(request):
    if request.param == "memory":
        return MemoryBlobCache
    from loraplex.adapter_store.backends.redis_cache import RedisBlobCache  # noqa: PLC0415
    from loraplex.adapter_store.backends.redis_conn import connect  # noqa: PLC0415

    redis = request.getfixturevalue("shared_redis")
    client = connect(RedisSettings(url=redis.url))
    request.addfinalizer(client.close)
    return lambda capacity: RedisBlobCache(client, f"unit:{uuid.uuid4().hex[:8]}", capacity)


def test_cache_evicts_least_recently_used_by_size(make_cache):
    cache = make_cache(100)
    assert cache.put("a", b"a" * 40) and cache.put("b", b"b" * 40)
    assert cache.get("a") == b"a" * 40  # a is now the most recently used
    assert cache.put("c", b"c" * 40)  # 120 > 100: evicts b, the least recently used
    assert cache.get("b") is None
    assert cache.keys() == ["a", "c"]
    assert cache.total_bytes == 80
    assert cache.put("d", b"d" * 90)  # needs 90: evicts a and c
    assert cache.keys() == ["d"] and cache.total_bytes == 90


def test_cache_refuses_a_blob_larger_than_itself_and_replaces_in_place(make_cache):
    cache = make_cache(50)
    assert cache.put("x", b"x" * 30)
    assert not cache.put("big", b"b" * 51)
    assert cache.get("big") is None and cache.get("x") == b"x" * 30
    assert cache.put("x", b"y" * 10)
    assert cache.get("x") == b"y" * 10 and cache.total_bytes == 10
    cache.discard("x")
    cache.discard("never-there")
    assert cache.total_bytes == 0 and cache.keys() == []


def test_cache_pieces_are_the_blob_in_order_and_none_when_missing(make_cache, monkeypatch):
    """pieces() hands the blob over as consecutive pieces (several GETRANGEs in flight on
    Redis; ranges made small here so a small blob takes many), and marks it recently used."""
    import loraplex.adapter_store.backends.redis_cache as redis_cache  # noqa: PLC0415

    monkeypatch.setattr(redis_cache, "RANGE_BYTES", 7)
    cache = make_cache(1000)
    blob = bytes(range(256)) * 2 + b"tail"
    assert cache.put("a", blob) and cache.put("b", b"b" * 10)
    pieces = list(cache.pieces("a"))
    assert b"".join(pieces) == blob
    if isinstance(cache, MemoryBlobCache):
        assert pieces == [blob]
    else:
        assert len(pieces) == -(-len(blob) // 7)
    assert cache.keys() == ["b", "a"]  # a read by pieces is a use
    assert cache.pieces("never-there") is None


@pytest.mark.slow  # needs the shared redis-server
def test_redis_pieces_come_short_when_the_blob_goes_while_being_read(shared_redis, monkeypatch):
    """An eviction in the middle of a ranged read leaves the later pieces empty: the record's
    check then refuses the blob (the store reads it again from the blob store), never half a
    file. The reader threads are held until the blob is gone."""
    import hashlib  # noqa: PLC0415
    import threading  # noqa: PLC0415

    import redis  # noqa: PLC0415

    import loraplex.adapter_store.backends.redis_cache as redis_cache  # noqa: PLC0415
    from loraplex.adapter_store.backends.redis_conn import connect  # noqa: PLC0415

    monkeypatch.setattr(redis_cache, "RANGE_BYTES", 16)
    gate, getrange = threading.Event(), redis.Redis.getrange

    def held(self, *args, **kwargs):  # only the read-ahead threads wait; the first range does not
        if threading.current_thread().name.startswith("redis-blob-read"):
            assert gate.wait(10)
        return getrange(self, *args, **kwargs)

    monkeypatch.setattr(redis.Redis, "getrange", held)
    client = connect(RedisSettings(url=shared_redis.url))
    cache = redis_cache.RedisBlobCache(client, f"unit:{uuid.uuid4().hex[:8]}", 10_000)
    data = bytes(range(200)) * 5
    entry = FileEntry("adapter_model.safetensors", len(data), hashlib.sha256(data).hexdigest())
    record = StoredRecord(_record("t/a").info, (entry,))
    assert cache.put("k", data)
    gate.set()
    assert record.unpack_pieces(cache.pieces("k")) == {"adapter_model.safetensors": data}
    gate.clear()
    pieces = cache.pieces("k")
    first = next(pieces)
    cache.discard("k")
    gate.set()
    with pytest.raises(AdapterCorruptError, match="stored blob has 16 bytes"):
        record.unpack_pieces(iter([first, *pieces]))
    client.close()


def _record(adapter_id: str, created_at: float = 1.0, version: str = "v") -> StoredRecord:
    info = AdapterInfo(adapter_id, version, "0" * 64, 4, 8.0, ("q_proj",), "F32", 3, created_at)
    return StoredRecord(info, (FileEntry("adapter_config.json", 2, "a" * 64),))


@pytest.fixture(params=["memory", pytest.param("redis", marks=pytest.mark.slow)])
def index(request):
    if request.param == "memory":
        return MemoryIndex()
    from loraplex.adapter_store.backends.redis_conn import connect  # noqa: PLC0415
    from loraplex.adapter_store.backends.redis_index import RedisIndex  # noqa: PLC0415

    client = connect(RedisSettings(url=request.getfixturevalue("shared_redis").url))
    request.addfinalizer(client.close)
    return RedisIndex(client, f"unit:{uuid.uuid4().hex[:8]}")


def test_index_pages_in_byte_order_with_prefix_and_start_after(index):
    ids = ["b", "b-c", "b/x", "b/y", "ba", "a/z"]
    for i in ids:
        index.put(_record(i))
    assert [r.adapter_id for r in index.list("", "", 100)] == sorted(ids)
    assert [r.adapter_id for r in index.list("b/", "", 100)] == ["b/x", "b/y"]
    assert [r.adapter_id for r in index.list("b", "b-c", 2)] == ["b/x", "b/y"]
    assert [r.adapter_id for r in index.list("b/", "a", 100)] == ["b/x", "b/y"]
    index.remove("b/x")
    assert index.get("b/x") is None and [r.adapter_id for r in index.list("b/", "", 10)] == ["b/y"]


def test_index_rebuild_keeps_writes_newer_than_the_scan(index):
    index.put(_record("old", created_at=1.0))
    index.put(_record("fresh", created_at=10.0, version="new"))  # written while the scan ran
    assert not index.is_complete()
    index.rebuild([_record("scanned", 2.0), _record("fresh", 3.0, version="stale")], started_at=5.0)
    assert index.is_complete()
    assert index.get("old") is None  # gone from the heads before the scan
    assert index.get("fresh").version == "new"
    assert index.get("scanned") is not None
    index.fill(_record("fresh", 4.0, version="older"))
    assert index.get("fresh").version == "new"
    index.mark_incomplete()
    assert not index.is_complete()


def test_record_round_trips_and_checks_its_files():
    files = {"adapter_config.json": b"{}", "adapter_model.safetensors": b"weights"}
    import hashlib  # noqa: PLC0415

    entries = tuple(FileEntry(n, len(d), hashlib.sha256(d).hexdigest()) for n, d in files.items())
    record = StoredRecord(_record("t/a").info, entries)
    assert StoredRecord.from_json(record.to_json()) == record
    blob = record.pack(files)
    assert record.unpack(blob) == files
    with pytest.raises(AdapterCorruptError, match="adapter_model.safetensors fails its sha256"):
        record.unpack(blob[:-1] + b"X")
    with pytest.raises(AdapterCorruptError, match="stored blob has 8 bytes"):
        record.unpack(blob[:8])


def test_record_built_from_an_uploads_digests_is_the_record_hashed_here(adapters, base_config):
    """An upload hashes each file once to check it; the record reuses those digests (the store
    does not hash 80 MB twice more) and must come out exactly as if it had hashed them itself."""
    import hashlib  # noqa: PLC0415

    from loraplex.adapter_store.format.peft_format import parse_adapter_files  # noqa: PLC0415
    from store_adapters import peft_files  # noqa: PLC0415

    files = peft_files(adapters["r16-bf16"])
    spec = parse_adapter_files(files, base_config)
    digests = {name: hashlib.sha256(data).hexdigest() for name, data in files.items()}
    hashed_here = StoredRecord.build("t/a", files, spec, 5.0)
    assert StoredRecord.build("t/a", files, spec, 5.0, digests=digests) == hashed_here
    assert hashed_here.unpack(hashed_here.pack(files)) == {f.name: files[f.name] for f in hashed_here.files}


@pytest.mark.parametrize("seed", range(20))
def test_record_unpacks_any_split_of_its_blob_into_pieces(seed):
    """unpack_pieces (hashing each piece as it comes) equals unpack for every way the blob is
    cut, empty files and empty pieces included; a flipped byte or a short or long blob is
    refused whichever piece it falls in."""
    import hashlib  # noqa: PLC0415
    import random  # noqa: PLC0415

    rng = random.Random(seed)
    files = {f"f{i}": rng.randbytes(rng.choice([0, 1, 5, 40])) for i in range(rng.randint(1, 4))}
    entries = tuple(FileEntry(n, len(d), hashlib.sha256(d).hexdigest()) for n, d in files.items())
    record = StoredRecord(_record("t/a").info, entries)
    blob = record.pack(files)
    cuts = sorted(rng.randint(0, len(blob)) for _ in range(rng.randint(0, 6)))
    pieces = [blob[a:b] for a, b in zip([0, *cuts], [*cuts, len(blob)])]
    assert record.unpack_pieces(pieces) == files
    if blob:
        i = rng.randrange(len(blob))
        bad = blob[:i] + bytes([blob[i] ^ 1]) + blob[i + 1:]
        with pytest.raises(AdapterCorruptError):
            record.unpack_pieces([bad[a:b] for a, b in zip([0, *cuts], [*cuts, len(bad)])])
        with pytest.raises(AdapterCorruptError, match="stored blob has"):
            record.unpack_pieces(pieces[:-1] + [pieces[-1][:-1]] if pieces[-1] else [blob[:-1]])
    with pytest.raises(AdapterCorruptError, match="stored blob has"):
        record.unpack_pieces([*pieces, b"x"])


@pytest.mark.parametrize("kwargs, message", [
    (dict(blob_backend="ftp"), "blob backend must be one of"),
    (dict(blob_backend="s3"), "needs S3 settings"),
    (dict(index_backend="redis"), "needs Redis settings"),
    (dict(cache_max_bytes=-1), "cache_max_bytes must be >= 0"),
    (dict(max_rank=0), "max_rank must be in"),
    (dict(listen="50061"), "listen must be host:port"),
])
def test_store_settings_name_the_problem(kwargs, message):
    with pytest.raises(ValueError, match=message):
        StoreSettings(**kwargs)


def test_s3_and_redis_settings_name_the_problem():
    with pytest.raises(ValueError, match="bucket name is required"):
        S3Settings(bucket="")
    with pytest.raises(ValueError, match=">= 5 MiB"):
        S3Settings(bucket="b", multipart_chunksize=MIB)
    with pytest.raises(ValueError, match="redis: url must start with"):
        RedisSettings(url="http://x")


def test_flags_and_environment_pick_the_backends():
    settings, level = parse_args([], env={})
    assert (settings.blob_backend, settings.index_backend, level) == ("local", "memory", "INFO")
    env = {"LORAPLEX_STORE_S3_BUCKET": "models", "LORAPLEX_STORE_REDIS_URL": "redis://r:6379/1",
           "LORAPLEX_STORE_CACHE_MIB": "64"}
    settings, _ = parse_args(["--s3-prefix", "lp/", "--s3-endpoint-url", "http://s3:9000"], env=env)
    assert settings.blob_backend == "s3" and settings.s3.bucket == "models" and settings.s3.prefix == "lp/"
    assert settings.s3.endpoint_url == "http://s3:9000"
    assert settings.index_backend == "redis" and settings.redis.url == "redis://r:6379/1"
    assert settings.cache_max_bytes == 64 * MIB
    settings, _ = parse_args(["--blob-backend", "local", "--index-backend", "memory"], env=env)
    assert (settings.blob_backend, settings.index_backend) == ("local", "memory")


def test_in_process_source_is_an_adapter_source(tmp_path, adapters, base_config):
    from store_adapters import peft_files  # noqa: PLC0415

    from loraplex.adapter_store.embedded import InProcessStoreSource  # noqa: PLC0415
    from loraplex.adapter_store.factory import build_store  # noqa: PLC0415
    from loraplex.adapter_store.errors import AdapterNotFoundError, AdapterValidationError  # noqa: PLC0415

    source = InProcessStoreSource(build_store(StoreSettings(local_dir=str(tmp_path)), base=base_config))
    info = source.put("t/a", adapters["r16-bf16"])
    got = source.resolve("t/a")
    assert got.info == info and got.files == peft_files(adapters["r16-bf16"]) and got.spec.rank == 16
    assert source.get("t/a") == info and source.list() == [info]
    with pytest.raises(AdapterValidationError, match="missing adapter_config.json"):
        source.put("t/b", {"adapter_model.safetensors": b"x"})
    source.delete("t/a")
    with pytest.raises(AdapterNotFoundError):
        source.resolve("t/a")
    assert source.list() == []


def test_watcher_over_an_in_process_store(tmp_path, adapters):
    from loraplex.adapter_store.factory import build_store  # noqa: PLC0415
    from loraplex.adapter_store.watcher import StoreWatcher  # noqa: PLC0415

    store = build_store(StoreSettings(local_dir=str(tmp_path)))
    v1 = store.put("t/a", adapters["r4-fp32"]).version
    held, dropped = {"t/a": v1, "t/gone": "x"}, []
    watcher = StoreWatcher(store, lambda: dict(held), dropped.append).start()
    assert dropped == ["t/gone"] and watcher.resyncs == 1
    store.put("t/a", adapters["r16-bf16"])
    assert dropped == ["t/gone", "t/a"]
    watcher.stop()
    store.delete("t/a")
    assert dropped == ["t/gone", "t/a"]  # stopped: no more calls


@pytest.mark.slow  # starts a gRPC server
def test_a_watch_outage_is_logged_once_and_its_end_once(tmp_path, caplog):
    """The server's watcher used to log a warning every second while the store refused or did not
    answer it; now once when the outage starts and once when the feed is back."""
    import logging  # noqa: PLC0415
    import time  # noqa: PLC0415

    from store_services import ServerThread, free_port  # noqa: PLC0415

    from loraplex.adapter_store.client import StoreClient  # noqa: PLC0415
    from loraplex.adapter_store.factory import build_store  # noqa: PLC0415
    from loraplex.adapter_store.watcher import StoreWatcher  # noqa: PLC0415

    caplog.set_level(logging.INFO, logger="loraplex.adapter_store.watcher")
    port = free_port()
    client = StoreClient(f"127.0.0.1:{port}", retries=0)
    watcher = StoreWatcher(client, dict, lambda adapter_id: None, retry_s=0.05).start()
    server = None
    try:
        time.sleep(1.0)  # ~20 failed reconnects: nobody listens on the port yet
        warnings = [r for r in caplog.records if "store watch interrupted" in r.getMessage()]
        assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING, [r.getMessage() for r in warnings]
        server = ServerThread(build_store(StoreSettings(local_dir=str(tmp_path))), listen=f"127.0.0.1:{port}")
        deadline = time.monotonic() + 15
        while watcher.resyncs == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert watcher.resyncs >= 1
        assert sum("store watch resumed" in r.getMessage() for r in caplog.records) == 1
    finally:
        watcher.stop()
        client.close()
        if server is not None:
            server.stop()


@pytest.mark.slow  # starts a gRPC server
def test_client_with_a_base_checks_uploads_before_sending(tmp_path, foreign_adapters, base_config):
    from store_services import ServerThread  # noqa: PLC0415

    from loraplex.adapter_store.client import StoreClient  # noqa: PLC0415
    from loraplex.adapter_store.factory import build_store  # noqa: PLC0415
    from loraplex.adapter_store.errors import AdapterValidationError  # noqa: PLC0415

    store = build_store(StoreSettings(local_dir=str(tmp_path)))  # this store does not know the base model
    server = ServerThread(store)
    try:
        with StoreClient(server.target, base=base_config) as client:
            with pytest.raises(AdapterValidationError, match="the base model's q_proj takes 64 inputs"):
                client.put("t/foreign", foreign_adapters["r4-fp32"])
        assert store.list() == []
        with StoreClient(server.target) as client:  # without a base, the same upload is accepted
            assert client.put("t/foreign", foreign_adapters["r4-fp32"]).rank == 4
    finally:
        server.stop()


def test_s3_404_means_missing_only_for_one_key_read(aws_test_credentials):
    """Reading a key that is not there is "missing" (None); a 404 to a list, a write or a delete
    means the endpoint or bucket is wrong, and is BackendUnavailable naming the bucket (the store
    died at start with a raw ClientError traceback, and writes answered INTERNAL)."""
    import http.server
    import threading

    from loraplex.adapter_store.backends.s3_blobs import S3BlobBackend
    from loraplex.adapter_store.errors import BackendUnavailable

    class NotFound(http.server.BaseHTTPRequestHandler):
        def _404(self) -> None:
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()

        do_GET = do_PUT = do_DELETE = do_HEAD = do_POST = _404

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NotFound)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        blobs = S3BlobBackend(S3Settings(bucket="b", endpoint_url=f"http://127.0.0.1:{server.server_port}",
                                         region="us-east-1", connect_timeout_s=1, read_timeout_s=2, max_attempts=1))
        assert blobs.read_head("acme/a") is None
        for op in (lambda: blobs.list_heads("", "", 10), lambda: blobs.write_head("acme/a", b"{}"),
                   lambda: blobs.write_blob("acme/a@v", b"x"), lambda: blobs.delete_head("acme/a")):
            with pytest.raises(BackendUnavailable, match="S3 bucket 'b'"):
                op()
    finally:
        server.shutdown()


def test_store_cli_says_in_one_line_why_it_cannot_start(tmp_path, capsys):
    """A port in use, a --local-dir that is a file and a --base-config that is not an object each
    end the process with one line naming the problem, not a traceback."""
    import socket

    from loraplex.adapter_store.main import main

    (tmp_path / "a-file").write_text("")
    assert main(["--local-dir", str(tmp_path / "a-file" / "x"), "--listen", "127.0.0.1:0"]) == 2
    assert "cannot use" in capsys.readouterr().err
    (tmp_path / "base.json").write_text("[1]")
    assert main(["--local-dir", str(tmp_path / "d1"), "--base-config", str(tmp_path / "base.json")]) == 2
    assert "is not a Hugging Face config.json" in capsys.readouterr().err
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["--local-dir", str(tmp_path / "d2"), "--listen", f"127.0.0.1:{port}", "--metrics-port", "0"]) == 1
        assert f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err
        assert main(["--local-dir", str(tmp_path / "d3"), "--listen", "127.0.0.1:0", "--metrics-port", str(port)]) == 1
        assert f"cannot serve metrics on port {port}" in capsys.readouterr().err


def test_a_lookup_that_races_a_delete_does_not_bring_the_adapter_back(tmp_path, adapters, base_config):
    """A lookup that missed the index reads the head, then fills the index with it; a delete that
    completes in between must not be undone by that fill (the adapter came back in List and Stat
    until a Get happened to clean it up)."""
    from loraplex.adapter_store.factory import build_store
    from loraplex.adapter_store.errors import AdapterNotFoundError

    store = build_store(StoreSettings(blob_backend="local", local_dir=str(tmp_path / "blobs"),
                                      index_backend="memory"), base=base_config)
    store.put("acme/g", adapters["r4-fp32"])
    store.index.remove("acme/g")  # the index misses it (e.g. a lost write): lookups read the head
    heads_read = store._heads.read

    def read_then_deleted(adapter_id):
        record = heads_read(adapter_id)
        if record is not None and not raced:
            raced.append(adapter_id)
            store.delete(adapter_id)  # completes between the lookup's head read and its fill
        return record

    raced: list[str] = []
    store._heads.read = read_then_deleted
    store.stat("acme/g")  # answered from the head it read: the delete came after that
    assert raced == ["acme/g"] and store.index.get("acme/g") is None
    with pytest.raises(AdapterNotFoundError):
        store.stat("acme/g")
    assert [r.adapter_id for r in store.list("", "", 10)] == []


def test_a_redis_that_does_not_answer_is_skipped_for_a_while():
    """After one Redis command got no answer, the next ones fail at once for the cool-down (a hung
    Redis made every store operation wait 10 s a command, 30-80 s in all), then Redis is tried
    again; a Redis that answers "no" (out of memory) does not open the breaker."""
    import redis

    from loraplex.adapter_store.backends.redis_conn import Breaker, translated
    from loraplex.adapter_store.errors import BackendUnavailable

    now = [100.0]
    breaker = Breaker(cool_down_s=5.0, clock=lambda: now[0])
    calls = []

    def command(error):
        with translated("Redis at x", breaker):
            calls.append(error)
            if error is not None:
                raise error

    with pytest.raises(BackendUnavailable, match="OutOfMemoryError"):
        command(redis.exceptions.OutOfMemoryError("OOM"))
    command(None)  # still tried: OOM is an answer
    with pytest.raises(BackendUnavailable, match="TimeoutError"):
        command(redis.exceptions.TimeoutError("read timed out"))
    now[0] += 4.0
    with pytest.raises(BackendUnavailable, match="not tried"):
        command(None)
    assert len(calls) == 3  # the skipped command never ran
    now[0] += 1.5
    command(None)  # the cool-down is over: tried again
    assert len(calls) == 4


def test_at_start_a_missing_bucket_is_an_error_and_an_unreachable_redis_a_warning(shared_moto, caplog):
    """The store used to report SERVING with no word about a bucket that does not exist (then
    UNAVAILABLE on every call, which clients retried) or a Redis nobody listens on."""
    import logging
    import socket

    from loraplex.adapter_store.factory import build_store

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead_port = s.getsockname()[1]  # closed again: nothing listens there
    s3 = S3Settings(bucket="no-such-bucket", endpoint_url=shared_moto.endpoint, region="us-east-1",
                    connect_timeout_s=0.5, read_timeout_s=2, max_attempts=1)
    store = build_store(StoreSettings(blob_backend="s3", s3=s3, index_backend="memory"))
    with pytest.raises(ValueError, match="S3 bucket 'no-such-bucket'.* does not exist"):
        store.check_backends()
    bucket = f"b-{uuid.uuid4().hex[:8]}"
    shared_moto.s3().create_bucket(Bucket=bucket)
    redis_settings = RedisSettings(url=f"redis://127.0.0.1:{dead_port}/0", socket_timeout_s=0.5)
    s3 = S3Settings(bucket=bucket, endpoint_url=shared_moto.endpoint, region="us-east-1", max_attempts=1)
    store = build_store(StoreSettings(blob_backend="s3", s3=s3, index_backend="redis", redis=redis_settings))
    with caplog.at_level(logging.WARNING, logger="loraplex.adapter_store.store"):
        store.check_backends()
    assert any("at start: Redis at 127.0.0.1" in r.getMessage() for r in caplog.records), caplog.records
