"""loraplex: one import namespace for everything the distribution installs.

The repository keeps the design's top-level folders; this package maps them under one name
(each subpackage here is a relative link to its folder, and a wheel holds real copies):

    loraplex.inference_server   the GPU process (inference_server/)
    loraplex.adapter_store      the adapter store sidecar and the adapter format (adapter_store/)
    loraplex.kernels            the SGMV / BGMV kernels and their reference (kernels/)
    loraplex.clients            the Python client and the ``loraplex`` CLI (clients/)
    loraplex.v1                 the gRPC code generated from protos/ (never committed)

The client is the short public entry: ``from loraplex import LoraplexClient`` (or
``AsyncLoraplexClient``). It is imported on first use, so ``import loraplex.kernels`` does not
pull in gRPC.
"""

from __future__ import annotations

from typing import Any

_CLIENT_NAMES = ("LoraplexClient", "AsyncLoraplexClient")

__all__ = list(_CLIENT_NAMES)


def __getattr__(name: str) -> Any:
    if name in _CLIENT_NAMES:
        from loraplex import clients  # noqa: PLC0415  (gRPC only when a client is asked for)

        return getattr(clients, name)
    raise AttributeError(f"module 'loraplex' has no attribute {name!r}")
