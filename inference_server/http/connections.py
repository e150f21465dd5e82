"""Bounds on the HTTP port's connections (docs/HTTP.md, "Bounded connections").

uvicorn and h11 bound some of it with their own knobs: ``timeout_keep_alive`` closes an idle
kept-alive connection, ``h11_max_incomplete_event_size`` refuses a request head that grows past
it before it is complete (400). ``ConnectionCap`` answers a request on a connection past the cap
with an OpenAI-shaped 503, counted (uvicorn's ``limit_concurrency`` answers plain text, counted
nowhere), except the probes' and scrapers' /health and /metrics, which a small reserve answers
(with Connection: close) so that a loaded server does not look dead to them. What they lack is a deadline for the request head: a connection that sends nothing, or half a request line,
was held forever. ``deadline_protocol`` adds it as a small subclass of uvicorn's h11 protocol,
with a backstop for a body still arriving after its route's own deadline (routes read their
bodies under ``RouteConfig.body_timeout_s`` and answer 408; this closes the connections of the
routes that answer without reading theirs).

A connection closed while its client is still sending a body (a 413, a 408) is closed the
way nginx's ``lingering_close`` does it: closing a socket with unread bytes makes the kernel
answer with a reset, and a reset can destroy the answer just sent before the client reads it.
``_LingeringTransport`` half-closes instead (the answer, then FIN), drops what still arrives, and
closes once the client stops sending or ``LINGER_S`` has passed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from loraplex.inference_server.http.errors import HttpError, error_response

BODY_BACKSTOP_GRACE_S = 1.0  # the route's own body deadline answers 408 first
LINGER_S = 5.0  # how long a closed connection still reads (and drops) a refused body
PROBE_PATHS = frozenset({"/health", "/metrics"})  # answered past the cap, from the reserve
PROBE_RESERVE = 16  # probe requests answered at once past the cap; more are refused as any request
_REQUEST_TIMEOUT = b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"


@dataclass(frozen=True, slots=True)
class HttpConnectionLimits:
    """What the HTTP port allows a connection (from ServerSettings' http_* settings)."""

    head_timeout_s: float = 10.0
    keep_alive_timeout_s: float = 5.0
    max_connections: int = 2048
    max_head_bytes: int = 16 * 1024

    def __post_init__(self) -> None:
        for name in ("head_timeout_s", "keep_alive_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {self.max_connections}")
        if self.max_head_bytes < 1024:
            raise ValueError(f"max_head_bytes must be >= 1024, got {self.max_head_bytes}")

    @classmethod
    def from_settings(cls, settings: Any) -> "HttpConnectionLimits":
        """The limits ServerSettings' http_* settings set."""
        return cls(head_timeout_s=settings.http_head_timeout_s, keep_alive_timeout_s=settings.http_keep_alive_timeout_s,
                   max_connections=settings.http_max_connections, max_head_bytes=settings.http_max_head_bytes)

    def uvicorn_config(self, body_timeout_s: float, on_timeout: Callable[[str], None]) -> dict[str, Any]:
        """uvicorn.Config's arguments for these limits; ``on_timeout(phase)`` ("head" or "body")
        is called for each connection a deadline closes."""
        return {"http": deadline_protocol(self.head_timeout_s, body_timeout_s + BODY_BACKSTOP_GRACE_S, on_timeout),
                "timeout_keep_alive": self.keep_alive_timeout_s,
                "h11_max_incomplete_event_size": self.max_head_bytes}


class _LingeringTransport:
    """uvicorn's view of a connection's transport, whose ``close`` lingers while the client is
    mid-body (``receiving_body()``): it shuts the write side, keeps reading and dropping, and
    closes the socket when the client's EOF comes (asyncio closes it then) or after LINGER_S."""

    def __init__(self, transport: asyncio.Transport, receiving_body: Callable[[], bool],
                 loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._receiving_body = receiving_body
        self._loop = loop
        self._linger: asyncio.TimerHandle | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)

    @property
    def lingering(self) -> bool:
        return self._linger is not None

    def is_closing(self) -> bool:
        return self.lingering or self._transport.is_closing()

    def close(self) -> None:
        if self.lingering or self._transport.is_closing() or not self._receiving_body():
            self._transport.close()
            return
        self._linger = self._loop.call_later(LINGER_S, self._transport.close)
        if self._transport.can_write_eof():
            self._transport.write_eof()  # after what is buffered: the answer, then FIN
        self._transport.resume_reading()

    def stop_lingering(self) -> None:
        if self._linger is not None:
            self._linger.cancel()


class ConnectionCap:
    """The ASGI app behind a cap on open connections: a request on a connection past ``limit``
    (``open_connections()`` counts this one) is answered 503 in OpenAI's shape, with Retry-After and
    Connection: close, and ``on_refused()`` is called; no route runs for it.

    /health and /metrics (kubelet probes, Prometheus, the routers' scrapes) are answered past the
    cap too, at most ``probe_reserve`` of them at once, each with Connection: close: a server at
    its cap is loaded, not dead, and must not be restarted or drained for it. The reserve keeps
    that bounded (one more probe is refused as any request), the close keeps a probe's connection
    from lingering past the cap, and the check is made for each request, so a connection that
    was let in for a probe gets no other route."""

    def __init__(self, app: Callable[..., Awaitable[None]], open_connections: Callable[[], int], limit: int,
                 on_refused: Callable[[], None], probe_reserve: int = PROBE_RESERVE) -> None:
        self._app = app
        self._open_connections = open_connections
        self._limit = limit
        self._on_refused = on_refused
        self._probe_reserve = probe_reserve
        self._probes_past_cap = 0  # probe requests being answered past the cap now

    async def __call__(self, scope: dict[str, Any], receive: Callable[..., Any], send: Callable[..., Any]) -> None:
        if scope["type"] != "http" or self._open_connections() <= self._limit:
            await self._app(scope, receive, send)
        elif scope["path"] in PROBE_PATHS and self._probes_past_cap < self._probe_reserve:
            self._probes_past_cap += 1
            try:
                await self._app(scope, receive, _closing(send))
            finally:
                self._probes_past_cap -= 1
        else:
            self._on_refused()
            refusal = HttpError(503, f"this server holds its limit of {self._limit} HTTP connections "
                                     "(--http-max-connections); retry shortly", kind="server_error",
                                code="too_many_connections", close=True)
            await error_response(refusal)(scope, receive, send)


def _closing(send: Callable[..., Awaitable[None]]) -> Callable[..., Awaitable[None]]:
    """``send`` with Connection: close added to the response head (uvicorn closes the connection
    once that response is out)."""
    async def send_closing(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            headers = [h for h in message.get("headers", []) if h[0].lower() != b"connection"]
            message = {**message, "headers": [*headers, (b"connection", b"close")]}
        await send(message)
    return send_closing


def deadline_protocol(head_timeout_s: float, body_timeout_s: float,
                      on_timeout: Callable[[str], None]) -> type[H11Protocol]:
    """uvicorn's h11 protocol with deadlines: a connection has ``head_timeout_s`` to send a
    request head (a new connection from its start, a kept-alive one from its next request's
    first byte: until then uvicorn's keep-alive timeout applies) and ``body_timeout_s`` from its
    head to the end of its body; past either it is closed (408 first if part of a head came)."""

    class DeadlineH11Protocol(H11Protocol):
        _timer: asyncio.TimerHandle | None = None
        _phase: str | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            lingering = _LingeringTransport(transport, lambda: self.conn.their_state is h11.SEND_BODY, self.loop)
            super().connection_made(lingering)  # type: ignore[arg-type]
            self._watch(new=True)

        def data_received(self, data: bytes) -> None:
            if self.transport.lingering:
                return  # the rest of a refused body
            super().data_received(data)
            self._watch(new=False)

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel()
            self.transport.stop_lingering()
            super().connection_lost(exc)

        def _watch(self, new: bool) -> None:
            """(Re)arm the deadline of the phase the client is in: sending a head, or a body."""
            state = self.conn.their_state
            phase = "head" if state is h11.IDLE else "body" if state is h11.SEND_BODY else None
            if phase == self._phase and (self._timer is not None or phase is None):
                return
            self._cancel()
            self._phase = phase
            if phase == "head" and (new or self.conn.trailing_data[0]):
                self._timer = self.loop.call_later(head_timeout_s, self._expired)
            elif phase == "body":
                self._timer = self.loop.call_later(body_timeout_s, self._expired)

        def _cancel(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

        def _expired(self) -> None:
            self._timer = None
            phase, state = self._phase, self.conn.their_state
            if self.transport.is_closing() or (phase, state) not in (("head", h11.IDLE), ("body", h11.SEND_BODY)):
                return
            if phase == "head" and self.conn.trailing_data[0]:
                self.transport.write(_REQUEST_TIMEOUT)  # part of a head came: say why it is closed
            self.transport.close()
            on_timeout(phase)

    return DeadlineH11Protocol
