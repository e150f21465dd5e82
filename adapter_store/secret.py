"""The client side of the store's shared secret: read it from its file, check it, and send
it (with the caller the call is made for, if any) on every call of a channel. The store's
side, which checks it, is auth.py."""

from __future__ import annotations

import grpc

from loraplex.adapter_store.protocol import ROLE_METADATA_KEY, SECRET_METADATA_KEY, TENANT_METADATA_KEY
from loraplex.adapter_store.tenants.principal import Principal

MIN_SECRET_LEN = 16


def read_secret(path: str) -> str:
    """The secret in ``path`` (surrounding whitespace stripped); ValueError if unusable."""
    try:
        with open(path, encoding="utf-8") as f:
            secret = f.read().strip()
    except OSError as exc:
        raise ValueError(f"store secret file {path}: cannot read ({exc.strerror})") from None
    check_secret(secret, f"store secret file {path}")
    return secret


def check_secret(secret: str, where: str = "store secret") -> None:
    """ValueError unless ``secret`` is 16+ printable ASCII characters without spaces."""
    if len(secret) < MIN_SECRET_LEN or not all("\x21" <= c <= "\x7e" for c in secret):
        raise ValueError(f"{where}: must be at least {MIN_SECRET_LEN} printable ASCII characters, no spaces")


def caller_metadata(caller: Principal | None) -> list[tuple[str, str]]:
    """The metadata naming ``caller`` (empty for None: the server's own calls)."""
    if caller is None:
        return []
    return [(TENANT_METADATA_KEY, caller.tenant), (ROLE_METADATA_KEY, caller.role.value)]


class _MetadataClientInterceptor(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                                 grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds fixed metadata (the shared secret, the caller) to every call of a sync channel."""

    def __init__(self, pairs: list[tuple[str, str]]) -> None:
        self._pairs = pairs

    def _details(self, details: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        metadata = list(details.metadata or ()) + self._pairs
        return _CallDetails(details.method, details.timeout, metadata, details.credentials,
                            details.wait_for_ready, details.compression)

    def intercept_unary_unary(self, continuation, details, request):  # noqa: ANN001, ANN201
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):  # noqa: ANN001, ANN201
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation, details, request_iterator):  # noqa: ANN001, ANN201
        return continuation(self._details(details), request_iterator)

    def intercept_stream_stream(self, continuation, details, request_iterator):  # noqa: ANN001, ANN201
        return continuation(self._details(details), request_iterator)


class _CallDetails(grpc.ClientCallDetails):
    def __init__(self, method, timeout, metadata, credentials, wait_for_ready, compression):  # noqa: ANN001
        self.method, self.timeout, self.metadata = method, timeout, metadata
        self.credentials, self.wait_for_ready, self.compression = credentials, wait_for_ready, compression


def with_secret(channel: grpc.Channel, secret: str | None, caller: Principal | None = None) -> grpc.Channel:
    """``channel`` sending the shared secret (when not None) and the ``caller`` (when not None,
    see caller_of) on every call."""
    pairs = caller_metadata(caller)
    if secret is not None:
        check_secret(secret)
        pairs.append((SECRET_METADATA_KEY, secret))
    return grpc.intercept_channel(channel, _MetadataClientInterceptor(pairs)) if pairs else channel
