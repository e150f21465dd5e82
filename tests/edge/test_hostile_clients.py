"""Both edges of a real server process under clients that hang up (issue 48), over real
sockets: a client that hangs up before, during or after its body, or mid-stream, is the
client's (HTTP 499 / gRPC CANCELLED, one INFO line, no traceback, its request aborted in the
engine and counted as finished with reason ``abort``), never a 5xx; an upload cancelled halfway
stores nothing, counts no error and can be retried at once. Bounded connections:
tests/edge/test_bounded_connections.py."""

from __future__ import annotations

import hashlib
import http.client
import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from hostile_helpers import (Served, counter, counters, gauge, get, http_statuses, post_head, serve, server_faults,
                             wait_for)
from loraplex.clients import LoraplexClient
from loraplex.v1 import inference_pb2 as pb, inference_pb2_grpc as pb_grpc
from served_adapters import peft_sources  # noqa: F401  (fixture)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def served(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    yield from serve(tiny_llama_dir, tmp_path_factory.mktemp("hostile"))


def test_100_clients_hanging_up_mid_body_are_499_never_5xx(served: Served) -> None:
    before = http_statuses(served)

    def hang_up(i: int) -> None:
        with socket.create_connection(("127.0.0.1", served.port), timeout=10) as sock:
            body = b'{"model": "x", "prompt": "' + b"a" * (10 + i)
            sock.sendall(post_head("/v1/completions", 1000) + (body if i % 4 else b""))  # every 4th: before the body
            time.sleep(0.05)

    threads = [threading.Thread(target=hang_up, args=(i,)) for i in range(100)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    wait_for(lambda: http_statuses(served).get("499", 0) - before.get("499", 0) == 100)
    after = http_statuses(served)
    assert {s: after[s] - before.get(s, 0) for s in after if after[s] != before.get(s, 0)} == {"499": 100}
    assert server_faults(served) == []
    assert served.log.read_text().count("the client disconnected before its request body arrived") >= 100
    status, body = get(served.url("/health"))
    assert status == 200


def test_a_client_gone_after_its_body_or_mid_stream_is_aborted_and_counted(served: Served) -> None:
    aborts = counter(served, "loraplex_finished_requests_total", reason="abort")
    before = http_statuses(served)
    body = json.dumps({"model": served.base, "prompt": "tell me", "max_tokens": 2000, "ignore_eos": True}).encode()
    with socket.create_connection(("127.0.0.1", served.port), timeout=10) as sock:  # waiting for a whole answer
        sock.sendall(post_head("/v1/completions", len(body)) + body)
        wait_for(lambda: gauge(served, "vllm:num_requests_running") == 1)
    wait_for(lambda: gauge(served, "vllm:num_requests_running") == 0, timeout=5)
    streamed = json.dumps({"model": served.base, "prompt": "tell me", "max_tokens": 2000, "ignore_eos": True,
                           "stream": True}).encode()
    with socket.create_connection(("127.0.0.1", served.port), timeout=10) as sock:  # mid-stream
        sock.sendall(post_head("/v1/completions", len(streamed)) + streamed)
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
    assert server_faults(served) == []


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
    assert server_faults(served) == []


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
    assert "outcome=cancelled" in served.log.read_text() and server_faults(served) == []
