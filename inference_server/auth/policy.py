"""Who may do what with which adapter: pure functions over a Principal and an adapter id.

Namespaces: ``tenant/name`` belongs to ``tenant`` and is private to it; a plain ``name`` is
the shared namespace, public (every tenant may generate with it, list it and show it) and
written only by admins. Admins may do everything.

Reading (generate, show) an adapter the caller may not see raises AdapterNotFoundError,
exactly as if it did not exist (no existence leak). Writing (upload, delete) outside the
caller's namespace raises PermissionDeniedError whether or not the adapter exists, so
that answer leaks nothing either.
"""

from __future__ import annotations

from collections.abc import Iterable

from inference_server.auth.tokens import Principal
from inference_server.errors import AdapterNotFoundError, PermissionDeniedError


def adapter_owner(adapter_id: str) -> str | None:
    """The tenant owning ``adapter_id`` (``tenant/name``), or None for the shared namespace."""
    tenant, sep, _ = adapter_id.partition("/")
    return tenant if sep else None


def can_read(principal: Principal | None, adapter_id: str) -> bool:
    """May ``principal`` generate with, show or list ``adapter_id``? (None = auth off: yes)."""
    if principal is None or principal.is_admin:
        return True
    owner = adapter_owner(adapter_id)
    return owner is None or owner == principal.tenant


def check_read(principal: Principal | None, adapter_id: str) -> None:
    """AdapterNotFoundError unless ``principal`` may read ``adapter_id``."""
    if not can_read(principal, adapter_id):
        raise AdapterNotFoundError(adapter_id)


def check_write(principal: Principal | None, adapter_id: str, action: str) -> None:
    """PermissionDeniedError unless ``principal`` may upload or delete ``adapter_id``."""
    if principal is None or principal.is_admin:
        return
    owner = adapter_owner(adapter_id)
    if owner == principal.tenant:
        return
    where = "the shared namespace is written by admins only" if owner is None else \
        "it is outside your namespace"
    raise PermissionDeniedError(
        f"tenant {principal.tenant!r} may not {action} adapter {adapter_id!r}: {where}; "
        f"use '{principal.tenant}/<name>'"
    )


def visible(principal: Principal | None, adapter_ids: Iterable[str]) -> list[str]:
    """The ids ``principal`` may list: its own and the shared ones (all of them for an admin)."""
    return [a for a in adapter_ids if can_read(principal, a)]


def quota_tenant(principal: Principal | None, adapter_id: str | None = None) -> str:
    """The tenant whose quotas an action counts against: the namespace written, else the caller."""
    if adapter_id is not None and adapter_owner(adapter_id) is not None:
        return adapter_owner(adapter_id)  # type: ignore[return-value]
    return principal.tenant if principal is not None else ""
