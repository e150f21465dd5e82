"""The store's wire constants, shared by its service and its client (which must not import
the service to learn them). The error field's trailer key is errors.py's FIELD_METADATA_KEY."""

from __future__ import annotations

SERVICE_NAME = "loraplex.v1.AdapterStore"
MAX_MESSAGE_BYTES = 8 * 1024 * 1024  # chunks are <= 4 MiB
SECRET_METADATA_KEY = "x-loraplex-store-secret"
TENANT_METADATA_KEY = "x-loraplex-tenant"  # the tenant a trusted call is made for
ROLE_METADATA_KEY = "x-loraplex-role"  # tenant | admin
