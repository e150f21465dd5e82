"""Prometheus view of the adapter pool: hits and misses per tier, evictions, load latency,
resident adapters and bytes. Read from the engine's pool stats at scrape time."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from loraplex.inference_server.lora.pool.pool_stats import LOAD_BUCKETS, PoolStats

# (family, help, {tier label: counter key}): a tier's miss is what the next tier served
_TIERED = (
    ("loraplex_adapter_pool_hits", "Adapter acquisitions served by a tier",
     {"device": "gpu_hits", "host": "host_hits"}),
    ("loraplex_adapter_pool_misses", "Adapter acquisitions a tier could not serve",
     {"device": "gpu_loads", "host": "source_fetches"}),
    ("loraplex_adapter_pool_evictions", "Adapters evicted from a tier",
     {"device": "gpu_evictions", "host": "host_evictions"}),
)


class PoolCollector(Collector):
    """``stats()`` returns the engine's PoolStats, or None before the model is loaded."""

    def __init__(self, stats: Callable[[], PoolStats | None]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        if stats is None:
            return
        c = stats.counters
        for name, doc, tiers in _TIERED:
            family = CounterMetricFamily(name, doc, labels=["tier"])
            for tier, key in tiers.items():
                family.add_metric([tier], c[key])
            yield family
        yield CounterMetricFamily("loraplex_adapter_pool_joins",
                                  "Adapter acquisitions that joined a device load already under way (neither a hit "
                                  "nor a load of their own): hits + joins + device misses = acquisitions",
                                  value=c["gpu_joins"])
        yield CounterMetricFamily("loraplex_adapter_invalidations", "Adapters dropped after a re-upload or delete",
                                  value=c["invalidations"])
        yield CounterMetricFamily("loraplex_adapter_stale_fetches",
                                  "Loads that read an adapter before its re-upload or delete, and fetched it again",
                                  value=c["stale_fetches"])
        buckets, running = [], 0
        for bound in (*LOAD_BUCKETS, float("inf")):
            running += c[f"load_le_{bound}"]
            buckets.append(("+Inf" if bound == float("inf") else str(bound), running))
        yield HistogramMetricFamily("loraplex_adapter_load_seconds", "Request for a non-resident adapter to usable",
                                    buckets=buckets, sum_value=c["load_seconds_sum"])
        for name, doc, value in (
            ("loraplex_adapter_pool_resident", "Adapters resident in the device pool", stats.resident),
            ("loraplex_adapter_pool_in_use", "Resident adapters used by running requests", stats.in_use),
            ("loraplex_adapter_pool_waiting", "Loads waiting for room in the device pool", stats.waiting),
            ("loraplex_adapter_pool_used_bytes", "Device pool bytes holding adapters", stats.used_bytes),
            ("loraplex_adapter_pool_capacity_bytes", "Device pool size", stats.capacity_bytes),
            ("loraplex_adapter_host_cache_bytes", "Pinned host tier bytes holding adapters", stats.host_bytes),
            ("loraplex_adapter_host_cache_entries", "Adapters in the pinned host tier", stats.host_entries),
        ):
            yield GaugeMetricFamily(name, doc, value=value)
