"""Both edges of a real server process under hostile but realistic clients (issue 48), over
real sockets: a client that hangs up before, during or after its body, or mid-stream, is the
client's (HTTP 499 / gRPC CANCELLED, one INFO line, no traceback, its request aborted in the
engine and counted as finished with reason ``abort``), never a 5xx; idle and half-sent
connections are closed by their deadlines while the server answers throughout, connections past
the cap get 503, and an idle gRPC connection is closed."""

from __future__ import annotations

import hashlib
import http.client
import json
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from loraplex.clients import LoraplexClient
from loraplex.v1 import inference_pb2 as pb, inference_pb2_grpc as pb_grpc
from server_helpers import free_port
from test_server_integration import peft_sources  # noqa: F401  (fixture)
from test_server_process import start_server, stop

pytestmark = pytest.mark.slow
HEAD_TIMEOUT_S = 2.0
BODY_TIMEOUT_S = 2.0


@dataclass
class Served:
    address: str  # gRPC
    port: int  # HTTP
    log: Path
    base: str  # the base model's id

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"


def _get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
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
            if _get(f"http://127.0.0.1:{port}/health", timeout=2)[0] == 200:
                return
        except OSError:
            pass  # not listening yet
        assert proc.poll() is None, log.read_text()
        assert time.monotonic() < deadline, "the server did not start serving in time"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def served(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    tmp = tmp_path_factory.mktemp("hostile")
    port = free_port()
    proc, address = start_server(tiny_llama_dir, tmp, "--http-port", str(port), "--http-head-timeout-s",
                                 str(HEAD_TIMEOUT_S), "--http-body-timeout-s", str(BODY_TIMEOUT_S),
                                 "--grpc-max-connection-idle-s", "1")
    try:
        wait_until_serving(proc, port, tmp / "server.log")
        base = json.loads(_get(f"http://127.0.0.1:{port}/v1/models")[1])["data"][0]["id"]
        yield Served(address, port, tmp / "server.log", base)
    finally:
        stop(proc)


def counters(served: Served) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every counter sample of /metrics: (name, sorted labels) -> value."""
    text = _get(served.url("/metrics"))[1].decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in text_string_to_metric_families(text)
            for s in f.samples if s.name.endswith("_total")}


def http_statuses(served: Served, route: str = "/v1/completions") -> dict[str, float]:
    """loraplex_http_requests of ``route`` by status."""
    return {dict(labels)["status"]: value for (name, labels), value in counters(served).items()
            if name == "loraplex_http_requests_total" and dict(labels)["route"] == route}


def counter(served: Served, name: str, **labels: str) -> float:
    return counters(served).get((name, tuple(sorted(labels.items()))), 0.0)


def gauge(served: Served, name: str) -> float:
    text = _get(served.url("/metrics"))[1].decode()
    return next(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


def wait_for(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def _head(path: str, length: int, extra: bytes = b"") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n").encode() + extra + b"\r\n"


def _server_faults(served: Served) -> list[str]:
    log = served.log.read_text()
    return [line for line in log.splitlines() if "Traceback" in line or " ERROR " in line]


def test_100_clients_hanging_up_mid_body_are_499_never_5xx(served: Served) -> None:
    before = http_statuses(served)

    def hang_up(i: int) -> None:
        with socket.create_connection(("127.0.0.1", served.port), timeout=10) as sock:
            body = b'{"model": "x", "prompt": "' + b"a" * (10 + i)
            sock.sendall(_head("/v1/completions", 1000) + (body if i % 4 else b""))  # every 4th: before the body
            time.sleep(0.05)

    threads = [threading.Thread(target=hang_up, args=(i,)) for i in range(100)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    wait_for(lambda: http_statuses(served).get("499", 0) - before.get("499", 0) == 100)
    after = http_statuses(served)
    assert {s: after[s] - before.get(s, 0) for s in after if after[s] != before.get(s, 0)} == {"499": 100}
    assert _server_faults(served) == []
    assert served.log.read_text().count("the client disconnected before its request body arrived") >= 100
    status, body = _get(served.url("/health"))
    assert status == 200


def _post(served: Served, body: dict) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    return response.status, json.loads(response.read())


def test_a_client_gone_after_its_body_or_mid_stream_is_aborted_and_counted(served: Served) -> None:
    aborts = counter(served, "loraplex_finished_requests_total", reason="abort")
    before = http_statuses(served)
    body = json.dumps({"model": served.base, "prompt": "tell me", "max_tokens": 2000, "ignore_eos": True}).encode()
    with socket.create_connection(("127.0.0.1", served.port), timeout=10) as sock:  # waiting for a whole answer
        sock.sendall(_head("/v1/completions", len(body)) + body)
        wait_for(lambda: gauge(served, "vllm:num_requests_running") == 1)
    wait_for(lambda: gauge(served, "vllm:num_requests_running") == 0, timeout=5)
    streamed = json.dumps({"model": served.base, "prompt": "tell me", "max_tokens": 2000, "ignore_eos": True,
                           "stream": True}).encode()
    with socket.create_connection(("127.0.0.1", served.port), timeout=10) as sock:  # mid-stream
        sock.sendall(_head("/v1/completions", len(streamed)) + streamed)
        response = http.client.HTTPResponse(sock)
        response.begin()
        assert response.status == 200 and response.readline().startswith(b"data: {")
        sock.shutdown(socket.SHUT_RDWR)  # the response's file object keeps the socket open past close()
    wait_for(lambda: gauge(served, "vllm:num_requests_running") == 0, timeout=5)
    wait_for(lambda: counter(served, "loraplex_finished_requests_total", reason="abort") - aborts == 2)
    after = http_statuses(served)
    assert after["499"] - before.get("499", 0) == 2
    assert not any(s.startswith("5") and after[s] != before.get(s, 0) for s in after)
    log = served.log.read_text()
    assert "HTTP 499: the client disconnected before its" in log  # first token or whole answer: a race
    assert "the client disconnected mid-stream" in log
    assert _server_faults(served) == []


def test_a_grpc_client_cancelling_mid_stream_is_cancelled_not_an_error(served: Served) -> None:
    aborts = counter(served, "loraplex_finished_requests_total", reason="abort")
    with grpc.insecure_channel(served.address) as channel:
        call = pb_grpc.InferenceServiceStub(channel).Generate(pb.GenerateRequest(
            text="tell me", stopping=pb.StoppingCriteria(max_new_tokens=2000, ignore_eos=True)), timeout=60)
        assert next(call).token_ids
        call.cancel()
    wait_for(lambda: counter(served, "loraplex_rpc_requests_total", method="Generate", code="CANCELLED") == 1)
    wait_for(lambda: counter(served, "loraplex_finished_requests_total", reason="abort") - aborts == 1)
    wait_for(lambda: gauge(served, "vllm:num_requests_running") == 0, timeout=5)
    assert "CANCELLED Generate: the client cancelled the call" in served.log.read_text()
    assert _server_faults(served) == []


def test_a_grpc_upload_cancelled_halfway_stores_nothing_and_can_be_retried_at_once(
        served: Served, peft_sources: dict[str, Path]) -> None:  # noqa: F811
    folder = peft_sources["extra"]
    files = {p.name: p.read_bytes() for p in sorted(folder.iterdir())}
    refused = [k for k in counters(served) if k[0] == "loraplex_rpc_requests_total"
               and dict(k[1])["code"] not in ("OK", "CANCELLED")]
    go_on = threading.Event()

    def half_an_upload() -> Iterator[pb.UploadAdapterRequest]:
        yield pb.UploadAdapterRequest(metadata=pb.UploadMetadata(adapter_id="acme/halfway", files=[
            pb.UploadFile(name=n, size_bytes=len(b), sha256=hashlib.sha256(b).hexdigest()) for n, b in files.items()]))
        name, data = max(files.items(), key=lambda kv: len(kv[1]))
        yield pb.UploadAdapterRequest(chunk=pb.FileChunk(name=name, data=data[: len(data) // 2]))
        go_on.wait(30)

    with LoraplexClient(served.address, timeout=30) as client:
        listed = [a.adapter_id for a in client.list_adapters()]
        with grpc.insecure_channel(served.address) as channel:
            call = pb_grpc.InferenceServiceStub(channel).UploadAdapter.future(half_an_upload(), timeout=30)
            time.sleep(0.5)  # the metadata and half the weights are in
            call.cancel()
            go_on.set()
        wait_for(lambda: counter(served, "loraplex_rpc_requests_total", method="UploadAdapter", code="CANCELLED") == 1)
        assert [a.adapter_id for a in client.list_adapters()] == listed
        info = client.upload_adapter("acme/halfway", folder)  # at once: no lock, no partial version in the way
        assert info.adapter_id == "acme/halfway" and "acme/halfway" in [a.adapter_id for a in client.list_adapters()]
    assert [k for k in counters(served) if k[0] == "loraplex_rpc_requests_total"
            and dict(k[1])["code"] not in ("OK", "CANCELLED")] == refused
    assert counter(served, "loraplex_tenant_adapter_writes_total", tenant="anonymous", action="upload",
                   outcome="cancelled") == 1
    assert "outcome=cancelled" in served.log.read_text() and _server_faults(served) == []


def _answers_while(served: Served, busy: threading.Event, failures: list[str]) -> None:
    """/health and a small completion, again and again until ``busy`` clears; what failed goes
    to ``failures``."""
    body = {"model": served.base, "prompt": "hi", "max_tokens": 2}
    while busy.is_set():
        try:
            status, _ = _get(served.url("/health"), timeout=5)
            if status != 200:
                failures.append(f"/health {status}")
            status, answer = _post(served, body)
            if status != 200 or len(answer["choices"]) != 1:
                failures.append(f"completion {status}")
        except OSError as exc:
            failures.append(f"{type(exc).__name__}: {exc}")
        time.sleep(0.1)


def _closed_within(socks: list[socket.socket], timeout: float) -> list[float]:
    """When each socket was closed by the server (seconds from now), reading what it sent."""
    import selectors  # noqa: PLC0415

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
                    closed[key.fileobj] = time.monotonic() - start
                    sel.unregister(key.fileobj)
    return [closed.get(sock, float("inf")) for sock in socks]


def test_1000_idle_and_half_sent_connections_are_closed_by_their_deadlines(served: Served) -> None:
    timeouts = counter(served, "loraplex_http_connection_timeouts_total", phase="head")
    before = http_statuses(served)
    busy, failures = threading.Event(), []
    busy.set()
    answering = threading.Thread(target=_answers_while, args=(served, busy, failures))
    answering.start()
    socks = []
    try:
        opened = time.monotonic()
        for i in range(1000):
            sock = socket.create_connection(("127.0.0.1", served.port), timeout=10)
            if i % 5 == 1:
                sock.sendall(b"POST /v1/compl")  # half a request line
            elif i % 5 == 2:
                sock.sendall(_head("/v1/completions", 100))  # a head, and no body
            socks.append(sock)
        took = time.monotonic() - opened
        closed = _closed_within(socks, HEAD_TIMEOUT_S + BODY_TIMEOUT_S + 10)
    finally:
        busy.clear()
        answering.join(30)
        for sock in socks:
            sock.close()
    assert max(closed) <= max(HEAD_TIMEOUT_S, BODY_TIMEOUT_S) + 3, sorted(closed)[-5:]
    assert took < HEAD_TIMEOUT_S, "opening the sockets took longer than the deadline: the test says nothing"
    assert failures == []
    wait_for(lambda: counter(served, "loraplex_http_connection_timeouts_total", phase="head") - timeouts == 800)
    after = http_statuses(served)
    assert after["408"] - before.get("408", 0) == 200  # the bodies that never came: the route's own deadline
    assert _server_faults(served) == []


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


def test_connections_past_the_cap_get_503_and_the_server_stays_responsive(tiny_llama_dir: Path,
                                                                            tmp_path: Path) -> None:
    port = free_port()
    proc, _ = start_server(tiny_llama_dir, tmp_path, "--http-port", str(port), "--http-max-connections", "8",
                           "--http-head-timeout-s", "60")
    try:
        wait_until_serving(proc, port, tmp_path / "server.log")
        held = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(8)]
        time.sleep(0.3)  # accepted
        try:
            for _ in range(3):
                assert _get(f"http://127.0.0.1:{port}/health")[0] == 503
        finally:
            for sock in held:
                sock.close()
        served = Served("", port, tmp_path / "server.log", "")
        wait_for(lambda: _get(served.url("/health"))[0] == 200, timeout=10)
        base = json.loads(_get(served.url("/v1/models"))[1])["data"][0]["id"]
        status, answer = _post(Served("", port, tmp_path / "server.log", base),
                               {"model": base, "prompt": "hi", "max_tokens": 2})
        assert status == 200 and answer["choices"][0]["finish_reason"] == "length"
        assert _server_faults(served) == []
    finally:
        stop(proc)
