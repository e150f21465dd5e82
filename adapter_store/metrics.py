"""Prometheus metrics of one store, in its own registry (no process-global state)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter


class StoreMetrics:
    """Counters the store moves; ``registry`` is what the metrics endpoint serves."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.uploads = Counter(
            "loraplex_store_uploads", "Uploads by outcome (stored, invalid, unavailable)", ["outcome"], registry=r
        )
        self.reads = Counter("loraplex_store_reads", "Adapter reads by where the bytes came from", ["source"], registry=r)
        self.bytes_read = Counter("loraplex_store_read_bytes", "Adapter bytes served", registry=r)
        self.degraded = Counter(
            "loraplex_store_degraded",
            "Operations that went on without a dependency (index, cache, feed: Redis) and fell back",
            ["dependency"],
            registry=r,
        )
        self.blob_store_lost = Counter(
            "loraplex_store_blob_store_lost",
            "Times the blob store was found to have lost its objects (its marker gone or changed: blob_marker.py)",
            registry=r,
        )
        self.checksum_failures = Counter(
            "loraplex_store_checksum_failures", "Blobs that failed their sha256 check (never served)", ["where"], registry=r
        )

    def value(self, name: str, **labels: str) -> float:
        """Current value of a counter by its exposed name (e.g. "loraplex_store_degraded_total")."""
        return self.registry.get_sample_value(name, labels) or 0.0
