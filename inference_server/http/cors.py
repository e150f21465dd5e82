"""CORS for the HTTP port: which browser pages may call the API (--http-cors-origins; docs/HTTP.md,
"Browsers (CORS)").

Off by default: no CORS headers at all, as before. On, a request whose ``Origin`` is listed (or
any, with ``*``) gets ``Access-Control-Allow-Origin`` and the response headers a page may read,
and a preflight (``OPTIONS`` with ``Access-Control-Request-Method``) to a route the server
serves is answered here, 204, with the route's methods and the request headers allowed. An
unlisted origin gets no CORS headers: its preflight reaches the routes as any OPTIONS does (405),
and the browser keeps the page from the answer. Credentials are never allowed: the API's
callers authenticate with bearer tokens, not cookies.

This module imports no more than the standard library and Starlette's header types: settings.py
checks the origins with ``CorsPolicy.parse`` before anything else is loaded.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from starlette.datastructures import Headers

ALLOWED_HEADERS = ("Authorization", "Content-Type")  # the request headers the API reads
MAX_AGE_S = 600  # how long a browser may keep a preflight's answer
_ORIGIN = re.compile(r"(?P<scheme>[a-z][a-z0-9+.-]*)://(?P<host>\[[0-9a-f:.]+\]|[a-z0-9.-]+)(?::(?P<port>[0-9]{1,5}))?")
_LABEL = re.compile(r"[a-z0-9]([a-z0-9-]*[a-z0-9])?")
_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")  # an HTTP header name
_DEFAULT_PORTS = {"http": "80", "https": "443"}
_ORIGIN_FORM = "an origin is scheme://host[:port], without a path, a trailing '/' or wildcards, e.g. " \
               "https://chat.example.com or http://localhost:3000"


def check_origin(text: str) -> str:
    """``text`` as browsers send it in ``Origin``: lowercase, without the scheme's default port.
    Raises ValueError naming ``text`` when it is no origin."""
    match = _ORIGIN.fullmatch(text.lower())
    host = match["host"] if match else ""
    labels_ok = host.startswith("[") or all(_LABEL.fullmatch(label) for label in host.split("."))
    port = match["port"] if match else None
    if not match or not labels_ok or (port is not None and not 1 <= int(port) <= 65535):
        raise ValueError(f"{text!r} is not an origin: {_ORIGIN_FORM}")
    scheme = match["scheme"]
    if port is None or _DEFAULT_PORTS.get(scheme) == port.lstrip("0"):
        return f"{scheme}://{host}"
    return f"{scheme}://{host}:{int(port)}"


@dataclass(frozen=True, slots=True)
class CorsPolicy:
    """The origins whose pages may call the API: none (off, the default), every one (``*``), or
    those listed (as ``check_origin`` writes them)."""

    origins: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if "*" in self.origins and len(self.origins) > 1:
            raise ValueError("'*' allows every origin: list origins, or give '*' alone")
        for origin in self.origins:
            if origin != "*" and check_origin(origin) != origin:
                raise ValueError(f"{origin!r} is not written as browsers send it: {check_origin(origin)!r}")

    @classmethod
    def parse(cls, text: str | None) -> "CorsPolicy":
        """From ``--http-cors-origins``: unset or blank = off, ``*``, or a comma list of origins.
        Raises ValueError naming the first entry that is no origin."""
        if text is None or not text.strip():
            return cls()
        entries = [e.strip() for e in text.split(",")]
        if "" in entries:
            raise ValueError(f"an empty entry in {text!r}: a comma list of origins, or '*'")
        return cls(tuple(dict.fromkeys(e if e == "*" else check_origin(e) for e in entries)))

    @property
    def enabled(self) -> bool:
        return bool(self.origins)

    @property
    def any_origin(self) -> bool:
        return self.origins == ("*",)

    def allows(self, origin: str) -> bool:
        return self.any_origin or origin in self.origins


class _Route(Protocol):
    """What a Starlette route tells CORS: ``path_regex`` and ``methods``."""

    path_regex: re.Pattern[str]
    methods: set[str] | None


Send = Callable[[dict[str, Any]], Awaitable[None]]


class Cors:
    """The ASGI app behind a CorsPolicy that is on: preflights to ``routes`` are answered here,
    every other request goes to ``app`` with the CORS headers added to its response (the refusals
    of the connection cap too, so a page can read their status and Retry-After)."""

    def __init__(self, app: Callable[..., Awaitable[None]], policy: CorsPolicy, routes: Sequence[_Route],
                 expose_headers: Sequence[str]) -> None:
        self._app = app
        self._policy = policy
        self._routes = routes
        self._expose = ", ".join(expose_headers).encode()

    async def __call__(self, scope: dict[str, Any], receive: Callable[..., Any], send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        origin = headers.get("origin")
        allowed = origin is not None and self._policy.allows(origin)
        methods = self._methods(scope["path"])
        if allowed and methods and scope["method"] == "OPTIONS" and "access-control-request-method" in headers:
            await self._preflight(origin, methods, headers, send)
            return
        await self._app(scope, receive, self._adding(send, origin if allowed else None))

    def _methods(self, path: str) -> list[str]:
        """The methods of the routes serving ``path`` (none: no such route)."""
        return sorted({m for r in self._routes if r.path_regex.match(path) for m in (r.methods or ())})

    def _origin_headers(self, origin: str) -> list[tuple[bytes, bytes]]:
        return [(b"access-control-allow-origin", b"*" if self._policy.any_origin else origin.encode())]

    async def _preflight(self, origin: str, methods: list[str], headers: Headers, send: Send) -> None:
        """204 with the route's methods, and the headers the API reads plus those the page asks for
        (the openai clients send X-Stainless-* ones; the server ignores them, so allowing them
        costs nothing)."""
        asked = [h.strip() for h in headers.get("access-control-request-headers", "").split(",")]
        allowed = dict.fromkeys(h.lower() for h in [*ALLOWED_HEADERS, *asked] if _TOKEN.fullmatch(h))
        vary = b"Access-Control-Request-Headers" if self._policy.any_origin else \
            b"Origin, Access-Control-Request-Method, Access-Control-Request-Headers"
        out = [*self._origin_headers(origin),
               (b"access-control-allow-methods", ", ".join(methods).encode()),
               (b"access-control-allow-headers", ", ".join(allowed).encode()),
               (b"access-control-max-age", str(MAX_AGE_S).encode()), (b"vary", vary), (b"content-length", b"0")]
        await send({"type": "http.response.start", "status": 204, "headers": out})
        await send({"type": "http.response.body", "body": b""})

    def _adding(self, send: Send, origin: str | None) -> Send:
        """``send`` adding to the response head: the allowed origin and the headers a page may
        read; ``Vary: Origin`` unless every origin gets the same answer."""
        async def send_with_cors(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                if origin is not None or self._policy.any_origin:
                    headers += [*self._origin_headers(origin or "*"),
                                (b"access-control-expose-headers", self._expose)]
                if not self._policy.any_origin:
                    headers = _vary_origin(headers)
                message = {**message, "headers": headers}
            await send(message)
        return send_with_cors


def _vary_origin(headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """``headers`` whose Vary names Origin (added to a Vary already there)."""
    for i, (name, value) in enumerate(headers):
        if name.lower() == b"vary":
            if b"origin" not in value.lower():
                headers[i] = (name, value + b", Origin")
            return headers
    return [*headers, (b"vary", b"Origin")]
