"""Reassemble a Put stream (metadata, then the files' bytes back to back) into {name: bytes},
with the one assembler (assembly.py).

The metadata declares every file and its size, so an upload over the limit is refused
before its bytes arrive, and a truncated or overlong stream is caught. Nothing is stored
here: the store validates the complete files and then commits them.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from loraplex.adapter_store.assembly import Assembly, AssemblyError, DeclaredFile, Fault
from loraplex.adapter_store.convert import base_model_from_pb
from loraplex.adapter_store.decoding import Undecodable
from loraplex.adapter_store.errors import AdapterValidationError, InvalidRequestError
from loraplex.adapter_store.format.base_shapes import HFBaseShapes
from loraplex.adapter_store.format.naming import validate_adapter_id
from loraplex.adapter_store.records import check_file_name
from loraplex.v1 import store_pb2 as pb

MAX_FILES = 8
_SHA256 = re.compile(r"^[0-9a-f]{64}\Z")


@dataclass(frozen=True, slots=True)
class ReceivedUpload:
    """A complete Put stream: the adapter id, its files, and whether it is to be public."""

    adapter_id: str
    files: dict[str, bytes]
    public: bool
    digests: dict[str, str]  # sha256 hex of each file, computed from the received bytes
    fits: tuple[HFBaseShapes, int] | None  # the uploading server's base model and rank cap, if it sent them


async def receive_upload(
    requests: AsyncIterator[object], max_bytes: int, check_id: Callable[[str], None] | None = None
) -> ReceivedUpload:
    """The upload in a Put stream; InvalidRequestError names what is wrong. ``check_id(adapter_id)``
    runs once the metadata is read, before any file bytes are taken (an authorization check)."""
    stream = aiter(requests)
    first = await anext(stream, None)
    meta = _metadata(first)
    adapter_id = validate_adapter_id(meta.adapter_id)
    if check_id is not None:
        check_id(adapter_id)
    assembly = Assembly(_declared_files(meta, max_bytes))  # grows as bytes arrive: a declaration takes none
    try:
        async for msg in stream:
            assembly.add(_chunk(msg))
        if assembly.received < assembly.total:
            raise AdapterValidationError(f"truncated upload: the stream ended after {assembly.received} of the "
                                         f"{assembly.total} declared bytes")
        files, digests = await asyncio.to_thread(assembly.finish)  # hashing 80 MB: not on the loop
    except AssemblyError as e:
        raise _refusal(e) from None
    fits = base_model_from_pb(meta.base) if meta.HasField("base") else None
    return ReceivedUpload(adapter_id, files, meta.public, digests, fits)


def _metadata(msg: object) -> pb.StorePutMetadata:
    if isinstance(msg, Undecodable):
        raise msg.error()
    if msg is None:
        raise InvalidRequestError("the upload stream is empty; send metadata first", "metadata")
    if not isinstance(msg, pb.StorePutRequest) or msg.WhichOneof("kind") != "metadata":
        raise InvalidRequestError("the first message must carry the metadata", "metadata")
    return msg.metadata


def _refusal(e: AssemblyError) -> AdapterValidationError:
    if e.fault is Fault.OVERLONG:
        return AdapterValidationError(f"the stream carries more bytes than the {e.declared} its metadata declares")
    return AdapterValidationError(f"{e.name}: its bytes do not match the declared sha256 (corrupted in transit?)")


def _declared_files(meta: pb.StorePutMetadata, max_bytes: int) -> list[DeclaredFile]:
    if not meta.files:
        raise InvalidRequestError("declare the files that follow (adapter_config.json, ...)", "metadata.files")
    if len(meta.files) > MAX_FILES:
        raise InvalidRequestError(f"at most {MAX_FILES} files", "metadata.files")
    out, seen = [], set()
    for f in meta.files:
        check_file_name(f.name)
        if f.name in seen:
            raise AdapterValidationError(f"file {f.name!r} is declared twice")
        if f.sha256 and not _SHA256.match(f.sha256):
            raise InvalidRequestError(f"{f.name}: sha256 must be 64 lowercase hex digits", "metadata.files.sha256")
        seen.add(f.name)
        out.append(DeclaredFile(f.name, f.size, f.sha256))
    total = sum(f.size for f in out)
    if total > max_bytes:
        raise AdapterValidationError(f"adapter is {total} bytes, over the store's limit of {max_bytes} bytes")
    return out


def _chunk(msg: object) -> bytes:
    if isinstance(msg, Undecodable):
        raise msg.error()
    if not isinstance(msg, pb.StorePutRequest) or msg.WhichOneof("kind") != "chunk":
        raise InvalidRequestError("after the metadata, every message must be a chunk", "chunk")
    return msg.chunk
