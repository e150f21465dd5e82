"""The asyncio client: ``async for event in AsyncLoraplexClient(addr).generate("Hello")``."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from typing import Any

import grpc
from grpc_health.v1 import health_pb2

from loraplex.clients.base import HEALTH_STATUS, SERVICE_UNKNOWN, ClientBase, ServingWait
from loraplex.clients.errors import LoraplexClientError, NotFoundError, from_rpc_error
from loraplex.clients.requests import (
    DEFAULT_ADDRESS,
    SERVICE,
    CapturedStream,
    Progress,
    UploadPlan,
    check_one_choice,
    generate_request,
    upload_chunk_bytes,
)
from loraplex.clients.security import TlsConfig
from loraplex.clients.types import AdapterInfo, GenerationEvent, GenerationResult, ServerInfo
from loraplex.v1 import inference_pb2 as pb


class AsyncLoraplexClient(ClientBase):
    """The asyncio twin of LoraplexClient (same methods, awaitable; ``generate`` is an async iterator).

    Create it inside a running event loop; ``await client.close()`` (or ``async with``) at the end.
    """

    def __init__(self, address: str = DEFAULT_ADDRESS, *, timeout: float = 30.0, retry_attempts: int = 5,
                 channel: grpc.aio.Channel | None = None, token: str | None = None,
                 tls: TlsConfig | None = None) -> None:
        super().__init__(address, timeout=timeout, retry_attempts=retry_attempts, channel=channel,
                         token=token, tls=tls, aio=True)

    async def __aenter__(self) -> "AsyncLoraplexClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        self._closed = True
        await self._channel.close()

    async def _error(self, exc: grpc.aio.AioRpcError) -> LoraplexClientError:
        """The client error for a failed call; a connection refused for its transport names the fix
        (which may try one TLS handshake with the port: in a thread, off the event loop)."""
        error = from_rpc_error(exc)
        return await asyncio.to_thread(self._transport.explain, error) if self._transport is not None else error

    async def _call(self, method: Any, request: Any, timeout: float | None) -> Any:
        self._open()
        try:
            return await method(request, timeout=self.timeout if timeout is None else timeout, metadata=self._metadata)
        except grpc.aio.AioRpcError as exc:
            raise await self._error(exc) from None

    # -- generation ----------------------------------------------------------------------
    def generate(self, prompt: str | None = None, *, timeout: float | None = None, **kwargs: Any
                 ) -> AsyncIterator[GenerationEvent]:
        """Stream a generation; closing the stream cancels it on the server. Leaving an ``async for``
        early closes it only once the stream is collected (Python's async generators): to stop at
        once, iterate inside ``contextlib.aclosing(client.generate(...))`` or ``await stream.aclose()``.
        Same keyword arguments as LoraplexClient.generate."""
        self._open()
        return self._stream(generate_request(prompt, **kwargs), timeout)

    async def _stream(self, request: pb.GenerateRequest, timeout: float | None) -> AsyncIterator[GenerationEvent]:
        call = self._stub.Generate(request, timeout=timeout, metadata=self._metadata)
        try:
            async for message in call:
                yield GenerationEvent.from_pb(message)
        except grpc.aio.AioRpcError as exc:
            raise await self._error(exc) from None
        finally:
            call.cancel()

    async def generate_text(self, prompt: str | None = None, **kwargs: Any) -> GenerationResult:
        """The whole generation at once (one choice: ``n`` > 1 is ``generate_choices``)."""
        check_one_choice(kwargs)
        return GenerationResult.gather([e async for e in self.generate(prompt, **kwargs)])

    async def generate_choices(self, prompt: str | None = None, **kwargs: Any) -> list[GenerationResult]:
        """The ``n`` choices of one prompt, whole, in index order."""
        return GenerationResult.gather_choices([e async for e in self.generate(prompt, **kwargs)])

    # -- adapters ------------------------------------------------------------------------
    async def upload_adapter(self, adapter_id: str, folder: str | os.PathLike[str], *, public: bool = False,
                             progress: Progress | None = None, timeout: float | None = 600.0) -> AdapterInfo:
        """Upload a PEFT LoRA folder; ``progress(sent_bytes, total_bytes)`` as chunks go out.
        ``public``: as LoraplexClient.upload_adapter (each upload sets it anew)."""
        self._open()
        plan = await asyncio.to_thread(UploadPlan.from_folder, adapter_id, folder, public)
        if self._chunk_bytes is None:
            self._chunk_bytes = upload_chunk_bytes((await self.server_info(timeout=timeout)).max_message_bytes)
        stream = CapturedStream(plan.messages(progress, self._chunk_bytes))
        try:
            return AdapterInfo.from_pb(await self._stub.UploadAdapter(iter(stream), timeout=timeout,
                                                                      metadata=self._metadata))
        except grpc.aio.AioRpcError as exc:
            if stream.error is not None:  # the folder or the progress callback failed, not the server
                raise stream.error from None
            raise await self._error(exc) from None

    async def list_adapters(self, prefix: str = "", *, timeout: float | None = None) -> list[AdapterInfo]:
        out, token = [], ""
        while True:
            page = await self._call(self._stub.ListAdapters, pb.ListAdaptersRequest(prefix=prefix, page_token=token),
                                    timeout)
            out.extend(AdapterInfo.from_pb(a) for a in page.adapters)
            token = page.next_page_token
            if not token:
                return out

    async def get_adapter(self, adapter_id: str, *, timeout: float | None = None) -> AdapterInfo:
        return AdapterInfo.from_pb(await self._call(self._stub.GetAdapter, pb.GetAdapterRequest(adapter_id=adapter_id),
                                                    timeout))

    async def delete_adapter(self, adapter_id: str, *, timeout: float | None = None) -> None:
        await self._call(self._stub.DeleteAdapter, pb.DeleteAdapterRequest(adapter_id=adapter_id), timeout)

    # -- server --------------------------------------------------------------------------
    async def server_info(self, *, timeout: float | None = None) -> ServerInfo:
        return ServerInfo.from_pb(await self._call(self._stub.ServerInfo, pb.ServerInfoRequest(), timeout))

    async def health(self, service: str = "", *, timeout: float | None = None) -> str:
        """SERVING, NOT_SERVING, SERVICE_UNKNOWN (the port's health service does not know ``service``)
        or UNKNOWN."""
        try:
            response = await self._call(self._health.Check, health_pb2.HealthCheckRequest(service=service), timeout)
        except NotFoundError:  # grpc.health.v1's answer for a service it does not know
            return SERVICE_UNKNOWN
        return HEALTH_STATUS[response.status]

    async def wait_until_serving(self, timeout: float = 300.0, interval: float = 0.25) -> None:
        """Poll health until SERVING; TimeoutError with the last status if ``timeout`` passes. Only
        a server not up yet is waited for; any other error (the wrong transport, a refused token, a
        closed client) is raised at once."""
        wait = ServingWait(self.address, timeout)
        while wait.waiting():
            try:
                if wait.serving(await self.health(SERVICE, timeout=wait.poll_timeout())):
                    return
            except ServingWait.STILL_STARTING as exc:
                wait.not_up(exc)  # raises it again when waiting cannot help
            await asyncio.sleep(interval)
        raise wait.expired()
