"""A Put to the store fed as an upload arrives (format.files.OpenPut): the inference server
passes each piece on instead of holding the whole adapter.

The call runs on gRPC's side of a small queue: ``send`` waits while ``DEPTH`` pieces are queued
(a slow store slows the upload, it does not grow this process) and raises the store's refusal as
soon as the store has answered (an adapter over the store's size limit is refused at its
metadata, before the rest is sent; ``on_answer`` tells when). ``commit`` ends the stream, which is when the store checks
and stores the files; ``abort`` cancels the call, and the store stores nothing. The call's
deadline (``timeout_s``; None: none) is the store's too: it never commits a write whose caller's
deadline passed, so a caller told the upload failed finds nothing stored later.
"""

from __future__ import annotations

import queue
from collections.abc import Callable, Iterator

import grpc

from loraplex.adapter_store.convert import record_from_pb
from loraplex.adapter_store.errors import LoraplexError, UnavailableError
from loraplex.adapter_store.format.files import AdapterInfo
from loraplex.adapter_store.records import StoredRecord
from loraplex.v1 import store_pb2 as pb

DEPTH = 4
PIECE_BYTES = 1 << 20  # pieces go on in messages of at most this many bytes
_END = None
_POLL_S = 0.1


class PutStream:
    """One Put call: ``metadata`` first, then what ``send`` is given."""

    def __init__(self, put: grpc.StreamUnaryMultiCallable, metadata: pb.StorePutMetadata, timeout_s: float | None,
                 error_from_rpc: Callable[[grpc.RpcError], LoraplexError]) -> None:
        self._queue: queue.Queue[bytes | None] = queue.Queue(maxsize=DEPTH)
        self._error_from_rpc = error_from_rpc
        self._future = put.future(self._requests(metadata), timeout=timeout_s)

    def _requests(self, metadata: pb.StorePutMetadata) -> Iterator[pb.StorePutRequest]:
        yield pb.StorePutRequest(metadata=metadata)
        while (piece := self._queue.get()) is not _END:
            yield pb.StorePutRequest(chunk=piece)

    def send(self, data: bytes) -> None:
        view = memoryview(data)
        for start in range(0, len(view), PIECE_BYTES):
            self._put(bytes(view[start : start + PIECE_BYTES]))

    def on_answer(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` (on a gRPC thread) once the store has answered."""
        self._future.add_done_callback(lambda _: callback())

    def check(self) -> None:
        """Raise the store's refusal if it has already answered (it answers early only to refuse)."""
        if self._future.done():
            self._raise_outcome()

    def _put(self, item: bytes | None) -> None:
        while True:
            self.check()
            try:
                self._queue.put(item, timeout=_POLL_S)
                return
            except queue.Full:
                continue

    def _raise_outcome(self) -> None:
        """The store answered before the stream ended: its refusal (it never succeeds early)."""
        self._answer()
        raise LoraplexError("the adapter store answered a Put before its stream ended")

    def _answer(self) -> pb.StoredAdapter:
        """The store's answer, or its refusal as a domain error (UnavailableError once aborted)."""
        try:
            return self._future.result()
        except grpc.FutureCancelledError:
            raise UnavailableError("the upload to the adapter store was abandoned; nothing was stored") from None
        except grpc.RpcError as e:
            raise self._error_from_rpc(e) from None

    def commit(self) -> AdapterInfo:
        return self.commit_record().info

    def commit_record(self) -> StoredRecord:
        """End the stream; the stored record once the store has checked and stored the files."""
        self._put(_END)
        return record_from_pb(self._answer())

    def abort(self) -> None:
        self._future.cancel()
        while True:  # free gRPC's request thread if it waits on the queue
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        try:
            self._queue.put_nowait(_END)
        except queue.Full:
            pass
