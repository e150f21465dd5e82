"""Time from request to first token by where the request's adapter is (bench_pool's TTFT rows).

Tiers: resident in the GPU pool; in the pinned host tier only; at the source only (the
random source's in-memory bytes: what a Redis hit hands over, without the network); and,
given a Redis URL, only in Redis: an in-process Store whose index and blob cache are that
Redis and whose blob files are deleted after the uploads, so the fetch can only be a Redis
hit (the embedded store's read path: GET, sha256 check, unpack).
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable

from loraplex.adapter_store.embedded import InProcessStoreSource
from loraplex.adapter_store.factory import build_store
from loraplex.adapter_store.format.files import AdapterFiles, AdapterInfo
from loraplex.adapter_store.settings import RedisSettings, StoreSettings
from loraplex.inference_server.engine.request import GenerationRequest, StoppingCriteria

REDIS_PREFIX = "redis-"
PROMPT = tuple(range(5, 133))  # 128 tokens


class RoutedSource:
    """AdapterSource: ids that start with REDIS_PREFIX from the Redis-backed store, the rest
    from ``memory`` (whose ``files`` and ``spec`` the other bench_pool rows read)."""

    def __init__(self, memory, store: InProcessStoreSource) -> None:
        self.memory, self.store = memory, store
        self.files, self.spec = memory.files, memory.spec

    def _pick(self, adapter_id: str):
        return self.store if adapter_id.startswith(REDIS_PREFIX) else self.memory

    def resolve(self, adapter_id: str) -> AdapterFiles:
        return self._pick(adapter_id).resolve(adapter_id)

    def get(self, adapter_id: str) -> AdapterInfo:
        return self._pick(adapter_id).get(adapter_id)


def redis_source(url: str, cfg, files: dict[str, bytes], count: int) -> InProcessStoreSource:
    """A store over Redis (fresh namespace) holding REDIS_PREFIX0 .. count-1, their blob files
    deleted: only the Redis blob cache holds their bytes."""
    blobs_dir = tempfile.mkdtemp(prefix="bench-pool-blobs-")
    size = sum(len(b) for b in files.values())
    settings = StoreSettings(blob_backend="local", local_dir=blobs_dir, index_backend="redis",
                             redis=RedisSettings(url=url, namespace=f"bench-pool-{uuid.uuid4().hex[:8]}"),
                             cache_max_bytes=(count + 2) * (size + (1 << 20)), max_adapter_bytes=2 * size + (1 << 20))
    store = build_store(settings, base=cfg)
    for i in range(count):
        store.put(f"{REDIS_PREFIX}{i}", files)
    shutil.rmtree(blobs_dir)
    return InProcessStoreSource(store)


def first_token_s(core, mgr, adapter_id: str, tag: str) -> float:
    """Seconds from submitting a 128-token prompt for ``adapter_id`` (acquire included) to its
    first token, on an idle engine."""
    request = GenerationRequest(tag, PROMPT, adapter_id, stopping=StoppingCriteria(max_new_tokens=1, ignore_eos=True))
    t0 = time.perf_counter()
    core.add_request(request, mgr.acquire(adapter_id))
    first = None
    while core.has_work():
        events = core.step()
        if first is None and any(e.request_id == tag and e.token_ids for e in events):
            first = time.perf_counter() - t0
    if first is None:
        raise AssertionError(f"{tag}: no token came back")
    return first


def counted(mgr, counter: str, fn: Callable[[], float]) -> float:
    """fn(), checking that it moved the pool's ``counter`` (e.g. host_hits) by exactly one."""
    before = mgr.stats().counters[counter]
    out = fn()
    moved = mgr.stats().counters[counter] - before
    if moved != 1:
        raise AssertionError(f"expected one {counter}, got {moved}")
    return out


def ttft_rows(engine, mgr, redis_count: int = 0, pool_places: int = 30, reps: int = 5) -> list[str]:
    """TTFT per tier (medians). ``pool_places``: more loads than the pool holds, so the first
    ``reps`` adapters loaded leave the pool and stay in the host tier."""
    core = engine._core
    first_token_s(core, mgr, "t-warm", "warm")  # prefill graph / allocator warm-up
    source = [counted(mgr, "source_fetches", lambda i=i: first_token_s(core, mgr, f"t-{i}", f"src{i}"))
              for i in range(pool_places + reps)]
    host = [counted(mgr, "host_hits", lambda i=i: first_token_s(core, mgr, f"t-{i}", f"host{i}")) for i in range(reps)]
    last = f"t-{reps - 1}"
    resident = [counted(mgr, "gpu_hits", lambda k=k: first_token_s(core, mgr, last, f"res{k}")) for k in range(reps)]
    rows = [f"| TTFT, idle engine, 128-token prompt, adapter resident in the pool | {ms(resident):.1f} ms | |",
            f"| TTFT, adapter in the host tier only | {ms(host):.1f} ms | |",
            f"| TTFT, adapter at the source only (in-memory bytes) | {ms(source):.1f} ms | |"]
    if redis_count:
        redis = [counted(mgr, "source_fetches", lambda i=i: first_token_s(core, mgr, f"{REDIS_PREFIX}{i}", f"r{i}"))
                 for i in range(redis_count)]
        rows.append(f"| TTFT, adapter only in Redis (in-process store: Redis GET, sha256, unpack) | {ms(redis):.1f} ms "
                    f"| <= 100 ms to the GPU (Redis hit) |")
    return rows


def ms(xs: list[float]) -> float:
    """Median of ``xs`` (seconds) in milliseconds (bench_pool's rows use it too)."""
    return statistics.median(xs) * 1e3
