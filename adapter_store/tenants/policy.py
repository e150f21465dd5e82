"""Who may do what with which adapter: pure functions over a Principal, an adapter id and,
for reads, the adapter's ``public`` flag (from its stored record).

Namespaces: ``tenant/name`` belongs to ``tenant``; a plain ``name`` is the shared namespace,
readable by every tenant and written only by admins. An adapter in a tenant's namespace is
private to that tenant unless it was uploaded as public: then every tenant may generate with
it, show it and list it, and still only its owner (and admins) may upload over it or delete
it. Admins may do everything; ``principal=None`` (authentication off) too.

Reading (generate, show) an adapter the caller may not see raises AdapterNotFoundError,
exactly as if it did not exist (no existence leak). Writing (upload, delete) outside the
caller's namespace raises PermissionDeniedError whether or not the adapter exists, public or
not, so that answer leaks nothing either.

Visibility depends on the record, so callers check it at request time: ``reads_record`` says
when the flag decides (another tenant's adapter), and only then is the record looked up.
"""

from __future__ import annotations

from collections.abc import Iterable

from loraplex.adapter_store.errors import AdapterNotFoundError, PermissionDeniedError
from loraplex.adapter_store.tenants.principal import Principal


def adapter_owner(adapter_id: str) -> str | None:
    """The tenant owning ``adapter_id`` (``tenant/name``), or None for the shared namespace."""
    tenant, sep, _ = adapter_id.partition("/")
    return tenant if sep else None


def _reads_anything(principal: Principal | None) -> bool:
    return principal is None or principal.is_admin


def reads_record(principal: Principal | None, adapter_id: str) -> bool:
    """Does whether ``principal`` may read ``adapter_id`` depend on the adapter's public flag?
    (True exactly for a tenant reading another tenant's adapter.)"""
    if _reads_anything(principal):
        return False
    owner = adapter_owner(adapter_id)
    return owner is not None and owner != principal.tenant  # type: ignore[union-attr]


def can_read(principal: Principal | None, adapter_id: str, public: bool = False) -> bool:
    """May ``principal`` generate with, show or list ``adapter_id``, whose record says ``public``?"""
    return public or not reads_record(principal, adapter_id)


def check_read(principal: Principal | None, adapter_id: str, public: bool = False) -> None:
    """AdapterNotFoundError unless ``principal`` may read ``adapter_id`` (whose record says ``public``)."""
    if not can_read(principal, adapter_id, public):
        raise AdapterNotFoundError(adapter_id)


def check_write(principal: Principal | None, adapter_id: str, action: str) -> None:
    """PermissionDeniedError unless ``principal`` may upload or delete ``adapter_id``."""
    if _reads_anything(principal):
        return
    owner = adapter_owner(adapter_id)
    if owner == principal.tenant:  # type: ignore[union-attr]
        return
    where = "the shared namespace is written by admins only" if owner is None else \
        "it is outside your namespace (another tenant's public adapter is read-only for you)"
    raise PermissionDeniedError(
        f"tenant {principal.tenant!r} may not {action} adapter {adapter_id!r}: {where}; "  # type: ignore[union-attr]
        f"use '{principal.tenant}/<name>'"  # type: ignore[union-attr]
    )


def visible(principal: Principal | None, adapters: Iterable[tuple[str, bool]]) -> list[str]:
    """The ids ``principal`` may list, from (adapter id, public) pairs: its own, the shared ones
    and other tenants' public ones (all of them for an admin)."""
    return [a for a, public in adapters if can_read(principal, a, public)]


def quota_tenant(principal: Principal | None, adapter_id: str | None = None) -> str:
    """The tenant whose quotas an action counts against: the namespace written, else the caller."""
    if adapter_id is not None and adapter_owner(adapter_id) is not None:
        return adapter_owner(adapter_id)  # type: ignore[return-value]
    return principal.tenant if principal is not None else ""
