"""Who is calling: a tenant (its namespace) and a role. The server authenticates callers
(inference_server/auth/tokens.py); the store holds trusted calls made for a caller to the
same tenant rules (policy.py)."""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

_TENANT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}\Z")  # one adapter-id part


class Role(str, enum.Enum):
    TENANT = "tenant"
    ADMIN = "admin"


@dataclass(frozen=True, slots=True)
class Principal:
    """Who is calling: a tenant (its namespace) and a role."""

    tenant: str
    role: Role

    def __post_init__(self) -> None:
        if not _TENANT.match(self.tenant):
            raise ValueError(f"tenant {self.tenant!r}: 1-64 characters of [A-Za-z0-9._-], starting with a "
                             "letter or digit")

    @property
    def is_admin(self) -> bool:
        return self.role is Role.ADMIN
