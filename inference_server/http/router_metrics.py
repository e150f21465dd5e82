"""The gauges LoRA-aware routers scrape, under vLLM's names, and the HTTP edge's request counts.

The Gateway API Inference Extension's endpoint picker and llm-d's scheduler read a model
server's queue (``vllm:num_requests_waiting``, ``vllm:num_requests_running``), its KV cache
use (``vllm:kv_cache_usage_perc``, and the older ``vllm:gpu_cache_usage_perc``) and which
adapters it serves (``vllm:lora_requests_info``: labels ``running_lora_adapters`` and
``waiting_lora_adapters``, comma-separated, and ``max_lora``; the value is the time of the
scrape, as vLLM sets it). ``max_lora`` is how many distinct adapters of the served rank the
device pool holds at once (engine/lora_capacity.py), which is what the routers' "room for one
more adapter" rule compares the running and waiting adapters with. ``waiting`` includes the
adapters of requests waiting for pool space. Residency, for llm-d's residency scorer until
vLLM settles its names: ``loraplex:lora_resident{adapter, tier}`` = 1 for each adapter in the
device pool (``gpu``), the pinned host tier (``host``) and the adapter source (``store``: every
adapter listed, read in the background at most every STORE_LIST_INTERVAL_S, never on the
scrape). They are read at scrape time, like loraplex's own gauges, and cover requests from both
edges. With tenants, adapter names follow ServerMetrics.adapter_label (``acme/*``): the metrics
endpoint has no authentication.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator

from prometheus_client import Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from loraplex.inference_server.edge.metrics import ServerMetrics
from loraplex.inference_server.edge.state import ServingState
from loraplex.inference_server.engine.api import ServingEngine

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
STORE_LIST_INTERVAL_S = 5.0  # the store tier of the residency gauge is at most this old
log = logging.getLogger(__name__)


class _StoreListing:
    """The adapter ids the engine's source lists, refreshed in a background thread when older
    than STORE_LIST_INTERVAL_S (a scrape never waits for the store)."""

    def __init__(self) -> None:
        self._ids: tuple[str, ...] = ()
        self._at = -STORE_LIST_INTERVAL_S
        self._busy = threading.Lock()

    def ids(self, engine: ServingEngine) -> tuple[str, ...]:
        if time.monotonic() - self._at >= STORE_LIST_INTERVAL_S and self._busy.acquire(blocking=False):
            threading.Thread(target=self._refresh, args=(engine,), name="metrics-store-list", daemon=True).start()
        return self._ids

    def _refresh(self, engine: ServingEngine) -> None:
        try:
            self._ids = tuple(sorted(i.adapter_id for i in engine.adapters.list()))
        except Exception as exc:  # noqa: BLE001  (the store may be down: keep the last listing)
            log.warning("metrics: cannot list the adapter store: %s", exc)
        finally:
            self._at = time.monotonic()
            self._busy.release()


class RouterCollector(Collector):
    """vLLM-named gauges from the engine's stats; zeros (and no adapters) before it loads."""

    def __init__(self, state: ServingState, metrics: ServerMetrics, model_name: Callable[[ServingEngine], str]
                 ) -> None:
        self._state = state
        self._metrics = metrics
        self._model_name = model_name
        self._store = _StoreListing()

    def _gauge(self, name: str, doc: str, model: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(name, doc, labels=["model_name"])
        family.add_metric([model], value)
        return family

    def collect(self) -> Iterator[Metric]:
        engine = self._state.engine
        stats = engine.stats() if engine is not None else None
        model = self._model_name(engine) if engine is not None else ""
        waiting = float(stats.num_waiting) if stats else 0.0
        running = float(stats.num_running) if stats else 0.0
        usage = 1.0 - stats.free_kv_blocks / stats.total_kv_blocks if stats and stats.total_kv_blocks else 0.0
        yield self._gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled", model, waiting)
        yield self._gauge("vllm:num_requests_running", "Requests being decoded", model, running)
        yield self._gauge("vllm:kv_cache_usage_perc", "KV cache usage (1 = full)", model, usage)
        yield self._gauge("vllm:gpu_cache_usage_perc", "KV cache usage (1 = full; the older name)", model, usage)
        yield self._lora_info(engine, stats)
        yield self._residency(engine)

    def _lora_info(self, engine: ServingEngine | None, stats: object) -> GaugeMetricFamily:
        family = GaugeMetricFamily("vllm:lora_requests_info", "Adapters with running and waiting requests",
                                   labels=["running_lora_adapters", "waiting_lora_adapters", "max_lora"])
        if engine is None or stats is None:
            return family
        label = self._metrics.adapter_label
        running = ",".join(sorted({label(a) for a in stats.running_adapters}))
        waiting = ",".join(sorted({label(a) for a in stats.waiting_adapters}))
        family.add_metric([running, waiting, str(stats.max_lora)], time.time())
        return family

    def _residency(self, engine: ServingEngine | None) -> GaugeMetricFamily:
        family = GaugeMetricFamily("loraplex:lora_resident", "1 for each adapter held in a tier: gpu (the device "
                                   "pool), host (the pinned host tier), store (the adapter source)",
                                   labels=["adapter", "tier"])
        if engine is None:
            return family
        label = self._metrics.adapter_label
        held = engine.adapters.residency()
        tiers = {"gpu": {label(a) for a, (gpu, _) in held.items() if gpu},
                 "host": {label(a) for a, (_, host) in held.items() if host},
                 "store": {label(a) for a in self._store.ids(engine)}}
        for tier, adapters in tiers.items():
            for adapter in sorted(adapters):
                family.add_metric([adapter, tier], 1.0)
        return family


class HttpMetrics:
    """Requests of the HTTP edge by route and status, and their duration (the gRPC edge counts
    RPCs in loraplex_rpc_requests)."""

    def __init__(self, metrics: ServerMetrics) -> None:
        r = metrics.registry
        self.requests = Counter("loraplex_http_requests", "HTTP requests by route and status (a stream counted "
                                "when it ends; 499: the client hung up first)", ["route", "status"], registry=r)
        self.seconds = Histogram("loraplex_http_request_duration_seconds",
                                 "HTTP request duration by route (a stream: until its first token, when its "
                                 "headers go out)", ["route"], buckets=_LATENCY_BUCKETS, registry=r)
        self.over_cap = Counter("loraplex_http_connections_over_cap", "HTTP requests answered 503 because their "
                                "connection was past --http-max-connections", registry=r)
        self.connection_timeouts = Counter("loraplex_http_connection_timeouts",
                                           "HTTP connections closed for sending no request head (phase head) or no "
                                           "whole body (phase body) in time", ["phase"], registry=r)

    def connection_timeout(self, phase: str) -> None:
        """A connection closed by its deadline for a request head or body (http/connections.py)."""
        self.connection_timeouts.labels(phase).inc()

    def observe(self, route: str, status: int, seconds: float) -> None:
        """One answered request: its status and its duration."""
        self.count(route, status)
        self.observe_duration(route, seconds)

    def count(self, route: str, status: int) -> None:
        """One request done with ``status`` (a stream: when it ends; 499 when its client left)."""
        self.requests.labels(route, str(status)).inc()

    def observe_duration(self, route: str, seconds: float) -> None:
        self.seconds.labels(route).observe(seconds)
