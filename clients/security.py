"""How a client proves who it is (bearer token) and reaches a TLS port (root CA, client cert)."""

from __future__ import annotations

import re
import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import grpc

from loraplex.clients.token_format import TOKEN_RULE, is_token

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

    @property
    def client_pair(self) -> tuple[str, str] | None:
        """(client certificate, key) files, or None without mutual TLS."""
        return (self.client_cert_file, self.client_key_file) if self.client_cert_file and self.client_key_file \
            else None

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> "TlsConfig | None":
        """TLS from LORAPLEX_TLS_ROOT_CERT / _CLIENT_CERT / _CLIENT_KEY, or None when none is set."""
        values = {name: env.get(var) or None for name, var in TLS_ENV.items()}
        return cls(**values) if any(values.values()) else None

    def credentials(self) -> grpc.ChannelCredentials:
        if self.client_cert_file:
            _check_pair(self.client_cert_file, self.client_key_file)
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.root_cert_file, "TLS root certificate"),
            private_key=_read(self.client_key_file, "TLS client key"),
            certificate_chain=_read(self.client_cert_file, "TLS client certificate"),
        )


def _check_pair(cert_file: str, key_file: str) -> None:
    """ValueError unless ``key_file`` is the key of ``cert_file`` (gRPC fails only its handshake
    then, naming neither file)."""
    _read(cert_file, "TLS client certificate")
    _read(key_file, "TLS client key")
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_cert_chain(cert_file, key_file)
    except ssl.SSLError as e:
        reason = e.reason or str(e)
        if "KEY_VALUES_MISMATCH" in str(e):
            raise ValueError(
                f"TLS client key {key_file} is not the key of the client certificate {cert_file}") from None
        raise ValueError(f"TLS client certificate {cert_file} / key {key_file}: cannot be loaded ({reason})") from None


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
    if not is_token(token):
        raise ValueError(f"the token is not one a server accepts: {TOKEN_RULE}")
    return (("authorization", f"Bearer {token}"),)


def check_address(address: str) -> str:
    """``address`` if it is a usable gRPC target, else ValueError naming the problem (a port past
    65535 was taken modulo 65536 by the resolver, and the call failed naming another port; an
    http:// URL failed as a "Misformatted domain name")."""
    if not isinstance(address, str) or not address.strip():
        raise ValueError(f"address must be host:port, got {address!r}")
    # the HTTP API's base URL (http://host:8000/v1) is no gRPC target: it failed "Misformatted domain name"
    url = re.match(r"(https?)://([^/]+)(/.*)?\Z", address, re.IGNORECASE)
    if url is not None:
        tls = " with TLS (--tls; in Python tls=TlsConfig())" if url[1].lower() == "https" else ""
        raise ValueError(f"address {address!r} is a URL: a gRPC address is host:port, e.g. {url[2]!r}{tls}")
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
