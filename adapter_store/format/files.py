"""An adapter's files as the store and the server hold them: its info (id, version,
checksum, shapes), the validated files, and ``AdapterSource``, the interface every place
adapters come from implements (the store client, the in-process store, a local directory)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from loraplex.adapter_store.assembly import DeclaredFile
from loraplex.adapter_store.format.base_shapes import HFBaseShapes
from loraplex.adapter_store.format.pattern_decisions import PatternValue
from loraplex.adapter_store.format.peft_format import CONFIG_FILE, WEIGHTS_FILE, AdapterSpec

ADAPTER_FILES = (CONFIG_FILE, WEIGHTS_FILE)


@dataclass(frozen=True, slots=True)
class AdapterInfo:
    adapter_id: str
    version: str  # content hash prefix: a re-upload with other bytes is a new version
    sha256: str  # of the weights file
    rank: int
    lora_alpha: float
    target_modules: tuple[str, ...]
    dtype: str
    size_bytes: int
    created_at: float
    # Other tenants may read it (docs/TENANTS.md); stored with the version, False when absent.
    public: bool = False
    # What the config's rank/alpha patterns decided at upload (AdapterSpec.pattern_values), so a
    # reader does not match them again; None: not kept (a record written before they were).
    pattern_values: tuple[PatternValue, ...] | None = None


@dataclass(frozen=True, slots=True)
class AdapterFiles:
    info: AdapterInfo
    spec: AdapterSpec
    files: Mapping[str, bytes]


@runtime_checkable
class AdapterSource(Protocol):
    """Resolves adapter ids to validated PEFT files; also the management surface.

    Capabilities some sources add, each its own Protocol below so a caller asks for it by name
    (``isinstance``) rather than by probing for a method: ``TenantScopedSource`` (the store
    sidecar, which holds calls to a tenant's rules), ``ChangeFollowedSource`` (a store whose
    change feed a server follows to drop stale resident copies), ``S3ImportingSource`` and
    ``StreamingPutSource`` (a store an upload streams into)."""

    def resolve(self, adapter_id: str) -> AdapterFiles: ...

    def get(self, adapter_id: str) -> AdapterInfo: ...

    def list(self) -> list[AdapterInfo]: ...

    def put(self, adapter_id: str, files: Mapping[str, bytes], public: bool = False) -> AdapterInfo: ...

    def delete(self, adapter_id: str) -> None: ...


@runtime_checkable
class TenantScopedSource(AdapterSource, Protocol):
    """A source that makes its calls on a named caller's behalf (the store sidecar applies the
    tenant rules to them as well)."""

    def for_caller(self, caller: object) -> AdapterSource: ...


@runtime_checkable
class ChangeFollowedSource(AdapterSource, Protocol):
    """A source with a change feed: ``watch()`` yields ``records.ChangeEvent``s (a resync first)
    until its ``cancel()`` is called or the source goes away."""

    def watch(self) -> Iterable[object]: ...



@runtime_checkable
class S3ImportingSource(AdapterSource, Protocol):
    """A source that imports an adapter from S3 itself (the store sidecar, with its own
    credentials), checked as an upload is and against the caller's base model (``base``, at
    most ``max_rank``) before anything is stored."""

    def import_adapter(self, adapter_id: str, source: str, max_bytes: int, base: HFBaseShapes,
                       max_rank: int) -> AdapterInfo: ...


class OpenPut(Protocol):
    """An upload on its way into a source: ``send`` the declared files' bytes back to back in
    declared order, then ``commit`` (the source checks them, against the caller's base model too,
    and stores them as one new version) or ``abort`` (it stores nothing). A source that refuses
    the upload before its end answers at once: ``on_answer(callback)`` runs ``callback`` (on any
    thread) when it has, and ``check`` (as ``send`` does) then raises its refusal."""

    def send(self, data: bytes) -> None: ...

    def on_answer(self, callback: Callable[[], None]) -> None: ...

    def check(self) -> None: ...

    def commit(self) -> AdapterInfo: ...

    def abort(self) -> None: ...


@runtime_checkable
class StreamingPutSource(AdapterSource, Protocol):
    """A source an upload streams into as it arrives (the store sidecar), so its uploader holds
    none of it; ``declared`` is the files in the order their bytes will be sent, ``timeout_s`` the
    uploader's own deadline (None: none), which the source holds the upload to as well."""

    def open_put(self, adapter_id: str, declared: Sequence[DeclaredFile], public: bool = False,
                 timeout_s: float | None = None) -> OpenPut: ...


def content_version(files: Mapping[str, bytes], weights_sha256: str | None = None) -> tuple[str, str]:
    """(version, sha256 of the weights): the version hashes config and weights together.
    ``weights_sha256``: the weights' digest when the caller already hashed these bytes."""
    weights_sha = weights_sha256 or hashlib.sha256(files[WEIGHTS_FILE]).hexdigest()
    version = hashlib.sha256(files[CONFIG_FILE] + weights_sha.encode()).hexdigest()[:16]
    return version, weights_sha


def make_info(
    adapter_id: str, files: Mapping[str, bytes], spec: AdapterSpec, created_at: float, public: bool = False,
    weights_sha256: str | None = None,
) -> AdapterInfo:
    version, sha = content_version(files, weights_sha256)
    return AdapterInfo(
        adapter_id=adapter_id,
        version=version,
        sha256=sha,
        rank=spec.rank,
        lora_alpha=spec.lora_alpha,
        target_modules=spec.target_modules,
        dtype=spec.dtype,
        size_bytes=spec.num_bytes,
        created_at=created_at,
        public=public,
        pattern_values=spec.pattern_values,
    )
