"""The InferenceService servicer: thin methods over the engine; conversion lives in convert.py,
status codes in interceptor.py, the generation lifecycle, admission and tenancy in the edge
core (edge/)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass
import grpc

from loraplex.adapter_store.errors import InvalidRequestError
from loraplex.adapter_store.format.files import AdapterInfo, OpenPut
from loraplex.inference_server.auth.security import Security
from loraplex.inference_server.edge.checks import INLINE_TOKENIZE_CHARS, RequestLimits, check_not_model_name
from loraplex.inference_server.edge.generation import generation, interleaved
from loraplex.inference_server.edge.metrics import ServerMetrics
from loraplex.inference_server.edge.state import ServingState
from loraplex.inference_server.edge.tenancy import Tenancy
from loraplex.inference_server.edge.tenant_metrics import TenantMetrics
from loraplex.inference_server.engine.api import ServingEngine
from loraplex.inference_server.server import convert
from loraplex.inference_server.server.response_format import grammar_field
from loraplex.inference_server.server.upload import UploadAssembler, UploadLimits, pass_on, until_refused
from loraplex.v1 import inference_pb2 as pb, inference_pb2_grpc as pb_grpc


_CANCEL_LANDS_S = 0.05  # what a short upload waits for its client's cancel (it lands at the first await)


@dataclass(frozen=True, slots=True)
class EdgeConfig:
    """The edge's own limits and defaults (from ServerSettings)."""

    default_max_new_tokens: int
    max_upload_bytes: int
    max_message_bytes: int
    server_version: str
    list_page_size: int = 1000

    def __post_init__(self) -> None:
        for name in ("default_max_new_tokens", "max_upload_bytes", "max_message_bytes", "list_page_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


class InferenceServicer(pb_grpc.InferenceServiceServicer):
    """loraplex.v1.InferenceService over an AsyncEngine."""

    def __init__(self, state: ServingState, metrics: ServerMetrics, config: EdgeConfig,
                 tenancy: Tenancy | None = None) -> None:
        self._state = state
        self._metrics = metrics
        self._config = config
        self._tenancy = tenancy or Tenancy(Security(), TenantMetrics(metrics.registry))
        self._upload_limits = UploadLimits(max_upload_bytes=config.max_upload_bytes)

    def _limits(self, engine: ServingEngine) -> RequestLimits:
        return RequestLimits.for_engine(engine.info, self._config.default_max_new_tokens)

    async def _decode(self, request: pb.GenerateRequest, engine: ServingEngine) -> convert.EdgeRequest:
        args = (request, engine.tokenizer, self._limits(engine))
        long_text = request.WhichOneof("prompt") == "text" and len(request.text) > INLINE_TOKENIZE_CHARS
        if long_text or request.WhichOneof("prompt") == "chat":
            return await asyncio.to_thread(convert.generate_request_from_pb, *args)
        return convert.generate_request_from_pb(*args)

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
                       ) -> AsyncIterator[pb.GenerateResponse]:
        """Stream one generation; a cancelled or expired call aborts it in the engine."""
        engine = self._state.engine_or_raise()
        edge = await self._decode(request, engine)
        client_id = edge.client_request_id
        self._tenancy.check_call(context, edge.requests)
        streams = [generation(self._state, self._metrics, self._tenancy, context, engine, r) for r in edge.requests]
        try:
            async with aclosing(interleaved(streams)) as events:
                async for index, event in events:
                    yield convert.token_event_to_pb(event, client_id, index)
        except InvalidRequestError as exc:  # a schema the grammar library refused: named as this API's field
            raise grammar_field(exc) from None

    async def UploadAdapter(self, request_iterator: AsyncIterator[pb.UploadAdapterRequest],
                            context: grpc.aio.ServicerContext) -> pb.Adapter:
        """Receive metadata + chunks and store the adapter atomically: streamed on to the adapter
        store as the chunks arrive (it checks the files, against this server's base too), or taken
        whole and checked here for a local adapter directory."""
        async with self._state.work() as engine:
            assembler = UploadAssembler(self._upload_limits)
            put: OpenPut | None = None
            try:
                messages = aiter(request_iterator)
                async for message in messages:
                    metadata_first = assembler.adapter_id is None
                    assembler.add(message)
                    if metadata_first and assembler.adapter_id is not None:  # the checks before the bytes
                        self._tenancy.check_write(context, assembler.adapter_id, "upload")
                        check_not_model_name(assembler.adapter_id, engine.info, "metadata.adapter_id")
                        await self._tenancy.check_upload_quota(context, engine, assembler.adapter_id,
                                                               assembler.declared_bytes)
                        put = self._open_put(context, engine, assembler.adapter_id, assembler)
                        if put is not None:
                            break
                if put is not None:
                    async for message in until_refused(messages, put):
                        await asyncio.to_thread(pass_on, assembler, message, put)  # hashing, back-pressure
                if not assembler.complete:
                    await _cancellation_lands()
                info = await self._store_upload(context, engine, assembler, put)
            except (Exception, asyncio.CancelledError) as exc:
                if put is not None:
                    put.abort()  # the store stores nothing
                self._tenancy.audit(context, "upload", assembler.adapter_id, exc, assembler.public)
                raise
            self._tenancy.audit(context, "upload", info.adapter_id, None, assembler.public)
            return convert.adapter_to_pb(info)

    def _open_put(self, context: grpc.aio.ServicerContext, engine: ServingEngine, adapter_id: str,
                  assembler: UploadAssembler) -> OpenPut | None:
        """The upload's stream into the adapter store, held to this call's deadline (the assembler
        then relays), or None."""
        writer = self._tenancy.adapters_for(context, engine)
        put = writer.open_put(adapter_id, assembler.declared, assembler.public, context.time_remaining())
        if put is not None:
            assembler.relay()
        return put

    async def _store_upload(self, context: grpc.aio.ServicerContext, engine: ServingEngine,
                            assembler: UploadAssembler, put: OpenPut | None) -> AdapterInfo:
        """Check the whole upload arrived and the tenant's quota again (held with the commit, so
        parallel uploads cannot pass it together), then commit it."""
        if put is None:
            adapter_id, files = await asyncio.to_thread(assembler.finish)  # hashing 80 MB: not on the loop
        else:
            adapter_id, files = assembler.finish_relayed(), {}
        async with self._tenancy.quota_held(adapter_id):
            await self._tenancy.check_upload_quota(context, engine, adapter_id, assembler.declared_bytes)
            if put is not None:
                return await asyncio.to_thread(put.commit)
            writer = self._tenancy.adapters_for(context, engine)
            return await asyncio.to_thread(writer.put, adapter_id, files, assembler.public)

    async def ListAdapters(self, request: pb.ListAdaptersRequest, context: grpc.aio.ServicerContext
                           ) -> pb.ListAdaptersResponse:
        engine = self._state.engine_or_raise()
        infos = {i.adapter_id: i for i in await asyncio.to_thread(self._tenancy.adapters_for(context, engine).list)}
        ids, next_token = convert.list_page(sorted(self._tenancy.visible(context, infos.values())), request.prefix,
                                            request.page_size, request.page_token, self._config.list_page_size)
        held = _residency(engine)
        adapters, next_token = convert.fitting_page([convert.adapter_to_pb(infos[i], held(i)) for i in ids],
                                                    next_token, self._config.max_message_bytes)
        return pb.ListAdaptersResponse(adapters=adapters, next_page_token=next_token)

    async def GetAdapter(self, request: pb.GetAdapterRequest, context: grpc.aio.ServicerContext) -> pb.Adapter:
        engine = self._state.engine_or_raise()
        adapter_id = convert.adapter_id_from_pb(request.adapter_id) or _missing("adapter_id")
        info = await self._tenancy.check_read(context, engine, adapter_id)  # another tenant's: read here
        if info is None:
            info = await asyncio.to_thread(self._tenancy.adapters_for(context, engine).get, adapter_id)
        return convert.adapter_to_pb(info, _residency(engine)(adapter_id))

    async def DeleteAdapter(self, request: pb.DeleteAdapterRequest, context: grpc.aio.ServicerContext
                            ) -> pb.DeleteAdapterResponse:
        async with self._state.work() as engine:
            adapter_id = convert.adapter_id_from_pb(request.adapter_id) or _missing("adapter_id")
            with self._tenancy.audited_write(context, adapter_id, "delete"):
                await asyncio.to_thread(self._tenancy.adapters_for(context, engine).delete, adapter_id)
            return pb.DeleteAdapterResponse()

    async def ServerInfo(self, request: pb.ServerInfoRequest, context: grpc.aio.ServicerContext
                         ) -> pb.ServerInfoResponse:
        engine = self._state.engine_or_raise()
        info, limits = engine.info, self._limits(engine)
        return pb.ServerInfoResponse(
            model_name=info.model_name, dtype=str(info.dtype), device=str(info.device),
            max_context_len=info.max_context_len, max_batch_size=info.max_batch_size,
            max_new_tokens_limit=info.max_new_tokens_limit,
            default_max_new_tokens=limits.default_max_new_tokens, vocab_size=info.vocab_size,
            eos_token_ids=list(info.eos_token_ids), max_upload_bytes=self._config.max_upload_bytes,
            max_message_bytes=self._config.max_message_bytes, server_version=self._config.server_version,
            max_lora_rank=info.max_lora_rank, **_pool_info(engine),
        )


async def _cancellation_lands() -> None:
    """Let a client's cancel reach this call before an incomplete upload is judged. A client
    that cancels an upload ends its request stream first (it reads as a short upload), and the
    cancel reaches the handler at its next await: it is then CANCELLED (nothing stored, nothing
    refused), not INVALID_ARGUMENT for the bytes it did not send."""
    await asyncio.sleep(_CANCEL_LANDS_S)


def _missing(field: str) -> str:
    raise InvalidRequestError("must be non-empty", field)


def _residency(engine: ServingEngine) -> Callable[[str], tuple[bool, bool]]:
    """adapter id -> (in the device pool, in the host tier); (False, False) for one not held."""
    held = engine.adapters.residency()
    return lambda adapter_id: held.get(adapter_id, (False, False))


def _pool_info(engine: ServingEngine) -> dict[str, int]:
    stats = engine.pool_stats()
    if stats is None:
        return {}
    return {"resident_adapters": stats.resident, "adapter_pool_bytes": stats.capacity_bytes,
            "adapter_pool_used_bytes": stats.used_bytes}
