"""What the blocking and asyncio clients share: the connection's state, the closed check, and the
policy of waiting for a server to come up (the twins differ only in how they block)."""

from __future__ import annotations

import math
import time
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from loraplex.clients.errors import (
    ClientClosedError,
    DeadlineExceededError,
    LoraplexClientError,
    TransportMismatchError,
    UnavailableError,
)
from loraplex.clients.requests import channel_options
from loraplex.clients.security import TlsConfig, auth_metadata, make_channel
from loraplex.clients.transport import NOT_INFERENCE_SERVICE, Transport
from loraplex.v1 import inference_pb2_grpc as pb_grpc

HEALTH_STATUS = {v: k for k, v in health_pb2.HealthCheckResponse.ServingStatus.items()}
SERVICE_UNKNOWN = "SERVICE_UNKNOWN"  # health: the port does not serve the service asked about


class ClientBase:
    """One connection to one server: address, default timeout, token, channel and stubs."""

    def __init__(self, address: str, *, timeout: float, retry_attempts: int, channel: Any,
                 token: str | None, tls: TlsConfig | None, aio: bool) -> None:
        self.address = address
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < math.inf:
            # 0 meant no deadline on unary calls and an expired one on generate; -1 and nan failed every call
            raise ValueError(f"timeout must be a number of seconds > 0, got {timeout!r}")
        self.timeout = timeout
        self._metadata = auth_metadata(token)  # sent with every call
        # a failed connection is explained only on channels made here (their transport is known)
        self._transport = Transport(address, tls is not None, tls.client_pair if tls else None) \
            if channel is None else None
        self._channel = channel or make_channel(address, channel_options(retry_attempts=retry_attempts), tls,
                                                   aio=aio)
        self._stub = pb_grpc.InferenceServiceStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._chunk_bytes: int | None = None  # upload chunks sized to the server's message limit, once asked
        self._closed = False

    def _open(self) -> None:
        """ClientClosedError once closed (gRPC's own error there is no client error)."""
        if self._closed:
            raise ClientClosedError()


class ServingWait:
    """``wait_until_serving``'s clock and verdicts. Only a server not up yet is waited for
    (unreachable, or not answering in time); any other error (the wrong transport, a refused token,
    a closed client) does not fix itself and is raised at once by the caller."""

    STILL_STARTING = (UnavailableError, DeadlineExceededError)

    def __init__(self, address: str, timeout: float) -> None:
        self.address = address
        self.timeout = timeout
        self.deadline = time.monotonic() + timeout
        self.last = "no answer"
        self._unreachable = False  # the last poll's error was UNAVAILABLE (refused, no such host)

    def waiting(self) -> bool:
        return time.monotonic() < self.deadline

    def poll_timeout(self) -> float:
        """One health call's timeout: at most 5 s, never past the deadline (at least 0.1 s)."""
        return max(0.1, min(5.0, self.deadline - time.monotonic()))

    def serving(self, status: str) -> bool:
        """Is ``status`` (the inference service's health) SERVING? A port that does not serve the
        service at all (the adapter store's, another gRPC server's) is raised at once: its health
        service said SERVING for the whole server, and waiting cannot help."""
        if status == SERVICE_UNKNOWN:
            raise LoraplexClientError(grpc.StatusCode.UNIMPLEMENTED, f"{self.address}: {NOT_INFERENCE_SERVICE}")
        self.last, self._unreachable = status, False
        return status == "SERVING"

    def not_up(self, exc: UnavailableError | DeadlineExceededError) -> None:
        """Note a server not up yet; a transport mismatch (an UnavailableError) is raised again:
        waiting cannot fix it. A poll cut short by its deadline while its call was retrying an
        unreachable port keeps the reason it was unreachable (the last poll, shorter than gRPC's
        retries, ran out first: the wait ended saying only DEADLINE_EXCEEDED of a server that was down)."""
        if isinstance(exc, TransportMismatchError):
            raise exc
        if isinstance(exc, DeadlineExceededError) and self._unreachable:
            return
        self.last, self._unreachable = str(exc), isinstance(exc, UnavailableError)

    def expired(self) -> TimeoutError:
        return TimeoutError(f"{self.address} not SERVING after {self.timeout:.0f}s (last: {self.last})")
