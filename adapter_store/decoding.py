"""Request bodies that do not parse: gRPC's default decoding answers UNKNOWN ("Unexpected
DecodeError") and logs a traceback before any handler or interceptor code runs, so anyone could
fill the log without a token. ``lenient`` decodes to an ``Undecodable`` marker instead, which the
authentication wrapper turns into INVALID_ARGUMENT once the caller is known (the adapter store's
handlers use the same markers)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from google.protobuf.message import DecodeError

from loraplex.adapter_store.errors import InvalidRequestError


@dataclass(frozen=True, slots=True)
class Undecodable:
    """Stands in for a request message that did not parse."""

    detail: str
    message_type: str = "message"

    def error(self) -> InvalidRequestError:
        return InvalidRequestError(f"the request is not a valid {self.message_type} ({self.detail}); adapter ids, "
                                   "file names and other strings must be valid UTF-8")


def lenient(deserializer: Callable[[bytes], Any] | None, message_type: str = "message"
            ) -> Callable[[bytes], Any] | None:
    """``deserializer``, with a body that does not parse decoded to ``Undecodable``."""
    if deserializer is None:
        return None

    def deserialize(raw: bytes) -> Any:
        try:
            return deserializer(raw)
        except DecodeError as e:
            return Undecodable(str(e), message_type)

    return deserialize


def checked(request: Any) -> Any:
    """The request, or for a request stream a stream of them; an Undecodable one raises
    InvalidRequestError (where the stream reaches it)."""
    if isinstance(request, Undecodable):
        raise request.error()
    if hasattr(request, "__aiter__"):
        return _checked_stream(request)
    return request


async def _checked_stream(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
    async for request in requests:
        if isinstance(request, Undecodable):
            raise request.error()
        yield request
