"""The gRPC server: inference service, health, reflection, metrics, and its lifecycle.

Start order: the port opens first with health NOT_SERVING (the model is not loaded yet,
Generate answers UNAVAILABLE); ``attach_engine`` flips health to SERVING. ``shutdown``
stops admitting (UNAVAILABLE, health NOT_SERVING), lets open streams finish within the
grace period, aborts what is left, then closes the port.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from importlib import metadata
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from loraplex.inference_server.auth.security import Security
from loraplex.inference_server.edge.metrics import MetricsHttpServer, ServerMetrics
from loraplex.inference_server.edge.state import ServingState
from loraplex.inference_server.edge.tenancy import Tenancy
from loraplex.inference_server.edge.tenant_metrics import TenantMetrics
from loraplex.inference_server.engine.api import ServingEngine
from loraplex.inference_server.server.auth_interceptor import AuthInterceptor
from loraplex.inference_server.server.connections import GrpcConnectionLimits
from loraplex.inference_server.server.interceptor import ErrorInterceptor
from loraplex.inference_server.server.servicer import EdgeConfig, InferenceServicer
from loraplex.v1 import inference_pb2 as pb, inference_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["InferenceService"].full_name
_ABORT_WAIT_S = 10.0  # after the grace period: how long aborted streams get to send their last message


def server_version() -> str:
    """The installed loraplex version, or 0+unknown when running from a source tree."""
    try:
        return metadata.version("loraplex")
    except metadata.PackageNotFoundError:
        return "0+unknown"


@dataclass(frozen=True, slots=True)
class ServerOptions:
    """What the gRPC edge needs from ServerSettings."""

    host: str = "127.0.0.1"
    port: int = 0
    metrics_port: int = 0
    default_max_new_tokens: int = 256
    max_concurrent_streams: int = 4096
    max_message_bytes: int = 8 * 1024 * 1024
    max_upload_bytes: int = 512 * 1024 * 1024
    health_port: int = 0  # a plaintext port with only grpc.health.v1 (kubelet probes of a TLS port); 0 = none
    connections: GrpcConnectionLimits = GrpcConnectionLimits()

    @classmethod
    def from_settings(cls, settings: Any) -> "ServerOptions":
        names = [name for name in cls.__slots__ if name != "connections"]
        return cls(**{name: getattr(settings, name) for name in names},
                   connections=GrpcConnectionLimits.from_settings(settings))


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


class GrpcServer:
    """One grpc.aio server with the loraplex services, and the metrics endpoint."""

    def __init__(self, options: ServerOptions, metrics: ServerMetrics | None = None,
                 security: Security | None = None) -> None:
        self.options = options
        self.metrics = metrics or ServerMetrics()
        self.security = security or Security()  # default: no authentication, plaintext
        self.metrics.tenant_adapter_labels = self.security.tokens is not None
        self.tenant_metrics = TenantMetrics(self.metrics.registry)
        self.state = ServingState(options.max_concurrent_streams)
        self.health = health.aio.HealthServicer()
        self._server: grpc.aio.Server | None = None
        self._metrics_http: MetricsHttpServer | None = None
        self._health_server: grpc.aio.Server | None = None
        self.health_port = 0
        self.port = 0
        self.metrics_port = 0

    async def start(self) -> int:
        """Bind and start serving (health NOT_SERVING); return the bound gRPC port."""
        o = self.options
        msg_opts = [("grpc.max_receive_message_length", o.max_message_bytes),
                    ("grpc.max_send_message_length", o.max_message_bytes),
                    ("grpc.so_reuseport", 0), *o.connections.channel_options()]
        auth = AuthInterceptor(self.security.tokens, self.tenant_metrics.auth_failure)
        server = grpc.aio.server(interceptors=[ErrorInterceptor(self.metrics), auth], options=msg_opts)
        config = EdgeConfig(default_max_new_tokens=o.default_max_new_tokens, max_upload_bytes=o.max_upload_bytes,
                            max_message_bytes=o.max_message_bytes, server_version=server_version())
        tenancy = Tenancy(self.security, self.tenant_metrics)
        pb_grpc.add_InferenceServiceServicer_to_server(InferenceServicer(self.state, self.metrics, config, tenancy),
                                                       server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
            server,
        )
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        try:
            if self.security.tls is not None:
                credentials = self.security.tls.server_credentials()
                self.port = server.add_secure_port(_address(o.host, o.port), credentials)
            else:
                self.port = server.add_insecure_port(_address(o.host, o.port))
        except RuntimeError as exc:
            raise OSError(f"cannot listen on {_address(o.host, o.port)}: {exc}") from None
        if self.port == 0:
            raise OSError(f"cannot listen on {_address(o.host, o.port)} (address in use?)")
        await server.start()
        self._server = server
        try:
            if o.health_port:
                await self._start_health_port()
            if o.metrics_port:
                self._metrics_http = _metrics_server(self.metrics, o.host, o.metrics_port)
                self.metrics_port = self._metrics_http.port
        except OSError:
            await self.close()  # nothing left listening, no server left to the garbage collector
            raise
        log.info("gRPC listening on %s (metrics: %s)", _address(o.host, self.port),
                 f"http://{_address(o.host, self.metrics_port)}/metrics" if self._metrics_http else "off")
        return self.port

    async def _start_health_port(self) -> None:
        """Serve only health (the same statuses) in plaintext on ``health_port``: the kubelet's
        gRPC probes cannot speak TLS, and health carries no tenant data."""
        o = self.options
        server = grpc.aio.server(options=[("grpc.so_reuseport", 0), *o.connections.channel_options()])
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        try:
            self.health_port = server.add_insecure_port(_address(o.host, o.health_port))
        except RuntimeError as exc:  # grpcio raises where older ones returned 0
            raise OSError(f"--health-port: cannot listen on {_address(o.host, o.health_port)}: {exc}") from None
        if self.health_port == 0:
            raise OSError(f"--health-port: cannot listen on {_address(o.host, o.health_port)} (address in use?)")
        await server.start()
        self._health_server = server

    async def attach_engine(self, engine: ServingEngine) -> None:
        """The model is loaded and the engine started: admit requests, report SERVING."""
        self.state.set_engine(engine)
        self.metrics.bind_engine_stats(engine.stats)
        self.metrics.bind_pool_stats(engine.pool_stats)
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        log.info("serving %s", engine.info.model_name)

    async def close(self) -> None:
        """Stop every port at once, nothing to drain (a start that failed half-way)."""
        for server in (self._server, self._health_server):
            if server is not None:
                await server.stop(grace=None)
        self._server = self._health_server = None
        if self._metrics_http is not None:
            self._metrics_http.close()
            self._metrics_http = None

    async def shutdown(self, grace_s: float, cut_short: asyncio.Event | None = None) -> None:
        """Stop admitting, drain open work for up to ``grace_s`` seconds (or until ``cut_short`` is
        set: a second SIGTERM), abort the rest, close."""
        self.state.start_draining()
        await self.health.enter_graceful_shutdown()
        open_streams = len(self.state.open_stream_ids())
        if open_streams:
            log.info("draining %d open stream(s), up to %.1fs", open_streams, grace_s)
        if not await self._drained(grace_s, cut_short):
            engine = self.state.engine
            left = self.state.open_stream_ids()
            why = "stop requested again" if cut_short is not None and cut_short.is_set() else "grace period over"
            log.warning("%s: aborting %d stream(s)", why, len(left))
            for request_id in left if engine is not None else ():
                engine.abort(request_id)
            await self.state.wait_idle(_ABORT_WAIT_S)
        if self._server is not None:
            await self._server.stop(grace=1.0)
        if self._health_server is not None:
            await self._health_server.stop(grace=0.5)
        if self._metrics_http is not None:
            self._metrics_http.close()
        log.info("gRPC server stopped")

    async def _drained(self, grace_s: float, cut_short: asyncio.Event | None) -> bool:
        """True once no work is open; False when ``grace_s`` passes or ``cut_short`` is set first."""
        if cut_short is None:
            return await self.state.wait_idle(grace_s)
        idle = asyncio.ensure_future(self.state.wait_idle(grace_s))
        cut = asyncio.ensure_future(cut_short.wait())
        await asyncio.wait({idle, cut}, return_when=asyncio.FIRST_COMPLETED)
        for task in (idle, cut):
            task.cancel()
        return idle.done() and not idle.cancelled() and idle.result()

    async def wait_for_termination(self) -> None:
        if self._server is not None:
            await self._server.wait_for_termination()


def _metrics_server(metrics: ServerMetrics, host: str, port: int) -> MetricsHttpServer:
    try:
        return MetricsHttpServer(metrics, host, port)
    except OSError as exc:
        raise OSError(f"--metrics-port: cannot listen on {_address(host, port)}: {exc.strerror or exc}") from None
