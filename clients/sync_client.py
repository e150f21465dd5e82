"""The blocking client: ``LoraplexClient("127.0.0.1:50051").generate("Hello")`` yields events."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
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


class LoraplexClient(ClientBase):
    """A connection to one loraplex server.

    ``timeout`` (seconds) bounds every unary call; ``generate`` and ``upload_adapter`` take
    their own. Read-only calls are retried on UNAVAILABLE with backoff (``retry_attempts``).
    Errors are raised as ``loraplex.clients.errors.LoraplexClientError`` subclasses.
    """

    def __init__(self, address: str = DEFAULT_ADDRESS, *, timeout: float = 30.0, retry_attempts: int = 5,
                 channel: grpc.Channel | None = None, token: str | None = None,
                 tls: TlsConfig | None = None) -> None:
        super().__init__(address, timeout=timeout, retry_attempts=retry_attempts, channel=channel,
                         token=token, tls=tls, aio=False)

    def __enter__(self) -> "LoraplexClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._closed = True
        self._channel.close()

    def _error(self, exc: grpc.RpcError) -> LoraplexClientError:
        """The client error for a failed call; a connection refused for its transport names the fix."""
        error = from_rpc_error(exc)
        return self._transport.explain(error) if self._transport is not None else error

    def _call(self, method: Any, request: Any, timeout: float | None) -> Any:
        self._open()
        try:
            return method(request, timeout=self.timeout if timeout is None else timeout, metadata=self._metadata)
        except grpc.RpcError as exc:
            raise self._error(exc) from None

    # -- generation ----------------------------------------------------------------------
    def generate(self, prompt: str | None = None, *, timeout: float | None = None, **kwargs: Any
                 ) -> Iterator[GenerationEvent]:
        """Stream a generation as GenerationEvents; leaving the loop early cancels it on the server.

        Keyword arguments (see loraplex.clients.requests.generate_request for each): adapter,
        token_ids, messages, max_new_tokens, temperature, top_k, top_p, min_p, seed,
        repetition_penalty, presence_penalty, frequency_penalty, logit_bias, stop, stop_token_ids,
        min_tokens, ignore_eos, logprobs, top_logprobs, prompt_logprobs, n, skip_special_tokens,
        request_id, json_schema, json_object. ``timeout`` bounds the whole stream. With ``n`` > 1
        the choices' events interleave; each names its ``index``.
        """
        self._open()
        return self._stream(generate_request(prompt, **kwargs), timeout)

    def _stream(self, request: pb.GenerateRequest, timeout: float | None) -> Iterator[GenerationEvent]:
        call = self._stub.Generate(request, timeout=timeout, metadata=self._metadata)
        try:
            for message in call:
                yield GenerationEvent.from_pb(message)
        except grpc.RpcError as exc:
            raise self._error(exc) from None
        finally:
            call.cancel()  # no-op once finished; cancels the server side if we leave early

    def generate_text(self, prompt: str | None = None, **kwargs: Any) -> GenerationResult:
        """The whole generation at once (one choice: ``n`` > 1 is ``generate_choices``)."""
        check_one_choice(kwargs)
        return GenerationResult.gather(list(self.generate(prompt, **kwargs)))

    def generate_choices(self, prompt: str | None = None, **kwargs: Any) -> list[GenerationResult]:
        """The ``n`` choices of one prompt (keyword ``n``, default 1), whole, in index order."""
        return GenerationResult.gather_choices(list(self.generate(prompt, **kwargs)))

    # -- adapters ------------------------------------------------------------------------
    def upload_adapter(self, adapter_id: str, folder: str | os.PathLike[str], *, public: bool = False,
                       progress: Progress | None = None, timeout: float | None = 600.0) -> AdapterInfo:
        """Upload a PEFT LoRA folder; ``progress(sent_bytes, total_bytes)`` is called as chunks go out.
        ``public``: every tenant may generate with it, show it and list it (only you may write it);
        each upload sets this anew, so re-uploading without it makes the adapter private again."""
        self._open()
        plan = UploadPlan.from_folder(adapter_id, folder, public)
        if self._chunk_bytes is None:
            self._chunk_bytes = upload_chunk_bytes((self.server_info(timeout=timeout)).max_message_bytes)
        stream = CapturedStream(plan.messages(progress, self._chunk_bytes))
        try:
            return AdapterInfo.from_pb(self._stub.UploadAdapter(iter(stream), timeout=timeout,
                                                                metadata=self._metadata))
        except grpc.RpcError as exc:
            if stream.error is not None:  # the folder or the progress callback failed, not the server
                raise stream.error from None
            raise self._error(exc) from None

    def list_adapters(self, prefix: str = "", *, timeout: float | None = None) -> list[AdapterInfo]:
        """Every adapter (or those whose id starts with ``prefix``), sorted by id; follows pages."""
        out, token = [], ""
        while True:
            page = self._call(self._stub.ListAdapters, pb.ListAdaptersRequest(prefix=prefix, page_token=token), timeout)
            out.extend(AdapterInfo.from_pb(a) for a in page.adapters)
            token = page.next_page_token
            if not token:
                return out

    def get_adapter(self, adapter_id: str, *, timeout: float | None = None) -> AdapterInfo:
        return AdapterInfo.from_pb(self._call(self._stub.GetAdapter, pb.GetAdapterRequest(adapter_id=adapter_id),
                                              timeout))

    def delete_adapter(self, adapter_id: str, *, timeout: float | None = None) -> None:
        self._call(self._stub.DeleteAdapter, pb.DeleteAdapterRequest(adapter_id=adapter_id), timeout)

    # -- server --------------------------------------------------------------------------
    def server_info(self, *, timeout: float | None = None) -> ServerInfo:
        return ServerInfo.from_pb(self._call(self._stub.ServerInfo, pb.ServerInfoRequest(), timeout))

    def health(self, service: str = "", *, timeout: float | None = None) -> str:
        """The server's health status name: SERVING, NOT_SERVING, SERVICE_UNKNOWN (the port's health
        service does not know ``service``) or UNKNOWN."""
        try:
            response = self._call(self._health.Check, health_pb2.HealthCheckRequest(service=service), timeout)
        except NotFoundError:  # grpc.health.v1's answer for a service it does not know
            return SERVICE_UNKNOWN
        return HEALTH_STATUS[response.status]

    def wait_until_serving(self, timeout: float = 300.0, interval: float = 0.25) -> None:
        """Poll health until SERVING; raise TimeoutError with the last status if ``timeout`` passes.
        Only a server not up yet is waited for (unreachable, or not answering in time): any other
        error (the wrong transport, a refused token, a closed client) does not fix itself and is
        raised at once."""
        wait = ServingWait(self.address, timeout)
        while wait.waiting():
            try:
                if wait.serving(self.health(SERVICE, timeout=wait.poll_timeout())):
                    return
            except ServingWait.STILL_STARTING as exc:
                wait.not_up(exc)  # raises it again when waiting cannot help
            time.sleep(interval)
        raise wait.expired()

