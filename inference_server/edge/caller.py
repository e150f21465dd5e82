"""Who made a call, as the edge core reads it: the gRPC edge's ``PrincipalContext`` (set by its
AuthInterceptor) or the HTTP edge's ``HttpCaller``."""

from __future__ import annotations

from typing import Protocol

from loraplex.adapter_store.tenants.principal import Principal


class Caller(Protocol):
    """The caller of one request: its principal (None when authentication is off), its address
    (for audit lines), and whether it gave up on the call."""

    @property
    def principal(self) -> Principal | None: ...

    def peer(self) -> str: ...

    def cancelled(self) -> bool: ...


def principal_of(context: Caller) -> Principal | None:
    """The caller of a handler (None: authentication is off)."""
    return context.principal
