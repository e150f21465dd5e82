"""Read an UploadAdapter client stream, enforcing limits, with the one assembler
(adapter_store/assembly.py): this file reads the protocol and words its faults.

The metadata message comes first and declares every file and its size, so an upload over
the size limit is refused before its bytes arrive, and a truncated upload is detected.
The bytes are either kept and handed over whole (``finish``: for a local adapter directory) or,
after ``relay()``, returned by ``add`` in declared order as they arrive, for the caller to pass on
to the adapter store (``finish_relayed``). Nothing is stored here: the adapter source validates
the files and publishes them atomically.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TypeVar

from loraplex.adapter_store.assembly import Assembly, AssemblyError, DeclaredFile, Fault, Relay
from loraplex.adapter_store.errors import InvalidRequestError, ResourceExhaustedError
from loraplex.adapter_store.format.files import OpenPut
from loraplex.inference_server.server.convert import adapter_id_from_pb
from loraplex.v1 import inference_pb2 as pb

MAX_FILE_NAME_LEN = 128
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class UploadLimits:
    max_upload_bytes: int
    max_files: int = 8

    def __post_init__(self) -> None:
        if self.max_upload_bytes < 1:
            raise ValueError(f"max_upload_bytes must be >= 1, got {self.max_upload_bytes}")
        if self.max_files < 1:
            raise ValueError(f"max_files must be >= 1, got {self.max_files}")


def _check_file_name(name: str) -> None:
    if not name or len(name) > MAX_FILE_NAME_LEN or name.startswith(".") or "/" in name or "\\" in name \
            or "\x00" in name:
        raise InvalidRequestError(f"{name!r} must be a plain file name (no folders, not hidden)",
                                  "metadata.files.name")


class UploadAssembler:
    """Feed it the stream's messages with ``add``, then call ``finish``."""

    def __init__(self, limits: UploadLimits) -> None:
        self._limits = limits
        self._adapter_id: str | None = None
        self._public = False
        self._assembly: Assembly | Relay | None = None

    @property
    def adapter_id(self) -> str | None:
        return self._adapter_id

    @property
    def received_bytes(self) -> int:
        return 0 if self._assembly is None else self._assembly.received

    @property
    def declared(self) -> tuple[DeclaredFile, ...]:
        """The files the metadata declared, in its order (empty before the metadata)."""
        return () if self._assembly is None else self._assembly.declared

    @property
    def declared_bytes(self) -> int:
        return sum(f.size for f in self.declared)

    def relay(self) -> None:
        """From now on ``add`` returns the bytes to pass on instead of keeping them (call it
        between the metadata and the first chunk)."""
        if self._assembly is None or self._assembly.received:
            raise RuntimeError("relay() goes between the metadata and the first byte")
        self._assembly = Relay(self._assembly.declared)

    @property
    def public(self) -> bool:
        """Whether the metadata asked for the adapter to be readable by every tenant."""
        return self._public

    def add(self, msg: pb.UploadAdapterRequest) -> list[bytes]:
        """Take one message (relaying: the bytes now ready to pass on, in declared order); raises
        InvalidRequestError / ResourceExhaustedError on a bad one."""
        part = msg.WhichOneof("part")
        if part == "metadata":
            self._metadata(msg.metadata)
            return []
        elif part == "chunk":
            return self._chunk(msg.chunk)
        else:
            raise InvalidRequestError("message carries neither metadata nor chunk", "part")

    def _metadata(self, meta: pb.UploadMetadata) -> None:
        if self._adapter_id is not None:
            raise InvalidRequestError("sent twice; send it once, first", "metadata")
        adapter_id = adapter_id_from_pb(meta.adapter_id, "metadata.adapter_id")
        if adapter_id is None:
            raise InvalidRequestError("must be non-empty", "metadata.adapter_id")
        if not meta.files:
            raise InvalidRequestError("declare at least one file", "metadata.files")
        if len(meta.files) > self._limits.max_files:
            raise InvalidRequestError(f"at most {self._limits.max_files} files", "metadata.files")
        declared: dict[str, DeclaredFile] = {}
        for f in meta.files:
            _check_file_name(f.name)
            if f.name in declared:
                raise InvalidRequestError(f"{f.name!r} is declared twice", "metadata.files")
            if f.sha256 and (len(f.sha256) != 64 or any(c not in "0123456789abcdef" for c in f.sha256.lower())):
                raise InvalidRequestError(f"{f.name!r}: not a hex sha256 digest", "metadata.files.sha256")
            declared[f.name] = DeclaredFile(f.name, f.size_bytes, f.sha256.lower())
        total = sum(f.size for f in declared.values())
        if total > self._limits.max_upload_bytes:
            raise ResourceExhaustedError(
                f"upload of {total} bytes is over this server's limit of {self._limits.max_upload_bytes} bytes"
            )
        self._public = meta.public
        self._adapter_id = adapter_id
        self._assembly = Assembly(list(declared.values()))

    def _chunk(self, chunk: pb.FileChunk) -> list[bytes]:
        if self._assembly is None:
            raise InvalidRequestError("the first message must carry the metadata", "metadata")
        try:
            ready = self._assembly.add(chunk.data, chunk.name)
        except AssemblyError as e:
            raise _refusal(e) from None
        return ready if isinstance(self._assembly, Relay) else []

    @property
    def complete(self) -> bool:
        """Whether the metadata and every declared byte have arrived."""
        return self._assembly is not None and self._assembly.complete

    def finish(self) -> tuple[str, dict[str, bytes]]:
        """(adapter_id, files) once every declared byte has arrived and every checksum matches."""
        adapter_id, assembly = self._started()
        if not isinstance(assembly, Assembly):
            raise RuntimeError("a relayed upload ends with finish_relayed()")
        try:
            files, _ = assembly.finish()
        except AssemblyError as e:
            raise _refusal(e) from None
        return adapter_id, files

    def finish_relayed(self) -> str:
        """The adapter id once every declared byte has been passed on and every checksum matches."""
        adapter_id, relay = self._started()
        if not isinstance(relay, Relay):
            raise RuntimeError("finish_relayed() ends a relayed upload")
        try:
            relay.finish()
        except AssemblyError as e:
            raise _refusal(e) from None
        return adapter_id

    def _started(self) -> tuple[str, Assembly | Relay]:
        if self._adapter_id is None or self._assembly is None:
            raise InvalidRequestError("the upload stream was empty; send the metadata first", "metadata")
        return self._adapter_id, self._assembly


def _refusal(e: AssemblyError) -> InvalidRequestError:
    """An assembly fault in this API's words and fields."""
    if e.fault is Fault.UNDECLARED:
        return InvalidRequestError(f"{e.name!r} was not declared in the metadata", "chunk.name")
    if e.fault is Fault.OVERLONG:
        return InvalidRequestError(f"{e.name!r}: more bytes than the declared size of {e.declared}", "chunk.data")
    if e.fault is Fault.TRUNCATED:
        return InvalidRequestError(f"{e.name!r}: received {e.got} of {e.declared} declared bytes (upload incomplete)",
                                   "metadata.files.size_bytes")
    return InvalidRequestError(f"{e.name!r}: sha256 does not match the received bytes", "metadata.files.sha256")


async def until_refused(messages: AsyncIterator[T], put: OpenPut) -> AsyncIterator[T]:
    """``messages`` until they end, or the store's refusal as soon as it answers (before the end
    it answers only to refuse: a client still sending learns it now, not after its last byte)."""
    loop = asyncio.get_running_loop()
    answered = asyncio.Event()

    def wake() -> None:
        try:
            loop.call_soon_threadsafe(answered.set)
        except RuntimeError:
            pass  # the loop has closed (the server stopped); no one waits

    put.on_answer(wake)
    refusal = asyncio.ensure_future(answered.wait())
    try:
        while True:
            following = asyncio.ensure_future(anext(messages, None))
            await asyncio.wait((following, refusal), return_when=asyncio.FIRST_COMPLETED)
            if not following.done():
                following.cancel()
                put.check()
            message = await following
            if message is None:
                return
            yield message
    finally:
        refusal.cancel()


def pass_on(assembler: UploadAssembler, message: pb.UploadAdapterRequest, put: OpenPut) -> None:
    """One message of a relayed upload: checked, and its bytes sent on in declared order."""
    for piece in assembler.add(message):
        put.send(piece)
