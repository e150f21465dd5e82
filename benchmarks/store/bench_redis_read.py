"""Where the time of a Redis hit goes: one cached blob (default 80 MB, a 7B rank-16 adapter)
read by one GET, by ranged GETs over 1-8 reader threads, the sha256 alone, and the store's
own read (RedisBlobCache.pieces + StoredRecord.unpack_pieces: ranges, hashed as they land).

    python -m benchmarks.store.bench_redis_read --redis-url redis://127.0.0.1:6379/0 [--mb 80]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from loraplex.adapter_store.backends import redis_cache
from loraplex.adapter_store.backends.redis_conn import connect
from loraplex.adapter_store.records import FileEntry, StoredRecord
from loraplex.adapter_store.settings import RedisSettings
from loraplex.adapter_store.format.files import AdapterInfo


def median_ms(fn: Callable[[], object], reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def ranged(client, key: str, size: int, threads: int, piece: int) -> bytes:
    with ThreadPoolExecutor(threads) as pool:
        parts = pool.map(lambda s: client.getrange(key, s, min(size, s + piece) - 1), range(0, size, piece))
        return b"".join(parts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--redis-url", required=True)
    ap.add_argument("--mb", type=int, default=80)
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    client = connect(RedisSettings(url=args.redis_url))
    data = os.urandom(args.mb * 1_000_000)
    ns = f"bench-read-{uuid.uuid4().hex[:8]}"
    cache = redis_cache.RedisBlobCache(client, ns, 2 * len(data))
    cache.put("blob", data)
    key = f"{ns}:blob:blob"
    info = AdapterInfo("bench/blob", "v", "0" * 64, 16, 32.0, ("q_proj",), "BF16", len(data), 0.0)
    record = StoredRecord(info, (FileEntry("adapter_model.safetensors", len(data), hashlib.sha256(data).hexdigest()),))
    rows = [("one GET", median_ms(lambda: client.get(key), args.reps)),
            ("sha256 of the bytes alone", median_ms(lambda: hashlib.sha256(data).digest(), args.reps))]
    for threads in (1, 2, 4, 8):
        rows.append((f"ranged GETs, {redis_cache.RANGE_BYTES >> 20} MB, {threads} thread(s), joined",
                     median_ms(lambda t=threads: ranged(client, key, len(data), t, redis_cache.RANGE_BYTES), args.reps)))
    rows.append(("the store's read: pieces() + unpack_pieces() (ranges hashed as they land)",
                 median_ms(lambda: record.unpack_pieces(cache.pieces("blob")), args.reps)))
    cache.discard("blob")
    print(f"| {args.mb} MB cached blob, {os.cpu_count()} CPUs | median ms |\n| --- | ---: |")
    for name, ms in rows:
        print(f"| {name} | {ms:.1f} |")


if __name__ == "__main__":
    main()
