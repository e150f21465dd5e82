"""How a client proves who it is (bearer token) and reaches a TLS port (root CA, client cert)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import grpc

TOKEN_ENV = "LORAPLEX_TOKEN"
TLS_ENV = {"root_cert_file": "LORAPLEX_TLS_ROOT_CERT", "client_cert_file": "LORAPLEX_TLS_CLIENT_CERT",
           "client_key_file": "LORAPLEX_TLS_CLIENT_KEY"}


@dataclass(frozen=True, slots=True)
class TlsConfig:
    """TLS to the server. ``root_cert_file`` None = the system's CAs; the client certificate and
    key (PEM files) are for servers that require client certificates (mTLS)."""

    root_cert_file: str | None = None
    client_cert_file: str | None = None
    client_key_file: str | None = None

    def __post_init__(self) -> None:
        if bool(self.client_cert_file) != bool(self.client_key_file):
            raise ValueError("a client certificate needs its key, and a key its certificate")

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> "TlsConfig | None":
        """TLS from LORAPLEX_TLS_ROOT_CERT / _CLIENT_CERT / _CLIENT_KEY, or None when none is set."""
        values = {name: env.get(var) or None for name, var in TLS_ENV.items()}
        return cls(**values) if any(values.values()) else None

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.root_cert_file, "TLS root certificate"),
            private_key=_read(self.client_key_file, "TLS client key"),
            certificate_chain=_read(self.client_cert_file, "TLS client certificate"),
        )


def _read(path: str | None, what: str) -> bytes | None:
    if path is None:
        return None
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise ValueError(f"{what} {path}: cannot read ({exc.strerror})") from None
    if b"-----BEGIN " not in data:  # gRPC would only fail its handshake, naming no file
        raise ValueError(f"{what} {path}: not a PEM file (no -----BEGIN line)")
    return data


def auth_metadata(token: str | None) -> tuple[tuple[str, str], ...] | None:
    """The call metadata carrying ``token`` (None: no token)."""
    if token is None:
        return None
    if not token or token != token.strip() or not token.isascii():
        raise ValueError("token must be non-empty ASCII without surrounding whitespace")
    return (("authorization", f"Bearer {token}"),)


def check_address(address: str) -> str:
    """``address`` if it is a usable gRPC target, else ValueError naming the problem (a port past
    65535 was taken modulo 65536 by the resolver, and the call failed naming another port)."""
    if not isinstance(address, str) or not address.strip():
        raise ValueError(f"address must be host:port, got {address!r}")
    m = re.search(r":(\d+)\Z", address)
    if m is not None and not 1 <= int(m[1]) <= 65535:
        raise ValueError(f"address {address!r}: port {m[1]} is outside 1-65535")
    return address


def make_channel(address: str, options: list[tuple[str, Any]], tls: TlsConfig | None, aio: bool) -> Any:
    """A sync or asyncio channel to ``address``, over TLS when ``tls`` is given."""
    check_address(address)
    if tls is None:
        return (grpc.aio.insecure_channel if aio else grpc.insecure_channel)(address, options=options)
    return (grpc.aio.secure_channel if aio else grpc.secure_channel)(address, tls.credentials(), options=options)
