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

# Loaded on first use (PEP 562), so `loraplex --help`, `hash-token` and the CLI's set-up run before
# gRPC loads: the CLI quiets gRPC's own logging (GRPC_VERBOSITY), which gRPC reads when it loads.
_EXPORTS = {
    "AsyncLoraplexClient": "async_client", "LoraplexClient": "sync_client", "TlsConfig": "security",
    **dict.fromkeys(("ClientClosedError", "DeadlineExceededError", "InvalidArgumentError", "LoraplexClientError",
                     "NotFoundError", "PermissionDeniedError", "ResourceExhaustedError", "TransportMismatchError",
                     "UnauthenticatedError", "UnavailableError"), "errors"),
    **dict.fromkeys(("AdapterInfo", "GenerationEvent", "GenerationResult", "ServerInfo", "Timings", "Usage"), "types"),
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> object:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'loraplex.clients' has no attribute {name!r}")
    import importlib  # noqa: PLC0415

    value = getattr(importlib.import_module(f"loraplex.clients.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
