"""Bounds on the gRPC port's connections, as gRPC channel arguments (docs/HTTP.md, "Bounded
connections"): calls per connection, idle and old connections closed with GOAWAY (an old one's
calls get a grace period to finish), server keepalive pings that find dead peers, and the
keepalive enforcement policy that answers a client pinging too often with GOAWAY."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MAX_PING_STRIKES = 2  # gRPC's default: pings past the policy before GOAWAY (too_many_pings)


def _ms(seconds: float) -> int:
    return int(round(seconds * 1000))


@dataclass(frozen=True, slots=True)
class GrpcConnectionLimits:
    """What the gRPC port allows a connection (from ServerSettings' grpc_* settings); an idle or
    age limit of 0 is no limit."""

    max_streams_per_connection: int = 1024
    max_connection_idle_s: float = 300.0
    max_connection_age_s: float = 3600.0
    max_connection_age_grace_s: float = 300.0
    keepalive_time_s: float = 60.0
    keepalive_timeout_s: float = 20.0
    min_ping_interval_s: float = 10.0
    permit_keepalive_without_calls: bool = False

    def __post_init__(self) -> None:
        if self.max_streams_per_connection < 1:
            raise ValueError(f"max_streams_per_connection must be >= 1, got {self.max_streams_per_connection}")
        for name in ("max_connection_idle_s", "max_connection_age_s", "max_connection_age_grace_s",
                     "min_ping_interval_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("keepalive_time_s", "keepalive_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")

    @classmethod
    def from_settings(cls, settings: Any) -> "GrpcConnectionLimits":
        """The limits ServerSettings' grpc_* settings set."""
        return cls(max_streams_per_connection=settings.grpc_max_streams_per_connection,
                   max_connection_idle_s=settings.grpc_max_connection_idle_s,
                   max_connection_age_s=settings.grpc_max_connection_age_s,
                   max_connection_age_grace_s=settings.grpc_max_connection_age_grace_s,
                   keepalive_time_s=settings.grpc_keepalive_time_s,
                   keepalive_timeout_s=settings.grpc_keepalive_timeout_s,
                   min_ping_interval_s=settings.grpc_min_ping_interval_s,
                   permit_keepalive_without_calls=settings.grpc_permit_keepalive_without_calls == "on")

    def channel_options(self) -> list[tuple[str, int]]:
        """The grpc.aio.server options that apply these limits."""
        out = [("grpc.max_concurrent_streams", self.max_streams_per_connection),
               ("grpc.keepalive_time_ms", _ms(self.keepalive_time_s)),
               ("grpc.keepalive_timeout_ms", _ms(self.keepalive_timeout_s)),
               ("grpc.http2.min_ping_interval_without_data_ms", _ms(self.min_ping_interval_s)),
               ("grpc.keepalive_permit_without_calls", int(self.permit_keepalive_without_calls)),
               ("grpc.http2.max_ping_strikes", MAX_PING_STRIKES)]
        if self.max_connection_idle_s:
            out.append(("grpc.max_connection_idle_ms", _ms(self.max_connection_idle_s)))
        if self.max_connection_age_s:
            out += [("grpc.max_connection_age_ms", _ms(self.max_connection_age_s)),
                    ("grpc.max_connection_age_grace_ms", _ms(self.max_connection_age_grace_s))]
        return out
