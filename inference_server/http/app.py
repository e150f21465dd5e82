"""The HTTP edge: a Starlette app on uvicorn, in the gRPC server's process and event loop.

It shares the gRPC edge's ServingState (admission, draining), metrics registry, security
(tokens, quotas, TLS files) and tenant rules, so SIGTERM drains HTTP streams with gRPC ones
(GrpcServer.shutdown waits on the shared state) and ``close`` then stops the port. uvicorn's
own signal handlers are left out: the process's handler in main.py runs that drain.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse

from loraplex.inference_server.auth.security import Security
from loraplex.inference_server.edge.metrics import ServerMetrics
from loraplex.inference_server.edge.state import ServingState
from loraplex.inference_server.edge.tenancy import Tenancy
from loraplex.inference_server.edge.tenant_metrics import TenantMetrics
from loraplex.inference_server.http.connections import ConnectionCap, HttpConnectionLimits
from loraplex.inference_server.http.cors import Cors, CorsPolicy
from loraplex.inference_server.http.errors import error_body
from loraplex.inference_server.http.router_metrics import RouterCollector
from loraplex.inference_server.http.routes import IGNORED_FIELDS_HEADER, OpenAIRoutes, RouteConfig

log = logging.getLogger(__name__)
_CLOSE_WAIT_S = 5.0  # after the drain: how long open connections get to finish their last response
EXPOSED_HEADERS = (IGNORED_FIELDS_HEADER, "Retry-After")  # response headers a browser page may read (CORS)


@dataclass(frozen=True, slots=True)
class HttpOptions:
    """What the HTTP edge needs from ServerSettings; ``port`` 0 = any free port (tests)."""

    host: str = "127.0.0.1"
    port: int = 0
    routes: RouteConfig = RouteConfig()
    connections: HttpConnectionLimits = HttpConnectionLimits()
    cors: CorsPolicy = CorsPolicy()  # off

    @classmethod
    def from_settings(cls, settings: Any) -> "HttpOptions":
        return cls(host=settings.host, port=settings.http_port,
                   routes=RouteConfig(default_max_new_tokens=settings.default_max_new_tokens,
                                      max_body_bytes=settings.max_message_bytes,
                                      max_upload_bytes=settings.max_upload_bytes,
                                      runtime_lora_updating=settings.allow_runtime_lora_updating == "on",
                                      body_timeout_s=settings.http_body_timeout_s,
                                      max_batch_prompts=settings.max_batch_prompts),
                   connections=HttpConnectionLimits.from_settings(settings),
                   cors=CorsPolicy.parse(settings.http_cors_origins))


class _Uvicorn(uvicorn.Server):
    """uvicorn without its signal handlers (main.py's SIGTERM handler drains both edges)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    """Starlette's own refusals (no such route, wrong method) in the OpenAI error shape."""
    status = exc.status_code if isinstance(exc, HTTPException) else 500
    detail = exc.detail if isinstance(exc, HTTPException) else "internal error"
    headers = exc.headers if isinstance(exc, HTTPException) else None  # a 405's Allow
    return JSONResponse(error_body(f"{request.method} {request.url.path}: {detail}", "invalid_request_error"),
                        status_code=status, headers=headers)


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host.strip("[]"), port))
    except OSError as exc:
        sock.close()
        raise OSError(f"--http-port: cannot listen on {host}:{port} for HTTP: {exc.strerror}") from None
    sock.listen(1024)
    sock.setblocking(False)
    return sock


def _tls_config(security: Security) -> dict[str, Any]:
    """uvicorn's TLS arguments from the gRPC port's TLS files (client CA set: mutual TLS)."""
    tls = security.tls
    if tls is None:
        return {}
    out: dict[str, Any] = {"ssl_certfile": tls.cert, "ssl_keyfile": tls.key}
    if tls.client_ca:
        out.update(ssl_ca_certs=tls.client_ca, ssl_cert_reqs=ssl.CERT_REQUIRED)
    return out


class HttpServer:
    """The OpenAI-compatible port over the gRPC server's state, metrics and security."""

    def __init__(self, options: HttpOptions, state: ServingState, metrics: ServerMetrics, security: Security,
                 tenant_metrics: TenantMetrics) -> None:
        self.options = options
        tenancy = Tenancy(security, tenant_metrics)
        self.routes = OpenAIRoutes(options.routes, state, metrics, tenancy, security)
        metrics.registry.register(RouterCollector(state, metrics, lambda e: self.routes.model_names(e).served))
        self._security = security
        self._server: _Uvicorn | None = None
        self._task: asyncio.Task[None] | None = None
        self.port = 0

    def app(self) -> ConnectionCap | Cors:
        """The routes behind the connection cap, behind CORS where it is on."""
        table = self.routes.routes()
        routes = Starlette(routes=table, exception_handlers={HTTPException: _http_error})
        capped = ConnectionCap(routes, self._open_connections, self.options.connections.max_connections,
                               self.routes.http_metrics.over_cap.inc)
        cors = self.options.cors
        return Cors(capped, cors, table, EXPOSED_HEADERS) if cors.enabled else capped

    def _open_connections(self) -> int:
        return 0 if self._server is None else len(self._server.server_state.connections)

    async def start(self) -> int:
        """Bind and serve (/health answers 503 until the engine is attached); the bound port."""
        sock = _bind(self.options.host, self.options.port)
        self.port = sock.getsockname()[1]
        limits = self.options.connections.uvicorn_config(self.options.routes.body_timeout_s,
                                                         self.routes.http_metrics.connection_timeout)
        config = uvicorn.Config(self.app(), lifespan="off", access_log=False, log_level="warning",
                                timeout_graceful_shutdown=_CLOSE_WAIT_S, **limits, **_tls_config(self._security))
        self._server = _Uvicorn(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises what stopped it
                raise OSError("the HTTP server stopped while starting")
            await asyncio.sleep(0.01)
        scheme = "https" if self._security.tls is not None else "http"
        log.info("HTTP (OpenAI API) listening on %s://%s:%d/v1", scheme, self.options.host, self.port)
        return self.port

    async def close(self) -> None:
        """Stop the port (after the shared state drained: open streams have ended)."""
        if self._server is None or self._task is None:
            return
        self._server.should_exit = True
        await self._task
        log.info("HTTP server stopped")
