"""The store's wire constants, shared by its service and its client (which must not import
the service to learn them)."""

from __future__ import annotations

SERVICE_NAME = "loraplex.v1.AdapterStore"
FIELD_METADATA_KEY = "loraplex-field"  # trailer: the field an INVALID_ARGUMENT names
MAX_MESSAGE_BYTES = 8 * 1024 * 1024  # chunks are <= 4 MiB
SECRET_METADATA_KEY = "x-loraplex-store-secret"
TENANT_METADATA_KEY = "x-loraplex-tenant"  # the tenant a trusted call is made for
ROLE_METADATA_KEY = "x-loraplex-role"  # tenant | admin
