"""A TCP relay on a loopback port in front of one upstream service (S3, Redis, a gRPC server).

It makes "mid-transfer" a point a test can reach on purpose, not by sleeping: a ``Trap`` holds a
connection's bytes toward the upstream once a chosen byte pattern has gone through it (the start
of an S3 PUT of a blob, a Redis SET of a cached blob), and says so (``trap.hit``); the test then
kills a process, stalls another, and releases or drops the held bytes. ``pause()`` stalls every
connection (a service that accepts and never answers), ``cut()`` resets them all.
"""

from __future__ import annotations

import socket
import threading
from dataclasses import dataclass, field

READ_BYTES = 64 * 1024


@dataclass
class Trap:
    """Fires once, on the first connection whose bytes toward the upstream contain ``pattern``:
    the bytes up to the end of the pattern and ``extra`` more go through, the rest are held until
    ``release()`` (forwarded) or ``drop()`` (the connection is reset, the held bytes never sent)."""

    pattern: bytes
    extra: int = 0
    hit: threading.Event = field(default_factory=threading.Event)
    _decided: threading.Event = field(default_factory=threading.Event)
    _forward: bool = True

    def release(self) -> None:
        self._forward = True
        self._decided.set()

    def drop(self) -> None:
        self._forward = False
        self._decided.set()

    def wait_hit(self, timeout: float = 30.0) -> None:
        if not self.hit.wait(timeout):
            raise AssertionError(f"no connection sent {self.pattern!r} within {timeout}s")


class TcpRelay:
    """Relays 127.0.0.1:``port`` to 127.0.0.1:``upstream_port``, one thread per direction."""

    def __init__(self, upstream_port: int, name: str = "relay") -> None:
        self.upstream_port = upstream_port
        self.name = name
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._conns: list[tuple[socket.socket, socket.socket]] = []
        self._traps: list[Trap] = []
        self._running = threading.Event()  # cleared while paused
        self._running.set()
        self._closed = False
        threading.Thread(target=self._accept_forever, name=f"{name}-accept", daemon=True).start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def trap(self, pattern: bytes, extra: int = 0) -> Trap:
        """Arm a Trap (see its docstring) for the next connection that sends ``pattern``."""
        trap = Trap(pattern, extra)
        with self._lock:
            self._traps.append(trap)
        return trap

    def pause(self) -> None:
        """Stop moving bytes (both directions, every connection, new ones too) until resume()."""
        self._running.clear()

    def resume(self) -> None:
        self._running.set()

    def cut(self) -> None:
        """Reset every open connection (new ones are still accepted)."""
        with self._lock:
            conns, self._conns = self._conns, []
        for pair in conns:
            for s in pair:
                _reset(s)

    def close(self) -> None:
        self._closed = True
        self._running.set()
        for trap in list(self._traps):
            trap.drop()
        self._listener.close()
        self.cut()

    def _accept_forever(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.upstream_port), timeout=5)
                upstream.settimeout(None)
            except OSError:
                _reset(client)  # the upstream is down: so is the relayed service
                continue
            with self._lock:
                self._conns.append((client, upstream))
            threading.Thread(target=self._pump, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, toward_upstream: bool) -> None:
        tail = b""  # the last bytes seen, so a pattern split across two reads is still found
        try:
            while True:
                data = src.recv(READ_BYTES)
                if not data:
                    break
                self._running.wait()
                if toward_upstream:
                    data, tail = self._through_traps(data, tail, dst)
                    if data is None:
                        break
                if data:
                    dst.sendall(data)
        except OSError:
            pass
        _reset(dst)
        _reset(src)

    def _through_traps(self, data: bytes, tail: bytes, dst: socket.socket) -> tuple[bytes | None, bytes]:
        """Send what may go before an armed trap's hold point; wait at the point for the test.
        Returns the bytes still to send (None: drop the connection) and the new tail."""
        seen = tail + data
        with self._lock:
            trap = next((t for t in self._traps if t.pattern in seen), None)
            if trap is not None:
                self._traps.remove(trap)
        if trap is None:
            keep = max((len(t.pattern) for t in self._traps), default=1) - 1
            return data, seen[-keep:] if keep else b""
        cut = seen.index(trap.pattern) + len(trap.pattern) + trap.extra - len(tail)
        cut = max(0, min(cut, len(data)))
        dst.sendall(data[:cut])
        trap.hit.set()
        trap._decided.wait()
        if not trap._forward:
            return None, b""
        return data[cut:], b""


def _reset(s: socket.socket) -> None:
    """Close with a reset (SO_LINGER 0), as a killed peer's kernel would, not a polite FIN."""
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    except OSError:
        pass
    try:
        s.close()
    except OSError:
        pass
