"""Prometheus metrics of the serving edge, in a registry of their own, served over HTTP.

Counters and histograms are updated by the servicer and the interceptor; engine gauges
(queue length, running requests, KV blocks, resident adapters) are read from
``engine.stats()`` at scrape time, so they are never stale.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from loraplex.inference_server.engine.info import EngineStats
from loraplex.inference_server.lora.pool.pool_stats import PoolStats

BASE_MODEL_LABEL = "base"  # the adapter label of requests to the base model
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_TOKEN_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0)


class ServerMetrics:
    """Every metric the server exports. ``stats`` returns the engine's stats, or None before load."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self._stats: Callable[[], EngineStats | None] = lambda: None
        self.tenant_adapter_labels = False  # set for authenticated (multi-tenant) serving: adapter_label
        r = self.registry
        self.rpcs = Counter("loraplex_rpc_requests", "RPCs by method and status code", ["method", "code"], registry=r)
        self.rpc_seconds = Histogram("loraplex_rpc_duration_seconds", "RPC duration by method", ["method"],
                                     buckets=_LATENCY_BUCKETS, registry=r)
        self.generate_requests = Counter("loraplex_generate_requests",
                                         "Generate streams that produced tokens, by adapter (see adapter_label)",
                                         ["adapter"], registry=r)
        self.generated_tokens = Counter("loraplex_generated_tokens", "Tokens streamed to clients", registry=r)
        self.prompt_tokens = Counter("loraplex_prompt_tokens", "Prompt tokens of requests the engine took (a "
                                     "refused one adds none)", registry=r)
        self.finished = Counter("loraplex_finished_requests", "Finished generations by finish reason",
                                ["reason"], registry=r)
        self.ttft = Histogram("loraplex_time_to_first_token_seconds", "Request arrival to first streamed token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("loraplex_inter_token_latency_seconds", "Time between streamed tokens",
                             buckets=_TOKEN_BUCKETS, registry=r)
        self.active_streams = Gauge("loraplex_active_streams",
                                    "Generations streaming at the edge (gRPC or HTTP; n choices count n)", registry=r)
        self._engine_gauge("loraplex_queue_length", "Requests waiting in the engine queue", "num_waiting")
        self._engine_gauge("loraplex_running_requests", "Requests the engine is decoding", "num_running")
        self._engine_gauge("loraplex_free_kv_blocks", "Free KV cache blocks", "free_kv_blocks")
        self._engine_gauge("loraplex_total_kv_blocks", "KV cache blocks in all", "total_kv_blocks")
        self._engine_gauge("loraplex_resident_adapters", "Adapters resident in the device pool", "resident_adapters")
        r.register(_EngineCounters(lambda: self._stats()))

    def _engine_gauge(self, name: str, doc: str, attr: str) -> None:
        def read() -> float:
            stats = self._stats()
            return float(getattr(stats, attr)) if stats is not None else 0.0

        Gauge(name, doc, registry=self.registry).set_function(read)

    def bind_engine_stats(self, stats: Callable[[], EngineStats | None]) -> None:
        """Read engine gauges from ``stats()`` (the engine's EngineStats) at scrape time."""
        self._stats = stats

    def bind_pool_stats(self, stats: Callable[[], PoolStats | None]) -> None:
        """Export the adapter pool (tiers, evictions, load latency) from ``stats()`` at scrape time."""
        from loraplex.inference_server.edge.pool_metrics import PoolCollector  # noqa: PLC0415

        self.registry.register(PoolCollector(stats))

    def observe_rpc(self, method: str, code: str, seconds: float) -> None:
        """One finished RPC."""
        self.rpcs.labels(method, code).inc()
        self.rpc_seconds.labels(method).observe(seconds)

    def stream(self, adapter_id: str | None, prompt_tokens: int) -> "StreamMetrics":
        """Start timing one Generate stream (counted by adapter at its first token: a request for
        an adapter that does not exist adds no series); its ``prompt_tokens`` count once the
        engine takes it (StreamMetrics.admit)."""
        return StreamMetrics(self, self.adapter_label(adapter_id), prompt_tokens)

    def adapter_label(self, adapter_id: str | None) -> str:
        """The adapter label of a request. With tenants, an adapter of a tenant is labelled by the
        tenant alone ("acme/*"): the metrics endpoint has no authentication, and a private
        adapter's id must not show there (nor may one label per adapter of thousands grow it)."""
        if adapter_id is None:
            return BASE_MODEL_LABEL
        if self.tenant_adapter_labels and "/" in adapter_id:
            return adapter_id.split("/", 1)[0] + "/*"
        return adapter_id


@dataclass(slots=True)
class StreamMetrics:
    """Per-stream timing: TTFT at the first token, then the gap between tokens."""

    metrics: ServerMetrics
    adapter: str  # its generate_requests label
    prompt_tokens: int  # counted by admit
    start: float = field(default_factory=time.perf_counter)
    last: float | None = None
    admitted: bool = False

    def admit(self) -> bool:
        """The engine took the request (its first event came, or it was aborted while it waited):
        its prompt tokens are counted, once. True the first time. A request the engine refused
        (unknown adapter, full queue) is never admitted: it computed no prompt."""
        if self.admitted:
            return False
        self.admitted = True
        self.metrics.prompt_tokens.inc(self.prompt_tokens)
        return True

    def tokens(self, n: int) -> None:
        """``n`` tokens were just streamed."""
        if n <= 0:
            return
        now = time.perf_counter()
        m = self.metrics
        if self.last is None:
            m.generate_requests.labels(self.adapter).inc()
            m.ttft.observe(now - self.start)
            n_gaps, gap = n - 1, 0.0
        else:
            n_gaps, gap = n, (now - self.last) / n
        for _ in range(n_gaps):
            m.itl.observe(gap)
        m.generated_tokens.inc(n)
        self.last = now

    def finished(self, reason: str) -> None:
        self.metrics.finished.labels(reason).inc()


class MetricsHttpServer:
    """The /metrics HTTP endpoint (prometheus_client's threaded WSGI server)."""

    def __init__(self, metrics: ServerMetrics, host: str, port: int) -> None:
        self._server: WSGIServer
        self._thread: threading.Thread
        self._server, self._thread = start_http_server(port, addr=host, registry=metrics.registry)

    @property
    def port(self) -> int:
        return self._server.server_port

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


class _EngineCounters(Collector):
    """The engine's cumulative counts as Prometheus counters, read at scrape time: prompt
    tokens looked up in the prefix cache and those served from it (hit rate = their ratio)."""

    _COUNTERS = (
        ("loraplex_prefix_cache_queried_tokens", "Prompt tokens of admitted requests looked up in the prefix cache",
         "prefix_queried_tokens"),
        ("loraplex_prefix_cache_hit_tokens", "Prompt tokens served from cached KV blocks (not computed)",
         "prefix_hit_tokens"),
    )

    def __init__(self, stats: Callable[[], EngineStats | None]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        for name, doc, attr in self._COUNTERS:
            yield CounterMetricFamily(name, doc, value=getattr(stats, attr) if stats is not None else 0)
