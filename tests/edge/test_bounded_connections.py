"""A real server process's connections are bounded (issue 48 item 2), over real sockets: 1000
idle and half-sent HTTP connections are closed by their head and body deadlines while /health
and a completion answer throughout, an oversized request head is refused, connections past the
cap get 503 and the server answers once they go, and an idle gRPC connection is closed."""

from __future__ import annotations

import json
import selectors
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from hostile_helpers import Served, counter, get, http_statuses, post, post_head, serve, server_faults, wait_for
from loraplex.v1 import inference_pb2 as pb, inference_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow
HEAD_TIMEOUT_S = 2.0
BODY_TIMEOUT_S = 2.0


@pytest.fixture(scope="module")
def served(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    yield from serve(tiny_llama_dir, tmp_path_factory.mktemp("bounded"), "--http-head-timeout-s", str(HEAD_TIMEOUT_S),
                     "--http-body-timeout-s", str(BODY_TIMEOUT_S), "--grpc-max-connection-idle-s", "1")


def _answers_while(served: Served, busy: threading.Event, failures: list[str]) -> None:
    """/health and a small completion, again and again until ``busy`` clears; what failed goes
    to ``failures``."""
    body = {"model": served.base, "prompt": "hi", "max_tokens": 2}
    while busy.is_set():
        try:
            status, _ = get(served.url("/health"), timeout=5)
            if status != 200:
                failures.append(f"/health {status}")
            status, answer = post(served, body)
            if status != 200 or len(answer["choices"]) != 1:
                failures.append(f"completion {status}")
        except OSError as exc:
            failures.append(f"{type(exc).__name__}: {exc}")
        time.sleep(0.1)


def _closed_at(socks: list[socket.socket], timeout: float) -> list[float]:
    """When (time.monotonic()) the server closed each socket, reading what it sent; inf for one
    still open after ``timeout`` seconds."""
    start, closed = time.monotonic(), {}
    with selectors.DefaultSelector() as sel:
        for sock in socks:
            sock.setblocking(False)
            sel.register(sock, selectors.EVENT_READ)
        while len(closed) < len(socks) and time.monotonic() - start < timeout:
            for key, _ in sel.select(timeout=0.5):
                try:
                    data = key.fileobj.recv(65536)
                except ConnectionResetError:
                    data = b""
                if not data:
                    closed[key.fileobj] = time.monotonic()
                    sel.unregister(key.fileobj)
    return [closed.get(sock, float("inf")) for sock in socks]


def test_1000_idle_and_half_sent_connections_are_closed_by_their_deadlines(served: Served) -> None:
    timeouts = counter(served, "loraplex_http_connection_timeouts_total", phase="head")
    before = http_statuses(served)
    busy, failures = threading.Event(), []
    busy.set()
    answering = threading.Thread(target=_answers_while, args=(served, busy, failures))
    answering.start()
    socks, opened = [], []
    try:
        for i in range(1000):
            sock = socket.create_connection(("127.0.0.1", served.port), timeout=10)
            opened.append(time.monotonic())
            if i % 5 == 1:
                sock.sendall(b"POST /v1/compl")  # half a request line
            elif i % 5 == 2:
                sock.sendall(post_head("/v1/completions", 100))  # a head, and no body
            socks.append(sock)
        closed = _closed_at(socks, HEAD_TIMEOUT_S + BODY_TIMEOUT_S + 10)
    finally:
        busy.clear()
        answering.join(30)
        for sock in socks:
            sock.close()
    held = sorted(c - o for c, o in zip(closed, opened))
    assert held[-1] <= max(HEAD_TIMEOUT_S, BODY_TIMEOUT_S) + 3, held[-5:]  # each, from its own opening
    assert held[0] >= min(HEAD_TIMEOUT_S, BODY_TIMEOUT_S) - 0.5, held[:5]  # none closed before its deadline
    assert failures == []
    wait_for(lambda: counter(served, "loraplex_http_connection_timeouts_total", phase="head") - timeouts == 800)
    after = http_statuses(served)
    assert after["408"] - before.get("408", 0) == 200  # the bodies that never came: the route's own deadline
    assert server_faults(served) == []


def test_an_idle_grpc_connection_is_closed(served: Served) -> None:
    """--grpc-max-connection-idle-s 1: a connection with no call is closed (GOAWAY); the channel
    goes idle and reconnects for its next call."""
    states: list[grpc.ChannelConnectivity] = []
    with grpc.insecure_channel(served.address) as channel:
        stub = pb_grpc.InferenceServiceStub(channel)
        stub.ServerInfo(pb.ServerInfoRequest(), timeout=10)
        channel.subscribe(states.append)
        wait_for(lambda: grpc.ChannelConnectivity.IDLE in states, timeout=10)
        assert stub.ServerInfo(pb.ServerInfoRequest(), timeout=10).model_name == served.base


def test_a_request_head_growing_past_its_limit_is_400_and_serving_goes_on(served: Served) -> None:
    """h11 buffers at most --http-max-head-bytes (16 KiB) of a head not yet complete."""
    with socket.create_connection(("127.0.0.1", served.port), timeout=10) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Padding: " + b"a" * 20_000)
        assert sock.recv(65536).startswith(b"HTTP/1.1 400 ")
    assert get(served.url("/health"))[0] == 200


def test_connections_past_the_cap_get_503_and_the_server_stays_responsive(tiny_llama_dir: Path,
                                                                            tmp_path: Path) -> None:
    process = serve(tiny_llama_dir, tmp_path, "--http-max-connections", "8", "--http-head-timeout-s", "60")
    served = next(process)
    try:
        held = [socket.create_connection(("127.0.0.1", served.port), timeout=10) for _ in range(8)]
        time.sleep(0.3)  # accepted
        try:
            for _ in range(3):
                status, body = get(served.url("/v1/models"))
                assert status == 503, body
                error = json.loads(body)["error"]  # OpenAI's shape, so clients read why
                assert error["code"] == "too_many_connections" and "--http-max-connections" in error["message"]
            assert get(served.url("/health"))[0] == 200  # probes are answered past the cap (tests/http)
        finally:
            for sock in held:
                sock.close()
        wait_for(lambda: get(served.url("/v1/models"))[0] == 200, timeout=10)
        assert counter(served, "loraplex_http_connections_over_cap_total") == 3
        status, answer = post(served, {"model": served.base, "prompt": "hi", "max_tokens": 2})
        assert status == 200 and answer["choices"][0]["finish_reason"] == "length"
        assert server_faults(served) == []
    finally:
        process.close()  # stops the server
