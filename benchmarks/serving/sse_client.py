"""A minimal asyncio HTTP/1.1 client for one streamed POST: status, then the SSE ``data:`` payloads.

bench_open_loop.py measures the server, so the client's own cost per chunk should be about what the
raw gRPC stubs cost: one connection per request, the chunked transfer coding decoded by hand, no
client library (none is a dependency of the project either).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass


class HttpError(Exception):
    """A non-200 answer: its status and the start of its body."""

    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(f"HTTP {status}: {body[:200].decode(errors='replace')}")
        self.status = status


@dataclass(slots=True)
class Response:
    """An open response: its status, headers (lower-case names) and the stream to read its body from."""

    status: int
    headers: dict[str, str]
    reader: asyncio.StreamReader

    @property
    def chunked(self) -> bool:
        return self.headers.get("transfer-encoding", "").lower() == "chunked"

    async def body_parts(self) -> AsyncIterator[bytes]:
        """The body as it arrives: chunks of the chunked coding, Content-Length bytes, or to EOF."""
        if self.chunked:
            while True:
                size = int((await self.reader.readline()).split(b";")[0].strip(), 16)
                if size == 0:
                    await self.reader.readline()  # the empty trailer
                    return
                yield await self.reader.readexactly(size)
                await self.reader.readexactly(2)  # CRLF after the chunk
        elif "content-length" in self.headers:
            yield await self.reader.readexactly(int(self.headers["content-length"]))
        else:
            while data := await self.reader.read(65536):
                yield data

    async def body(self) -> bytes:
        return b"".join([part async for part in self.body_parts()])

    async def sse_data(self) -> AsyncIterator[bytes]:
        """Each event's ``data:`` payload, as soon as its blank line has arrived."""
        buffer = b""
        async for part in self.body_parts():
            buffer += part
            while b"\n\n" in buffer:
                event, buffer = buffer.split(b"\n\n", 1)
                for line in event.split(b"\n"):
                    if line.startswith(b"data: "):
                        yield line[6:]


async def post_json(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, path: str, obj: dict) -> Response:
    """Send ``obj`` as a JSON POST on an open connection; the response once its headers are in.
    A status other than 200 raises HttpError (its body read)."""
    body = json.dumps(obj, separators=(",", ":")).encode()
    writer.write(b"POST %s HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Accept: text/event-stream\r\nContent-Length: %d\r\n\r\n%s" % (path.encode(), len(body), body))
    await writer.drain()
    status_line = await reader.readline()
    if not status_line:
        raise ConnectionError("the server closed the connection before answering")
    status = int(status_line.split()[1])
    headers = {}
    while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    response = Response(status, headers, reader)
    if status != 200:
        raise HttpError(status, await response.body())
    return response
