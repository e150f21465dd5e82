"""The store's gRPC server: AdapterStore, grpc.health.v1, reflection, and periodic upkeep."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from loraplex.adapter_store.auth import SecretInterceptor, is_loopback
from loraplex.adapter_store.protocol import MAX_MESSAGE_BYTES, SERVICE_NAME
from loraplex.adapter_store.service import AdapterStoreService, handler
from loraplex.adapter_store.store import Store

log = logging.getLogger(__name__)


def health_detail_name(detail: str) -> str:
    """The health service name a problem of the store is reported under."""
    return f"{SERVICE_NAME}/{detail}"


class StoreServer:
    """Serves one Store on ``listen`` (host:port; port 0 picks a free one). With ``secret``, every
    AdapterStore call must carry it (adapter_store/auth.py); health and reflection stay open."""

    def __init__(self, store: Store, listen: str, chunk_bytes: int = 1 << 20, maintain_interval_s: float = 2.0,
                 secret: str | None = None) -> None:
        self.store = store
        self._secret = secret
        self._listen = listen
        self._chunk = chunk_bytes
        self._interval = maintain_interval_s
        self._server: grpc.aio.Server | None = None
        self._health = health.aio.HealthServicer()
        self._upkeep: asyncio.Task[None] | None = None
        self.port = 0

    async def start(self) -> int:
        """Bind, start serving, and return the bound port."""
        options = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.so_reuseport", 0)]  # a port in use is refused, not shared with the store already there
        interceptors = [SecretInterceptor(self._secret)] if self._secret is not None else []
        if self._secret is None and not is_loopback(self._listen):
            log.warning("the adapter store listens on %s without a shared secret: anyone who can reach it "
                        "can read, write and delete every tenant's adapters (set --secret-file)", self._listen)
        server = grpc.aio.server(options=options, interceptors=interceptors)
        server.add_generic_rpc_handlers((handler(AdapterStoreService(self.store, self._chunk)),))
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
            server,
        )
        self.port = server.add_insecure_port(self._listen)
        if self.port == 0:
            raise OSError(f"cannot listen on {self._listen}")
        await asyncio.to_thread(self.store.check_backends)  # say now which backends do not answer
        await asyncio.to_thread(self.store.maintain)  # build the index before the first request
        await server.start()
        self._server = server
        for name in ("", SERVICE_NAME):
            await self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        await self._report_details()
        self._upkeep = asyncio.create_task(self._maintain_forever())
        log.info("adapter store serving on port %d (blobs: %s)", self.port, self.store.blobs.description)
        return self.port

    async def _maintain_forever(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            await asyncio.to_thread(self.store.maintain)
            await self._report_details()

    async def _report_details(self) -> None:
        """Each problem of Store.health_details as its own health service name, NOT_SERVING
        (e.g. "loraplex.v1.AdapterStore/blob-store"); the store itself still serves what it can."""
        for name in self.store.health_details():
            await self._health.set(health_detail_name(name), health_pb2.HealthCheckResponse.NOT_SERVING)

    async def stop(self, grace_s: float = 5.0) -> None:
        """Stop accepting calls, let running ones finish within ``grace_s``, then close the store."""
        if self._upkeep is not None:
            self._upkeep.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._upkeep
        if self._server is not None:
            await self._health.enter_graceful_shutdown()
            await self._server.stop(grace_s)
            self._server = None
        await asyncio.to_thread(self.store.close)

    async def wait(self) -> None:
        if self._server is not None:
            await self._server.wait_for_termination()
