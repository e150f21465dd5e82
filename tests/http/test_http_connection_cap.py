"""At the --http-max-connections cap a real server process still answers /health and /metrics
(kubelet probes, Prometheus and the routers read them on this port: a loaded server must not
look dead), each with Connection: close, while generation and every other route stay refused;
a connection let in for a probe cannot go on to a completion, and the probes answered past the
cap at once are bounded (ConnectionCap's reserve, driven as an ASGI app)."""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from hostile_helpers import Served, counter, get, http_statuses, post, serve, wait_for
from loraplex.inference_server.http.connections import PROBE_RESERVE, ConnectionCap

CAP = 4


@pytest.fixture(scope="module")
def served(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    yield from serve(tiny_llama_dir, tmp_path_factory.mktemp("cap"), "--http-max-connections", str(CAP),
                     "--http-head-timeout-s", "60")


@pytest.fixture
def at_cap(served: Served) -> Iterator[list[socket.socket]]:
    """CAP idle connections held open (each counts against the cap until its head deadline)."""
    held = [socket.create_connection(("127.0.0.1", served.port), timeout=10) for _ in range(CAP)]
    time.sleep(0.3)  # accepted
    try:
        yield held
    finally:
        for sock in held:
            sock.close()
        wait_for(lambda: post(served, {"model": served.base, "prompt": "hi", "max_tokens": 1})[0] == 200, timeout=10)


def _raw(port: int, request: bytes, timeout: float = 10.0) -> bytes:
    """Everything the server sends on one connection for ``request``, until it closes it."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(request)
        out = b""
        while chunk := sock.recv(65536):
            out += chunk
        return out


@pytest.mark.slow
def test_health_and_metrics_answer_at_the_cap_and_generation_is_refused(served: Served,
                                                                        at_cap: list[socket.socket]) -> None:
    refused = counter(served, "loraplex_http_connections_over_cap_total")  # itself a /metrics read past the cap
    completions = http_statuses(served)
    for _ in range(3):
        answer = _raw(served.port, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        head, body = answer.split(b"\r\n\r\n", 1)
        assert head.startswith(b"HTTP/1.1 200 ") and b"connection: close" in head.lower(), answer
        assert json.loads(body)["status"] == "SERVING"
    status, text = get(served.url("/metrics"))
    assert status == 200
    names = {f.name for f in text_string_to_metric_families(text.decode())}
    assert {"vllm:num_requests_waiting", "vllm:lora_requests_info"} <= names

    client = openai.OpenAI(base_url=served.url("/v1"), api_key="unused", max_retries=0, timeout=10)
    with pytest.raises(openai.InternalServerError) as refusal:
        client.completions.create(model=served.base, prompt="hi", max_tokens=2)
    assert refusal.value.status_code == 503 and refusal.value.body["code"] == "too_many_connections"
    with pytest.raises(openai.InternalServerError):
        client.models.list()
    assert counter(served, "loraplex_http_connections_over_cap_total") - refused == 2
    assert http_statuses(served) == completions  # no route ran for the refused completion


@pytest.mark.slow
def test_a_connection_let_in_for_a_probe_gets_no_completion(served: Served, at_cap: list[socket.socket]) -> None:
    """A completion pipelined behind /health on a connection past the cap: /health is answered,
    the connection is closed, and the completion never runs."""
    completions = http_statuses(served)
    body = json.dumps({"model": served.base, "prompt": "hi", "max_tokens": 2}).encode()
    answer = _raw(served.port, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
                  b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    assert answer.startswith(b"HTTP/1.1 200 ") and answer.count(b"HTTP/1.1 ") == 1, answer
    assert http_statuses(served) == completions


@pytest.mark.slow
def test_under_the_cap_probes_keep_their_connection(served: Served) -> None:
    answer = _raw(served.port, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 200 ")
    conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=10)
    try:
        socks = []
        for _ in range(2):  # kept alive: two answers on one connection
            conn.request("GET", "/health")
            response = conn.getresponse()
            assert response.status == 200 and response.getheader("connection") is None
            response.read()
            socks.append(conn.sock)
        assert socks[0] is socks[1] is not None
    finally:
        conn.close()


def test_probes_past_the_cap_are_bounded_by_the_reserve() -> None:
    """PROBE_RESERVE probes held in their route past the cap: one more /health is refused (503),
    as every other route is; once they are answered the reserve serves probes again."""
    release, inside, statuses = asyncio.Event(), [], []

    async def app(scope: dict, receive, send) -> None:
        inside.append(scope["path"])
        await release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    cap = ConnectionCap(app, open_connections=lambda: 11, limit=10, on_refused=lambda: None)

    async def request(path: str) -> None:
        async def send(message: dict) -> None:
            if message["type"] == "http.response.start":
                statuses.append((path, message["status"], dict(message["headers"]).get(b"connection")))

        async def receive() -> dict:
            return {"type": "http.request", "body": b"", "more_body": False}

        await cap({"type": "http", "method": "GET", "path": path, "headers": []}, receive, send)

    async def main() -> None:
        held = [asyncio.create_task(request("/health" if i % 2 else "/metrics")) for i in range(PROBE_RESERVE)]
        await asyncio.sleep(0.05)
        assert len(inside) == PROBE_RESERVE
        await request("/health")
        await request("/v1/models")
        assert [s for _, s, _ in statuses] == [503, 503]
        release.set()
        await asyncio.gather(*held)
        assert all(s == 200 and c == b"close" for _, s, c in statuses[2:])
        await request("/health")
        assert statuses[-1] == ("/health", 200, b"close")

    asyncio.run(main())
