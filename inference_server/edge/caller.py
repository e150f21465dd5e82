"""Who made a call, as the edge core reads it: an object with a ``principal`` (set by the gRPC
edge's AuthInterceptor or the HTTP edge's authenticate; None when authentication is off) and
``peer()`` (the caller's address, for audit lines)."""

from __future__ import annotations

from typing import Any

from loraplex.adapter_store.tenants.principal import Principal


def principal_of(context: Any) -> Principal | None:
    """The caller of a handler (None: authentication is off)."""
    return getattr(context, "principal", None)
