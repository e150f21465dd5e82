"""Python client of the loraplex gRPC API: ``LoraplexClient`` (blocking), ``AsyncLoraplexClient``
(asyncio), and the ``loraplex`` CLI (clients/cli.py).

    from loraplex.clients import LoraplexClient
    with LoraplexClient("127.0.0.1:50051") as client:
        for event in client.generate(messages=[{"role": "user", "content": "Hi"}], adapter="pirate"):
            print(event.text, end="", flush=True)
"""

try:
    from loraplex.v1 import inference_pb2 as _pb  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the checkout
    raise ImportError(
        "the generated gRPC code (package loraplex.v1) is missing: run `make protos` "
        "(or `pip install -e .`, which generates it)"
    ) from exc

from loraplex.clients.async_client import AsyncLoraplexClient
from loraplex.clients.errors import (
    DeadlineExceededError,
    InvalidArgumentError,
    LoraplexClientError,
    NotFoundError,
    PermissionDeniedError,
    ResourceExhaustedError,
    TransportMismatchError,
    UnauthenticatedError,
    UnavailableError,
)
from loraplex.clients.security import TlsConfig
from loraplex.clients.sync_client import LoraplexClient
from loraplex.clients.types import AdapterInfo, GenerationEvent, GenerationResult, ServerInfo, Timings, Usage

__all__ = [
    "AdapterInfo", "AsyncLoraplexClient", "DeadlineExceededError", "GenerationEvent", "GenerationResult",
    "InvalidArgumentError", "LoraplexClient", "LoraplexClientError", "NotFoundError", "PermissionDeniedError",
    "ResourceExhaustedError", "ServerInfo", "Timings", "TlsConfig", "TransportMismatchError", "UnauthenticatedError",
    "UnavailableError", "Usage",
]
