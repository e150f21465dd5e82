"""The server's security setup, built once from ServerSettings: tokens, quotas and TLS."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from loraplex.inference_server.auth.quotas import QuotaTracker, TenantLimits
from loraplex.inference_server.auth.tokens import TokenFile

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """PEM files of the public port's TLS; ``client_ca`` set = clients need a certificate (mTLS)."""

    cert: str
    key: str
    client_ca: str | None = None

    def __post_init__(self) -> None:
        if not self.cert or not self.key:
            raise ValueError("TLS needs both a certificate file and a key file")

    def server_credentials(self) -> Any:
        """grpc.ServerCredentials from the files; ValueError naming a file that cannot be read."""
        import grpc  # noqa: PLC0415

        cert, key = _read(self.cert, "TLS certificate"), _read(self.key, "TLS key")
        ca = _read(self.client_ca, "TLS client CA") if self.client_ca else None
        return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=ca is not None)


def _read(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise ValueError(f"{what} file {path}: cannot read ({exc.strerror})") from None
    if b"-----BEGIN" not in data:
        raise ValueError(f"{what} file {path}: not PEM")
    return data


@dataclass(slots=True)
class Security:
    """Authentication (None = off), per-tenant quotas, and TLS (None = plaintext)."""

    tokens: TokenFile | None = None
    limits: TenantLimits = field(default_factory=TenantLimits)
    tls: TlsFiles | None = None
    quotas: QuotaTracker = field(init=False)

    def __post_init__(self) -> None:
        self.quotas = QuotaTracker(self.limits)

    @classmethod
    def from_settings(cls, settings: Any) -> "Security":
        """Read the tokens file (ValueError/OSError if it is unusable) and the limits."""
        tokens = TokenFile(settings.tokens_file) if settings.auth == "tokens" else None
        tls = None
        if settings.tls_cert_file:
            tls = TlsFiles(settings.tls_cert_file, settings.tls_key_file, settings.tls_client_ca_file)
            tls.server_credentials()  # unreadable or non-PEM files fail here, before the port opens
        limits = TenantLimits(
            max_concurrent_requests=settings.tenant_max_concurrent_requests,
            max_queued_requests=settings.tenant_max_queued_requests,
            tokens_per_minute=settings.tenant_tokens_per_minute,
            max_adapter_bytes=settings.tenant_max_adapter_bytes,
            max_adapters=settings.tenant_max_adapters,
        )
        return cls(tokens=tokens, limits=limits, tls=tls)

    def log_startup(self) -> None:
        """Say, at start-up, how callers are authenticated and whether the port is encrypted."""
        if self.tokens is None:
            log.warning("AUTHENTICATION IS OFF (--auth none): every caller may use, upload and delete every "
                        "adapter; use --auth tokens --tokens-file FILE for more than one user")
        else:
            log.info("authentication: bearer tokens from %s", self.tokens.path)
        if self.tls is None and self.tokens is not None:
            log.warning("TLS is off: bearer tokens cross the network in plaintext (set --tls-cert-file and "
                        "--tls-key-file)")
        elif self.tls is not None:
            log.info("TLS on%s", " with client certificates (mTLS)" if self.tls.client_ca else "")
