"""Adapter ids: ``name`` or ``tenant/name``, a safe character set, bounded length."""

from __future__ import annotations

import re

from loraplex.adapter_store.errors import InvalidRequestError

MAX_ADAPTER_ID_LEN = 129  # tenant/name: two parts of at most 64 and the '/'
_PART = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}\Z")


def validate_adapter_id(adapter_id: object, field: str = "adapter_id") -> str:
    """Return ``adapter_id`` if valid, else raise InvalidRequestError naming the problem.

    Valid: one or two parts joined by '/', each 1-64 characters of [A-Za-z0-9._-], not
    starting with '.', '_' or '-' (so no '..', no hidden files, no path traversal).
    """
    if not isinstance(adapter_id, str) or not adapter_id:
        raise InvalidRequestError("must be a non-empty string", field)
    if len(adapter_id) > MAX_ADAPTER_ID_LEN:
        raise InvalidRequestError(f"longer than {MAX_ADAPTER_ID_LEN} characters", field)
    parts = adapter_id.split("/")
    if len(parts) > 2:
        raise InvalidRequestError(f"{adapter_id!r}: at most one '/' (tenant/name)", field)
    for part in parts:
        if not _PART.match(part):
            raise InvalidRequestError(
                f"{adapter_id!r}: each part must be 1-64 characters of letters, digits, '.', '_' "
                "or '-', starting with a letter or digit",
                field,
            )
    return adapter_id
