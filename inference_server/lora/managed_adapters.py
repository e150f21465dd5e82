"""The adapter source as the server sees it: validated against the base model, and every
change invalidates the resident copy in the pool (running requests finish on the old one)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from loraplex.adapter_store.assembly import DeclaredFile
from loraplex.adapter_store.errors import InvalidRequestError
from loraplex.adapter_store.format.base_shapes import HFBaseShapes
from loraplex.adapter_store.format.files import (AdapterFiles, AdapterInfo, AdapterSource, ChangeFollowedSource,
                                                 OpenPut, S3ImportingSource, StreamingPutSource,
                                                 TenantScopedSource)
from loraplex.adapter_store.format.naming import validate_adapter_id
from loraplex.adapter_store.format.peft_format import parse_adapter_files
from loraplex.adapter_store.format.upload_head import UploadHead
from loraplex.inference_server.lora.folder_watcher import FolderWatcher
from loraplex.inference_server.lora.local_directory import LocalAdapterDirectory
from loraplex.inference_server.lora.pool.adapter_pool import AdapterPool
from loraplex.inference_server.model.config import ModelConfig

S3_NEEDS_STORE = ("s3:// paths are imported by the adapter store sidecar, with its S3 credentials; this server "
                  "keeps its adapters in a local directory and reads no S3: start it with --adapter-store HOST:PORT "
                  "(a loraplex-store with an S3 blob backend)")


class ManagedAdapters:
    def __init__(self, source: AdapterSource, manager: AdapterPool, base: ModelConfig, max_rank: int) -> None:
        self.source = source
        self._manager = manager
        self._base = base
        self._max_rank = max_rank
        self._watcher = None

    def for_caller(self, caller: object) -> ManagedAdapters:
        """These adapters with the source's calls made for ``caller`` where the source can name
        one (the store sidecar: it then holds them to the tenant rules as well); else self."""
        if not isinstance(self.source, TenantScopedSource):
            return self
        return ManagedAdapters(self.source.for_caller(caller), self._manager, self._base, self._max_rank)

    def start_watching(self) -> None:
        """Follow the adapter store's change feed (when the source is a store), or a local
        directory's folders (edited by hand): a replaced or deleted adapter is dropped from every
        tier here, whichever replica or hand changed it."""
        if self._watcher is not None:
            return
        if isinstance(self.source, ChangeFollowedSource):
            from loraplex.adapter_store.watcher import StoreWatcher  # noqa: PLC0415  (only with a store)

            self._watcher = StoreWatcher(self.source, self._manager.held_versions, self._manager.invalidate).start()
        elif isinstance(self.source, LocalAdapterDirectory):
            self._watcher = FolderWatcher(self.source, self._manager.held_versions, self._manager.invalidate).start()

    def stop_watching(self) -> None:
        if self._watcher is not None:
            self._watcher.stop()
            self._watcher = None

    def resolve(self, adapter_id: str) -> AdapterFiles:
        return self.source.resolve(validate_adapter_id(adapter_id))

    def get(self, adapter_id: str) -> AdapterInfo:
        return self.source.get(validate_adapter_id(adapter_id))

    def list(self) -> list[AdapterInfo]:
        return self.source.list()

    def put(self, adapter_id: str, files: Mapping[str, bytes], public: bool = False) -> AdapterInfo:
        """Validate against the base model, store atomically (with its ``public`` flag), drop any
        resident old version. The check is the adapter store's where there is one (its client
        sends this server's base with the files: one parse, there), else here."""
        validate_adapter_id(adapter_id)
        if not isinstance(self.source, StreamingPutSource):
            self._manager.fitting_layout(adapter_id, parse_adapter_files(files, self._base, self._max_rank))
        info = self.source.put(adapter_id, files, public)
        self._manager.invalidate(adapter_id)
        return info

    def open_put(self, adapter_id: str, declared: Sequence[DeclaredFile], public: bool = False,
                 timeout_s: float | None = None) -> OpenPut | None:
        """The upload streamed into the source as its bytes arrive, when the source takes streams
        (the store sidecar); None when the source needs the whole adapter (``put``). This server
        checks the upload's head against its base model as it passes (the config and the weights'
        header: a misfit is refused before its weights are sent); the store parses the whole of it
        against the same base, which its client sends with the files. ``timeout_s``: the uploading
        client's deadline, which the store then holds the write to. Its commit drops any resident
        old version."""
        if not isinstance(self.source, StreamingPutSource):
            return None
        head = UploadHead(declared, self._base, self._max_rank)  # refuses bad names now
        put = self.source.open_put(validate_adapter_id(adapter_id), declared, public, timeout_s)
        return _CheckedPut(put, head, lambda: self._manager.invalidate(adapter_id))

    def import_s3(self, adapter_id: str, source: str, max_bytes: int) -> AdapterInfo:
        """Have the adapter store import ``source`` (``s3://bucket/prefix``) as ``adapter_id``:
        the store reads it with its own S3 client and checks it as an upload and against this
        server's base model and rank cap, all before it stores anything (a misfit replaces no
        version already there). Without a store (a local adapter directory) InvalidRequestError naming ``source``:
        this process reads no S3."""
        if not isinstance(self.source, S3ImportingSource):
            raise InvalidRequestError(S3_NEEDS_STORE, "source")
        base = HFBaseShapes(self._base.model_type, self._base.dims)
        info = self.source.import_adapter(validate_adapter_id(adapter_id), source, max_bytes, base, self._max_rank)
        self._manager.invalidate(adapter_id)
        return info

    def delete(self, adapter_id: str) -> None:
        """Delete it at its source and drop any copy held here, even when the source's answer is an
        error: not found (another delete, or one finished by the store after a crash), or an outcome
        unknown (the copy is fetched again if the adapter is still there)."""
        validate_adapter_id(adapter_id)
        try:
            self.source.delete(adapter_id)
        finally:
            self._manager.invalidate(adapter_id)

    def resident_ids(self) -> list[str]:
        return self._manager.resident_ids()

    def files(self, adapter_id: str) -> Mapping[str, bytes]:
        """A stored adapter's files, as uploaded."""
        return self.resolve(adapter_id).files

    def load(self, adapter_id: str) -> None:
        """Bring it into the device pool now (it stays there, LRU, until evicted or deleted)."""
        self._manager.release(self._manager.acquire(validate_adapter_id(adapter_id)))

    def residency(self) -> dict[str, tuple[bool, bool]]:
        """{adapter id: (in the device pool, in the host tier)} for every held adapter."""
        device = set(self._manager.resident_ids())
        host = set(self._manager.host.versions())
        return {i: (i in device, i in host) for i in device | host}


class _CheckedPut:
    """An OpenPut whose bytes pass the upload's head check on their way, and whose commit drops
    the adapter's resident old version."""

    def __init__(self, put: OpenPut, head: UploadHead, invalidate: Callable[[], None]) -> None:
        self._put = put
        self._head = head
        self._invalidate = invalidate

    def send(self, data: bytes) -> None:
        self._head.feed(data)
        self._put.send(data)

    def on_answer(self, callback: Callable[[], None]) -> None:
        self._put.on_answer(callback)

    def check(self) -> None:
        self._put.check()

    def commit(self) -> AdapterInfo:
        info = self._put.commit()
        self._invalidate()
        return info

    def abort(self) -> None:
        self._put.abort()
