"""Build a Store from StoreSettings: pick one backend per role."""

from __future__ import annotations

import json
from pathlib import Path

from loraplex.adapter_store.backends.local_blobs import LocalBlobBackend
from loraplex.adapter_store.backends.memory_cache import MemoryBlobCache
from loraplex.adapter_store.backends.memory_feed import MemoryChangeFeed
from loraplex.adapter_store.backends.memory_index import MemoryIndex
from loraplex.adapter_store.format.base_shapes import BaseShapes, HFBaseShapes
from loraplex.adapter_store.metrics import StoreMetrics
from loraplex.adapter_store.settings import StoreSettings
from loraplex.adapter_store.store import Store


def load_base_config(path: str | None) -> HFBaseShapes | None:
    """The base model's shapes from a Hugging Face config.json (or the folder holding it)."""
    if path is None:
        return None
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    try:
        return HFBaseShapes.from_hf(json.loads(p.read_text()))
    except FileNotFoundError:
        raise ValueError(f"base model config {p} does not exist") from None
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError, ValueError) as e:
        raise ValueError(f"base model config {p} is not a Hugging Face config.json ({e})") from None
    except OSError as e:
        raise ValueError(f"base model config {p} cannot be read ({e.strerror or e})") from None


def build_store(
    settings: StoreSettings, base: BaseShapes | None = None, metrics: StoreMetrics | None = None
) -> Store:
    """The store the settings describe. ``base`` overrides ``settings.base_config``."""
    base = base if base is not None else load_base_config(settings.base_config)
    if settings.blob_backend == "s3":
        from loraplex.adapter_store.backends.s3_blobs import S3BlobBackend  # noqa: PLC0415  (boto3 is an extra)

        blobs = S3BlobBackend(settings.s3)
        importer = blobs.importer()  # Import reads other prefixes with the same client and credentials
    else:
        blobs, importer = LocalBlobBackend(settings.local_dir), None
    if settings.index_backend == "redis":
        from loraplex.adapter_store.backends.redis_cache import RedisBlobCache  # noqa: PLC0415  (redis is an extra)
        from loraplex.adapter_store.backends.redis_conn import Breaker, connect  # noqa: PLC0415
        from loraplex.adapter_store.backends.redis_feed import RedisChangeFeed  # noqa: PLC0415
        from loraplex.adapter_store.backends.redis_index import RedisIndex  # noqa: PLC0415

        client = connect(settings.redis)
        ns = settings.redis.namespace
        breaker = Breaker()  # one for the client: a Redis that does not answer is skipped by index and cache
        index, cache, feed = (
            RedisIndex(client, ns, breaker=breaker),
            RedisBlobCache(client, ns, settings.cache_max_bytes, breaker=breaker),
            RedisChangeFeed(client, ns),
        )
    else:
        index, cache, feed = MemoryIndex(), MemoryBlobCache(settings.cache_max_bytes), MemoryChangeFeed()
    return Store(
        blobs,
        index,
        cache,
        feed,
        base=base,
        max_rank=settings.max_rank,
        max_adapter_bytes=settings.max_adapter_bytes,
        metrics=metrics,
        importer=importer,
        reconcile_interval_s=settings.reconcile_interval_s,
    )
