"""A real server process for hostile-client tests (tests/edge/test_hostile_clients.py,
tests/edge/test_bounded_connections.py), its metrics read over its HTTP port, and raw-socket helpers."""

from __future__ import annotations

import http.client
import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from server_helpers import free_port
from server_process import start_server, stop


@dataclass
class Served:
    """A running server process: its addresses, its log and its base model's id."""

    address: str  # gRPC
    port: int  # HTTP
    log: Path
    base: str  # the base model's id

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"


def get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    """(status, body) of a GET."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def wait_until_serving(proc, port: int, log: Path, timeout: float = 180.0) -> None:
    """Wait for the HTTP port's /health to answer 200."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if get(f"http://127.0.0.1:{port}/health", timeout=2)[0] == 200:
                return
        except OSError:
            pass  # not listening yet
        assert proc.poll() is None, log.read_text()
        assert time.monotonic() < deadline, "the server did not start serving in time"
        time.sleep(0.05)


def serve(model_dir: Path, tmp: Path, *flags: str) -> Iterator[Served]:
    """A server process on ``model_dir`` with its HTTP port and ``flags``, once it serves (for
    a fixture: ``yield from serve(...)``)."""
    port = free_port()
    proc, address = start_server(model_dir, tmp, "--http-port", str(port), *flags)
    try:
        wait_until_serving(proc, port, tmp / "server.log")
        base = json.loads(get(f"http://127.0.0.1:{port}/v1/models")[1])["data"][0]["id"]
        yield Served(address, port, tmp / "server.log", base)
    finally:
        stop(proc)


def counters(served: Served) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every counter sample of /metrics: (name, sorted labels) -> value."""
    text = get(served.url("/metrics"))[1].decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in text_string_to_metric_families(text)
            for s in f.samples if s.name.endswith("_total")}


def http_statuses(served: Served, route: str = "/v1/completions") -> dict[str, float]:
    """loraplex_http_requests of ``route`` by status."""
    return {dict(labels)["status"]: value for (name, labels), value in counters(served).items()
            if name == "loraplex_http_requests_total" and dict(labels)["route"] == route}


def counter(served: Served, name: str, **labels: str) -> float:
    """One counter sample's value (0 before its first increment)."""
    return counters(served).get((name, tuple(sorted(labels.items()))), 0.0)


def gauge(served: Served, name: str) -> float:
    """A gauge's (first) sample."""
    text = get(served.url("/metrics"))[1].decode()
    return next(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


def wait_for(predicate, timeout: float = 30.0) -> None:
    """Poll ``predicate`` until it holds; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def post_head(path: str, length: int, extra: bytes = b"") -> bytes:
    """The head of a JSON POST to ``path`` declaring a body of ``length`` bytes."""
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n").encode() + extra + b"\r\n"


def server_faults(served: Served) -> list[str]:
    """The log lines of server faults: tracebacks and ERROR lines."""
    log = served.log.read_text()
    return [line for line in log.splitlines() if "Traceback" in line or " ERROR " in line]


def post(served: Served, body: dict) -> tuple[int, dict]:
    """(status, JSON answer) of a POST /v1/completions."""
    conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    return response.status, json.loads(response.read())
