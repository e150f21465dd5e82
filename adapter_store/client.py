"""The inference server's AdapterSource backed by the store sidecar over gRPC.

``StoreClient(target)`` implements loraplex.adapter_store.format.files.AdapterSource: resolve,
get, list, put and delete go to the store; ``watch`` follows its changes. Every file is
checked against the sha256 the store sent (end to end) and parsed before it is returned.
Idempotent calls (Get, Stat, List) are retried on UNAVAILABLE with a short backoff.

With ``cache`` (the store's Redis blob cache, e.g. ``RedisBlobCache(connect(...), ns, 0)``)
a resolve asks the store only for the record (Stat) and reads a cached blob straight from
Redis, skipping the copy through the sidecar; a miss, a checksum failure or an unreachable
Redis falls back to the store's Get.

With ``caller`` (a Principal) every call is made for that tenant and the store holds it to the
tenant rules (adapter_store/auth.py); without it the calls are the inference server's own.
"""

from __future__ import annotations

import copy
import hashlib
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TypeVar

import grpc

from loraplex.adapter_store.assembly import DeclaredFile
from loraplex.adapter_store.backends.base import BlobCache
from loraplex.adapter_store.convert import base_model_to_pb, event_from_pb, record_from_pb
from loraplex.adapter_store.errors import (
    FIELD_METADATA_KEY,
    AdapterCorruptError,
    AdapterNotFoundError,
    AdapterValidationError,
    BackendUnavailable,
    InvalidRequestError,
    LoraplexError,
    PermissionDeniedError,
    ResourceExhaustedError,
    StoreRefusedError,
    UnavailableError,
)
from loraplex.adapter_store.format.base_shapes import BaseShapes, HFBaseShapes
from loraplex.adapter_store.format.files import AdapterFiles, AdapterInfo
from loraplex.adapter_store.format.peft_format import parse_adapter_files
from loraplex.adapter_store.protocol import MAX_MESSAGE_BYTES
from loraplex.adapter_store.put_stream import PIECE_BYTES, PutStream
from loraplex.adapter_store.records import ChangeEvent, StoredRecord
from loraplex.adapter_store.secret import with_secret
from loraplex.adapter_store.tenants.principal import Principal
from loraplex.v1 import store_pb2 as pb, store_pb2_grpc

T = TypeVar("T")
# What to do when the store refuses the server's calls (its --secret-file and ours differ).
SECRET_FIX = ("the inference server's --adapter-store-secret-file (LORAPLEX_ADAPTER_STORE_SECRET_FILE) must hold the "
              "secret of the store's --secret-file")


def error_from_rpc(e: grpc.RpcError, adapter_id: str = "") -> LoraplexError:
    """The domain error for a failed store call (so the server's interceptor maps it again)."""
    code, details = e.code(), e.details() or ""
    field = dict(e.trailing_metadata() or ()).get(FIELD_METADATA_KEY)
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        if field:
            message = details.removeprefix(f"{field}: ")
            return InvalidRequestError(message, field)
        return AdapterValidationError(details)
    if code == grpc.StatusCode.NOT_FOUND:
        return AdapterNotFoundError(adapter_id) if adapter_id else LoraplexError(details)
    if code == grpc.StatusCode.DATA_LOSS:
        return AdapterCorruptError(details)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return ResourceExhaustedError(details)
    if code == grpc.StatusCode.PERMISSION_DENIED:
        return PermissionDeniedError(details)
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return StoreRefusedError(f"the adapter store refuses this server's calls (UNAUTHENTICATED: {details}): "
                                 f"{SECRET_FIX}")
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return UnavailableError(f"adapter store: {details}")
    return LoraplexError(f"adapter store call failed ({code.name}): {details}")


class StoreClient:
    """AdapterSource over a running store (``target`` like "127.0.0.1:50061"); ``secret`` is the
    store's shared secret, sent with every call, and ``caller`` the tenant the calls are made
    for, if any (adapter_store/auth.py)."""

    def __init__(
        self,
        target: str,
        *,
        base: BaseShapes | None = None,
        max_rank: int = 128,
        timeout_s: float = 60.0,
        retries: int = 3,
        cache: BlobCache | None = None,
        secret: str | None = None,
        caller: Principal | None = None,
    ) -> None:
        options = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)]
        self._channel = grpc.insecure_channel(target, options=options)
        self._stub = store_pb2_grpc.AdapterStoreStub(with_secret(self._channel, secret, caller))
        self._secret = secret
        self._base = base
        self._max_rank = max_rank
        self._timeout = timeout_s
        self._retries = retries
        self._cache = cache

    def for_caller(self, caller: Principal) -> StoreClient:
        """This client with its calls made for ``caller`` (same channel, settings and cache), so
        the store holds them to that tenant's rules too. It shares the channel: close this
        client, not the view."""
        view = copy.copy(self)
        view._stub = store_pb2_grpc.AdapterStoreStub(with_secret(self._channel, self._secret, caller))
        return view

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "StoreClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, fn: Callable[[], T], adapter_id: str = "", idempotent: bool = True) -> T:
        attempts = self._retries + 1 if idempotent else 1
        for attempt in range(attempts):
            try:
                return fn()
            except grpc.RpcError as e:
                if attempt + 1 < attempts and e.code() == grpc.StatusCode.UNAVAILABLE:
                    time.sleep(0.1 * 2**attempt)
                    continue
                raise error_from_rpc(e, adapter_id) from None
        raise ValueError(f"retries must be >= 0, got {self._retries}")

    def check_access(self, timeout_s: float = 5.0) -> None:
        """Return once the store answers and accepts this client's secret (one List call of one
        record, not retried); StoreRefusedError when it refuses the secret (waiting will not
        help), UnavailableError when it does not answer."""
        try:
            self._stub.List(pb.StoreListRequest(page_size=1), timeout=timeout_s)
        except grpc.RpcError as e:
            raise error_from_rpc(e) from None

    # ---------------------------------------------------------------- AdapterSource

    def resolve(self, adapter_id: str) -> AdapterFiles:
        """The current version's files, checked end to end and parsed (its patterns as the store
        decided them at upload)."""
        record, files = self.fetch(adapter_id)
        spec = parse_adapter_files(files, self._base, self._max_rank, record.info.pattern_values)
        return AdapterFiles(record.info, spec, files)

    def get(self, adapter_id: str) -> AdapterInfo:
        return self.stat(adapter_id).info

    def list(self) -> list[AdapterInfo]:
        return [r.info for r in self.iter_records()]

    def put(self, adapter_id: str, files: Mapping[str, bytes], public: bool = False) -> AdapterInfo:
        return self.put_record(adapter_id, files, public=public).info

    def delete(self, adapter_id: str) -> None:
        self._call(
            lambda: self._stub.Delete(pb.StoreDeleteRequest(adapter_id=adapter_id), timeout=self._timeout),
            adapter_id, idempotent=False,
        )

    # ---------------------------------------------------------------- the rest of the store API

    def stat(self, adapter_id: str) -> StoredRecord:
        msg = self._call(lambda: self._stub.Stat(pb.StoreStatRequest(adapter_id=adapter_id), timeout=self._timeout),
                         adapter_id)
        return record_from_pb(msg)

    def list_page(
        self, tenant: str = "", prefix: str = "", page_size: int = 0, page_token: str = ""
    ) -> tuple[list[StoredRecord], str]:
        """One page of records and the next page's token ("" after the last page)."""
        request = pb.StoreListRequest(tenant=tenant, prefix=prefix, page_size=page_size, page_token=page_token)
        msg = self._call(lambda: self._stub.List(request, timeout=self._timeout))
        return [record_from_pb(a) for a in msg.adapters], msg.next_page_token

    def iter_records(self, tenant: str = "", prefix: str = "", page_size: int = 0) -> Iterator[StoredRecord]:
        token = ""
        while True:
            page, token = self.list_page(tenant, prefix, page_size, token)
            yield from page
            if not token:
                return

    def put_record(
        self, adapter_id: str, files: Mapping[str, bytes], progress: Callable[[int, int], None] | None = None,
        public: bool = False,
    ) -> StoredRecord:
        """Upload ``files`` (readable by every tenant when ``public``); ``progress(sent, total)``
        is called as chunks go out."""
        names = sorted(files)
        total = sum(len(files[n]) for n in names)
        put = self.open_put(adapter_id, [DeclaredFile(n, len(files[n]), hashlib.sha256(files[n]).hexdigest())
                                         for n in names], public, self._timeout)
        try:
            sent = 0
            for n in names:
                data = memoryview(files[n])
                for start in range(0, len(data), PIECE_BYTES):
                    piece = data[start : start + PIECE_BYTES]
                    put.send(piece)
                    sent += len(piece)
                    if progress is not None:
                        progress(sent, total)
            return put.commit_record()
        except BaseException:
            put.abort()
            raise

    def open_put(self, adapter_id: str, declared: Sequence[DeclaredFile], public: bool = False,
                 timeout_s: float | None = None) -> PutStream:
        """format.files.StreamingPutSource: a Put whose bytes are sent as they come (in
        ``declared`` order), within ``timeout_s`` (None: no deadline). With a ``base``, it travels in the metadata and the store checks the
        files against it in its one parse, so a sidecar that does not know the base model still
        never stores an adapter that does not fit it (nothing is parsed here: the store is the
        durable gate)."""
        base = None if self._base is None else base_model_to_pb(self._base, self._max_rank)
        meta = pb.StorePutMetadata(adapter_id=adapter_id, public=public, base=base, files=[
            pb.StoredFile(name=f.name, size=f.size, sha256=f.sha256) for f in declared])
        return PutStream(self._stub.Put, meta, timeout_s, lambda e: error_from_rpc(e, adapter_id))

    def import_record(self, adapter_id: str, source: str, public: bool = False, max_bytes: int = 0,
                      base: HFBaseShapes | None = None, max_rank: int = 0) -> StoredRecord:
        """Have the store import the adapter under ``source`` (``s3://bucket/prefix``) as
        ``adapter_id``, read with the store's S3 client and checked as a Put is (``max_bytes``: a
        lower size limit than the store's own; 0 = the store's). ``base``: the caller's base
        model, which the files must fit too (ranks up to ``max_rank``), checked before anything
        is stored."""
        request = pb.StoreImportRequest(adapter_id=adapter_id, source=source, public=public, max_bytes=max_bytes,
                                        base=None if base is None else base_model_to_pb(base, max_rank))
        msg = self._call(lambda: self._stub.Import(request, timeout=self._timeout), adapter_id, idempotent=False)
        return record_from_pb(msg)

    def import_adapter(self, adapter_id: str, source: str, max_bytes: int, base: HFBaseShapes,
                       max_rank: int) -> AdapterInfo:
        """format.files.S3ImportingSource: ``import_record``'s info (private)."""
        return self.import_record(adapter_id, source, False, max_bytes, base, max_rank).info

    def fetch(self, adapter_id: str) -> tuple[StoredRecord, dict[str, bytes]]:
        """The current record and its files (checked end to end), without parsing them."""
        if self._cache is not None:
            hit = self._from_cache(adapter_id)
            if hit is not None:
                return hit
        return self._call(lambda: self._download(adapter_id), adapter_id)

    def _from_cache(self, adapter_id: str) -> tuple[StoredRecord, dict[str, bytes]] | None:
        record = self.stat(adapter_id)
        try:
            pieces = self._cache.pieces(record.blob_key)
            return (record, record.unpack_pieces(pieces)) if pieces is not None else None
        except (BackendUnavailable, AdapterCorruptError):
            return None  # the store's Get reads the blob store (and repairs the cache)

    def _download(self, adapter_id: str) -> tuple[StoredRecord, dict[str, bytes]]:
        stream = self._stub.Get(pb.StoreGetRequest(adapter_id=adapter_id), timeout=self._timeout)
        first = next(stream, None)
        if first is None or first.WhichOneof("kind") != "record":
            raise AdapterCorruptError(f"adapter store sent no record for {adapter_id!r}")
        record = record_from_pb(first.record)
        return record, record.unpack_pieces(msg.chunk for msg in stream)  # hashed as the chunks arrive

    def watch(self, tenant: str = "", prefix: str = "") -> "Watch":
        """Follow changes; iterate the result, ``cancel()`` it to stop."""
        call = self._stub.Watch(pb.StoreWatchRequest(tenant=tenant, prefix=prefix))
        return Watch(call)


class Watch:
    """An iterator of ChangeEvents from a Watch call; ends when cancelled or the store goes away."""

    def __init__(self, call: grpc.Call) -> None:
        self._call = call

    def __iter__(self) -> Iterator[ChangeEvent]:
        try:
            for msg in self._call:
                yield event_from_pb(msg)
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.CANCELLED:
                raise error_from_rpc(e) from None

    def cancel(self) -> None:
        self._call.cancel()
