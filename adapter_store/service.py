"""The AdapterStore gRPC servicer: thin async methods over a Store run in worker threads.

Errors become the status codes their classes carry (adapter_store/errors.py, the table the
inference server's edges read too): INVALID_ARGUMENT (the message starts with the field when
there is one, also sent as trailing metadata ``loraplex-field``), NOT_FOUND, PERMISSION_DENIED,
UNAVAILABLE, DATA_LOSS, ...; anything else is logged and returned as INTERNAL.

A call naming a caller (adapter_store/auth.py ``caller_of``) is held to the tenant rules of
adapter_store/tenants/policy.py, with each record's ``public`` flag read at call time.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import logging
import re
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import grpc

from loraplex.adapter_store.auth import caller_of
from loraplex.adapter_store.call_deadline import CallDeadline
from loraplex.adapter_store.convert import base_model_from_pb, event_to_pb, record_to_pb
from loraplex.adapter_store.decoding import Undecodable, lenient
from loraplex.adapter_store.errors import (
    FIELD_METADATA_KEY,
    AdapterCorruptError,
    AdapterNotFoundError,
    InvalidRequestError,
    PermissionDeniedError,
    field_of,
    status_of,
)
from loraplex.adapter_store.format.naming import validate_adapter_id
from loraplex.adapter_store.protocol import SERVICE_NAME
from loraplex.adapter_store.records import KIND_RESYNC, ChangeEvent, StoredRecord
from loraplex.adapter_store.store import Store
from loraplex.adapter_store.tenants import policy
from loraplex.adapter_store.tenants.principal import Principal
from loraplex.adapter_store.upload import receive_upload
from loraplex.v1 import store_pb2 as pb

log = logging.getLogger(__name__)
T = TypeVar("T")
DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE = 100, 1000
WATCH_QUEUE = 1024
_TENANT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}\Z")
IMPORT_NEEDS_S3 = ("this adapter store keeps adapters in a local directory and has no S3 client: start "
                   "loraplex-store with an S3 blob backend (--s3-bucket, --s3-endpoint-url) to import s3:// paths")
_PREFIX = re.compile(r"^[A-Za-z0-9._/-]{0,129}\Z")  # an id prefix: up to a whole id


def _status(context: grpc.aio.ServicerContext, exc: Exception) -> tuple[grpc.StatusCode, str]:
    """The status an error becomes, the one its class carries (errors.py; logged; a field it
    names goes into the trailing metadata); INTERNAL for anything else."""
    status = status_of(exc)
    if status is not None:
        code = grpc.StatusCode[status.grpc]
        field = field_of(exc)
        if field:
            context.set_trailing_metadata(((FIELD_METADATA_KEY, field),))
        log.info("%s: %s", code.name, exc)
        return code, str(exc)
    log.error("internal error in the adapter store", exc_info=exc)
    return grpc.StatusCode.INTERNAL, f"internal error ({type(exc).__name__}); see the store's log"


# The wrappers abort after their except block, not inside it: an abort raised there would chain
# the error (its traceback, and so the frames holding an upload's buffer) to the AbortError that
# gRPC keeps in a reference cycle, and the buffer would wait for the cycle collector (failed uploads
# held 1.4 GB that way).
def _unary(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await fn(self, request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # noqa: BLE001  (every error becomes a status)
            status = _status(context, exc)
        await context.abort(*status)

    return wrapper


def _streaming(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        try:
            async for item in fn(self, request, context):
                yield item
            return
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # noqa: BLE001
            status = _status(context, exc)
        await context.abort(*status)

    return wrapper


def _check_filter(tenant: str, prefix: str) -> str:
    """The id prefix a List/Watch filter stands for."""
    if tenant and not _TENANT.match(tenant):
        raise InvalidRequestError(f"{tenant!r} is not a tenant name (letters, digits, '.', '_', '-')", "tenant")
    if not _PREFIX.match(prefix):
        raise InvalidRequestError(f"{prefix!r}: up to 129 characters of letters, digits, '.', '_', '-', '/'", "prefix")
    return f"{tenant}/{prefix}" if tenant else prefix


def _page_token(token: str) -> str:
    if not token:
        return ""
    try:  # strictly: the encoding of an adapter id, as List issues it (lax decoding read "!!!" as "")
        after = base64.b64decode(token.encode(), altchars=b"-_", validate=True).decode()
        if base64.urlsafe_b64encode(after.encode()).decode() != token:
            raise ValueError(token)
        validate_adapter_id(after)
        return after
    except (ValueError, UnicodeDecodeError, InvalidRequestError):
        raise InvalidRequestError("not a token this store issued", "page_token") from None


class AdapterStoreService:
    """Implements loraplex.v1.AdapterStore over one Store."""

    def __init__(self, store: Store, chunk_bytes: int = 1 << 20) -> None:
        self._store = store
        self._chunk = chunk_bytes

    @_unary
    async def put(self, requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> pb.StoredAdapter:
        caller = _caller(context)
        deadline = CallDeadline(context.time_remaining())
        try:
            upload = await receive_upload(requests, self._store.max_adapter_bytes,
                                          lambda adapter_id: policy.check_write(caller, adapter_id, "upload"))
        except InvalidRequestError:  # a bad stream (id, sizes, checksums) is an invalid upload as a bad folder is
            self._store.metrics.uploads.labels("invalid").inc()
            raise
        record = await _until_caller_leaves(deadline, self._store.put, upload.adapter_id, upload.files,
                                            upload.public, upload.digests, deadline=deadline, fits=upload.fits)
        return record_to_pb(record)

    @_unary
    async def import_(self, request: Any, context: grpc.aio.ServicerContext) -> pb.StoredAdapter:
        """Import the adapter under an S3 prefix as a Put of ``adapter_id`` would store it."""
        caller = _caller(context)
        if isinstance(request, Undecodable):
            raise request.error()
        adapter_id = validate_adapter_id(request.adapter_id)
        policy.check_write(caller, adapter_id, "upload")
        if caller is not None and not caller.is_admin:
            raise PermissionDeniedError(f"tenant {caller.tenant!r} may not Import: it reads S3 with the store's "
                                        "credentials (admins only); upload the files instead")
        importer = self._store.importer
        if importer is None:
            raise InvalidRequestError(IMPORT_NEEDS_S3, "source")
        limit = min(request.max_bytes or self._store.max_adapter_bytes, self._store.max_adapter_bytes)
        deadline = CallDeadline(context.time_remaining())
        files = await _until_caller_leaves(deadline, importer.read, request.source, limit)
        fits = base_model_from_pb(request.base) if request.HasField("base") else None
        record = await _until_caller_leaves(deadline, self._store.put, adapter_id, files, request.public,
                                            deadline=deadline, fits=fits)
        return record_to_pb(record)

    async def _readable(self, caller: Principal | None, adapter_id: str) -> StoredRecord | None:
        """The record, when ``caller`` may read ``adapter_id`` only if it is public; else None.
        AdapterNotFoundError for a private one, as for a missing one (no existence leak)."""
        if not policy.reads_record(caller, adapter_id):
            return None
        try:
            record = await asyncio.to_thread(self._store.stat, adapter_id)
        except AdapterCorruptError:
            raise AdapterNotFoundError(adapter_id) from None  # whether it exists is not the caller's to know
        policy.check_read(caller, adapter_id, record.public)
        return record

    @_streaming
    async def get(self, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.StoreGetResponse]:
        caller = _caller(context)
        if isinstance(request, Undecodable):
            raise request.error()
        await self._readable(caller, request.adapter_id)  # before reading any bytes
        record, files = await asyncio.to_thread(self._store.fetch, request.adapter_id)
        policy.check_read(caller, record.adapter_id, record.public)  # it may have changed meanwhile
        yield pb.StoreGetResponse(record=record_to_pb(record))
        for entry in record.files:
            data = memoryview(files[entry.name])
            for start in range(0, len(data), self._chunk):
                yield pb.StoreGetResponse(chunk=bytes(data[start : start + self._chunk]))

    @_unary
    async def stat(self, request: Any, context: grpc.aio.ServicerContext) -> pb.StoredAdapter:
        caller = _caller(context)
        if isinstance(request, Undecodable):
            raise request.error()
        record = await self._readable(caller, request.adapter_id)
        if record is None:
            record = await asyncio.to_thread(self._store.stat, request.adapter_id)
        return record_to_pb(record)

    @_unary
    async def list(self, request: Any, context: grpc.aio.ServicerContext) -> pb.StoreListResponse:
        caller = _caller(context)
        if isinstance(request, Undecodable):
            raise request.error()
        prefix = _check_filter(request.tenant, request.prefix)
        size = min(request.page_size or DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE)
        after = _page_token(request.page_token)
        records = await asyncio.to_thread(self._visible_records, caller, prefix, after, size + 1)
        page = records[:size]
        more = len(records) > size
        token = base64.urlsafe_b64encode(page[-1].adapter_id.encode()).decode() if more else ""
        return pb.StoreListResponse(adapters=[record_to_pb(r) for r in page], next_page_token=token)

    def _visible_records(self, caller: Principal | None, prefix: str, after: str, limit: int) -> list[StoredRecord]:
        """Up to ``limit`` records after ``after`` that ``caller`` may list (the Store's pages, filtered)."""
        out: list[StoredRecord] = []
        while len(out) < limit:
            batch = self._store.list(prefix, after, limit)
            out.extend(r for r in batch if policy.can_read(caller, r.adapter_id, r.public))
            if len(batch) < limit:
                break
            after = batch[-1].adapter_id
        return out[:limit]

    @_unary
    async def delete(self, request: Any, context: grpc.aio.ServicerContext) -> pb.StoreDeleteResponse:
        caller = _caller(context)
        if isinstance(request, Undecodable):
            raise request.error()
        policy.check_write(caller, request.adapter_id, "delete")
        deadline = CallDeadline(context.time_remaining())
        record = await _until_caller_leaves(deadline, self._store.delete, request.adapter_id, deadline=deadline)
        return pb.StoreDeleteResponse(version=record.version)

    @_streaming
    async def watch(self, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.StoreWatchEvent]:
        caller = _caller(context)
        if caller is not None and not caller.is_admin:
            raise PermissionDeniedError(
                f"tenant {caller.tenant!r} may not Watch: the change feed names every tenant's adapters "
                "(it is for the inference server and admins)"
            )
        if isinstance(request, Undecodable):
            raise request.error()
        prefix = _check_filter(request.tenant, request.prefix)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[ChangeEvent] = asyncio.Queue(WATCH_QUEUE)
        unsubscribe = self._store.subscribe(lambda ev: loop.call_soon_threadsafe(_offer, queue, ev))
        try:
            while True:
                event = await queue.get()
                if event.kind == KIND_RESYNC or event.adapter_id.startswith(prefix):
                    yield event_to_pb(event)
        finally:
            unsubscribe()


async def _until_caller_leaves(until: CallDeadline, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn`` in a worker thread; if the call is cancelled (the client cancelled, or its deadline
    passed), ``until`` says so, and the write, which goes on in its thread, does not commit."""
    try:
        return await asyncio.to_thread(fn, *args, **kwargs)
    except asyncio.CancelledError:
        until.cancel()
        raise


def _caller(context: grpc.aio.ServicerContext) -> Principal | None:
    """The tenant the call is made for (adapter_store/auth.py), or None for the server's own."""
    return caller_of(context.invocation_metadata())


def _offer(queue: asyncio.Queue[ChangeEvent], event: ChangeEvent) -> None:
    """Queue an event; a watcher too slow to keep up gets one resync instead of the backlog."""
    try:
        queue.put_nowait(event)
    except asyncio.QueueFull:
        while not queue.empty():
            queue.get_nowait()
        queue.put_nowait(ChangeEvent(KIND_RESYNC))


def _lenient(message_type: Any) -> Callable[[bytes], Any]:
    return lenient(message_type.FromString, message_type.DESCRIPTOR.name)


def handler(service: AdapterStoreService) -> grpc.GenericRpcHandler:
    """The generic handler to add to a grpc.aio server (generated stubs talk to it unchanged)."""
    out = lambda m: m.SerializeToString()  # noqa: E731
    methods = {
        "Put": grpc.stream_unary_rpc_method_handler(service.put, _lenient(pb.StorePutRequest), out),
        "Import": grpc.unary_unary_rpc_method_handler(service.import_, _lenient(pb.StoreImportRequest), out),
        "Get": grpc.unary_stream_rpc_method_handler(service.get, _lenient(pb.StoreGetRequest), out),
        "Stat": grpc.unary_unary_rpc_method_handler(service.stat, _lenient(pb.StoreStatRequest), out),
        "List": grpc.unary_unary_rpc_method_handler(service.list, _lenient(pb.StoreListRequest), out),
        "Delete": grpc.unary_unary_rpc_method_handler(service.delete, _lenient(pb.StoreDeleteRequest), out),
        "Watch": grpc.unary_stream_rpc_method_handler(service.watch, _lenient(pb.StoreWatchRequest), out),
    }
    return grpc.method_handlers_generic_handler(SERVICE_NAME, methods)
