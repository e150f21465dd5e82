"""Store-specific errors. Callers see the domain errors of inference_server.errors, plus these."""

from __future__ import annotations

from inference_server.errors import DataLossError


class AdapterCorruptError(DataLossError):
    """Stored bytes failed their checksum (or went missing); they are never served (DATA_LOSS)."""


class BackendUnavailable(Exception):
    """A backend (Redis, S3, the local disk) could not be reached. Internal: the store either
    falls back (and counts it) or turns it into UnavailableError with a message saying why."""

    def __init__(self, backend: str, detail: str) -> None:
        super().__init__(f"{backend} is unreachable: {detail}")
        self.backend = backend
        self.detail = detail


class BlobMissing(LookupError):
    """A blob key that the index points at is not in the blob backend."""
