"""The gRPC edge over a fake engine: streaming, status codes, cancellation, uploads, health,
reflection, metrics, draining. (tests/server/test_server_integration.py runs the real engine.)"""

from __future__ import annotations

import logging
import re
import shutil
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from loraplex.clients import LoraplexClient
from loraplex.clients.errors import (
    DeadlineExceededError,
    InvalidArgumentError,
    NotFoundError,
    ResourceExhaustedError,
    UnavailableError,
)
from loraplex.inference_server.server.app import ServerOptions
from loraplex.v1 import inference_pb2 as pb
from loraplex.v1 import inference_pb2_grpc as pb_grpc
from server_helpers import ByteTokenizer, FakeEngine, ServerThread, fake_tokens, free_port, write_fake_adapter


@pytest.fixture(params=[False])
def served(request: pytest.FixtureRequest, tmp_path: Path):
    """(server thread, fake engine, client) with the engine attached; parametrize indirectly with True
    to get the /metrics endpoint (off by default: its shutdown costs half a second)."""
    srv = ServerThread(ServerOptions(port=0, metrics_port=free_port() if request.param else 0, max_upload_bytes=1_000_000,
                                     max_concurrent_streams=64, default_max_new_tokens=8))
    engine = FakeEngine(tmp_path / "adapters")
    srv.attach(engine)
    client = LoraplexClient(srv.address, timeout=10)
    yield srv, engine, client
    client.close()
    srv.close()


def wait_for(predicate, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.01)


def test_generate_streams_tokens_then_finish_usage_timings(served) -> None:
    srv, engine, client = served
    events = list(client.generate("hi", max_new_tokens=5, request_id="mine-1"))
    prompt = tuple(ByteTokenizer().encode("hi"))
    assert [t for e in events for t in e.token_ids] == fake_tokens(prompt, None, 5)
    assert all(e.request_id == "mine-1" for e in events)
    assert all(e.finish_reason is None for e in events[:-1])
    last = events[-1]
    assert last.finish_reason == "length" and last.usage.prompt_tokens == 2 and last.usage.completion_tokens == 5
    assert last.timings.total_s > 0
    assert "".join(e.text for e in events) == ByteTokenizer().decode(fake_tokens(prompt, None, 5))


def test_prompt_kinds_token_ids_chat_and_default_max_new_tokens(served) -> None:
    srv, engine, client = served
    client.generate_text(token_ids=[10, 11, 12])
    client.generate_text(messages=[{"role": "user", "content": "yo"}])
    assert engine.requests[0].prompt_token_ids == (10, 11, 12)
    assert engine.requests[0].stopping.max_new_tokens == 8  # the server default
    assert engine.requests[1].prompt_token_ids == tuple(ByteTokenizer().apply_chat_template(
        [{"role": "user", "content": "yo"}]))


def test_developer_role_is_read_as_system(served) -> None:
    """OpenAI's newer name of the system role: the same prompt as system, as the HTTP edge reads it."""
    srv, engine, client = served
    for role in ("developer", "system"):
        client.generate_text(messages=[{"role": role, "content": "be brief"}, {"role": "user", "content": "yo"}])
    assert engine.requests[0].prompt_token_ids == engine.requests[1].prompt_token_ids


def test_chat_content_parts_are_text_and_other_types_are_refused_naming_them(served) -> None:
    srv, engine, client = served
    parts = [{"type": "text", "text": "y"}, {"type": "text", "text": "o"}]
    assert client.generate_text(messages=[{"role": "user", "content": parts}]).text == client.generate_text(
        messages=[{"role": "user", "content": "y\no"}]).text  # the parts are lines (as vLLM joins them)
    assert engine.requests[0].prompt_token_ids == engine.requests[1].prompt_token_ids
    for kind in ("image_url", "input_audio", "file", "hologram"):
        with pytest.raises(InvalidArgumentError) as info:
            client.generate_text(messages=[{"role": "user", "content": [*parts, {"type": kind}]}])
        assert info.value.field == "chat.messages[0].parts[2].type"
        assert info.value.details == f"chat.messages[0].parts[2].type: {kind!r} is not supported: the model takes text"
    both = pb.GenerateRequest(chat=pb.ChatMessages(messages=[pb.ChatMessage(
        role="user", content="yo", parts=[pb.ContentPart(type="text", text="yo")])]))
    with grpc.insecure_channel(srv.address) as channel, pytest.raises(grpc.RpcError) as caught:
        list(pb_grpc.InferenceServiceStub(channel).Generate(both, timeout=10))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details().startswith("chat.messages[0].parts: set content or parts, not both")
    assert len(engine.requests) == 2


def test_sampling_and_stopping_reach_the_engine(served) -> None:
    srv, engine, client = served
    result = client.generate_text("x", temperature=0.7, top_k=5, top_p=0.9, seed=42, repetition_penalty=1.1,
                                  stop=["END"], stop_token_ids=[7], ignore_eos=True, top_logprobs=2,
                                  max_new_tokens=3)
    req = engine.requests[0]
    s, st = req.sampling, req.stopping
    assert (s.temperature, s.top_k, s.top_p, s.seed, s.repetition_penalty) == pytest.approx((0.7, 5, 0.9, 42, 1.1))
    assert s.logprobs and s.top_logprobs == 2
    assert st.stop_strings == ("END",) and st.stop_token_ids == (7,) and st.ignore_eos and st.max_new_tokens == 3
    events = list(client.generate("x", logprobs=True, top_logprobs=2, max_new_tokens=3))
    first = events[0]
    assert first.logprobs == (-0.5,)
    assert first.top_logprobs[0][0] == (first.token_ids[0], -0.5)  # most likely first
    assert result.finish_reason == "length"


@pytest.mark.parametrize("kwargs, field", [
    (dict(prompt="x", top_p=1.5), "sampling.top_p"),
    (dict(prompt="x", temperature=-1.0), "sampling.temperature"),
    (dict(prompt="x", top_logprobs=50), "sampling.top_logprobs"),
    (dict(prompt="x", max_new_tokens=0), "stopping.max_new_tokens"),
    (dict(prompt="x", max_new_tokens=100_000), "stopping.max_new_tokens"),
    (dict(prompt="x", stop=[""]), "stopping.stop_strings"),
    (dict(prompt="x", adapter="../etc"), "adapter_id"),
    (dict(prompt=""), "text"),
    (dict(token_ids=[5, 100_000]), "token_ids.ids"),
    (dict(prompt="x" * 300), "text"),  # longer than the context window
    (dict(messages=[]), "chat.messages"),
    (dict(messages=[{"role": "wizard", "content": "hi"}]), "chat.messages[0].role"),
    (dict(prompt="x", request_id="has space"), "request_id"),
    (dict(prompt="x", repetition_penalty=1e-300), "sampling.repetition_penalty"),
    (dict(prompt="x", stop=["s" * 257]), "stopping.stop_strings"),
])
def test_bad_parameters_are_invalid_argument_naming_the_field(served, kwargs, field) -> None:
    srv, engine, client = served
    with pytest.raises(InvalidArgumentError) as info:
        client.generate_text(**kwargs)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.field == field
    assert info.value.details.startswith(field + ":")
    assert engine.requests == []


def test_missing_prompt_is_invalid_argument(served) -> None:
    srv, engine, client = served
    stub = pb_grpc.InferenceServiceStub(grpc.insecure_channel(srv.address))
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(pb.GenerateRequest(), timeout=5))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "prompt" in info.value.details()


def test_unknown_adapter_is_not_found_never_base_model(served) -> None:
    srv, engine, client = served
    with pytest.raises(NotFoundError, match="nope"):
        client.generate_text("x", adapter="nope")
    with pytest.raises(NotFoundError):
        client.get_adapter("tenant/nope")


def test_cancel_mid_stream_aborts_in_engine_and_frees_blocks(served) -> None:
    srv, engine, client = served
    engine.step_s = 0.02
    stream = client.generate("x", max_new_tokens=250)
    next(stream)
    assert engine.stats().free_kv_blocks == engine.TOTAL_BLOCKS - 1
    stream.close()  # leaving the loop early cancels the call
    wait_for(lambda: engine.aborted and not engine.running)
    assert engine.aborted == [engine.requests[0].request_id]
    assert engine.stats().free_kv_blocks == engine.TOTAL_BLOCKS
    wait_for(lambda: srv.server.state.open_stream_ids() == [])


def test_deadline_exceeded_aborts_in_engine(served) -> None:
    srv, engine, client = served
    engine.step_s = 0.02
    start = time.monotonic()
    with pytest.raises(DeadlineExceededError):
        list(client.generate("x", max_new_tokens=250, timeout=0.3))
    assert time.monotonic() - start < 3
    wait_for(lambda: engine.aborted == [engine.requests[0].request_id] and not engine.running)


def test_a_deadline_before_the_first_token_aborts_at_once(served) -> None:
    """A stream whose deadline passes while its request waits for its first token (queued, or
    its adapter loading) is aborted then, not when that token would come."""
    srv, engine, client = served
    engine.step_s = 3.0  # the first token takes 3 s
    start = time.monotonic()
    with pytest.raises(DeadlineExceededError):
        list(client.generate("x", max_new_tokens=4, timeout=0.3))
    wait_for(lambda: engine.aborted == [engine.requests[0].request_id], timeout=10)
    assert time.monotonic() - start < 1.5, "aborted only when the first token came"


def test_full_queue_is_resource_exhausted(served) -> None:
    srv, engine, client = served
    engine.max_running, engine.step_s = 1, 0.02
    first = client.generate("x", max_new_tokens=250)
    next(first)
    with pytest.raises(ResourceExhaustedError, match="queue is full"):
        client.generate_text("y")
    first.close()


def test_edge_stream_limit_is_resource_exhausted(tmp_path: Path) -> None:
    srv = ServerThread(ServerOptions(port=0, max_concurrent_streams=1))
    engine = FakeEngine(tmp_path, step_s=0.02)
    srv.attach(engine)
    try:
        with LoraplexClient(srv.address) as client:
            first = client.generate("x", max_new_tokens=250)
            next(first)
            with pytest.raises(ResourceExhaustedError, match="concurrent streams"):
                client.generate_text("y")
            first.close()
    finally:
        srv.close()


def test_health_not_serving_until_engine_attached_then_serving(tmp_path: Path) -> None:
    srv = ServerThread(ServerOptions(port=0))
    try:
        with LoraplexClient(srv.address, retry_attempts=1) as client:
            assert client.health() == "NOT_SERVING"
            assert client.health("loraplex.v1.InferenceService") == "NOT_SERVING"
            with pytest.raises(UnavailableError, match="loading"):
                client.generate_text("x")
            srv.attach(FakeEngine(tmp_path))
            assert client.health() == "SERVING"
            assert client.health("loraplex.v1.InferenceService") == "SERVING"
            assert client.generate_text("x", max_new_tokens=2).finish_reason == "length"
    finally:
        srv.close()


def test_idempotent_reads_retry_on_unavailable_generate_does_not(tmp_path: Path) -> None:
    srv = ServerThread(ServerOptions(port=0))
    engine = FakeEngine(tmp_path)
    try:
        with LoraplexClient(srv.address) as client:
            with pytest.raises(UnavailableError):
                client.generate_text("x")  # not retried: fails at once while the model loads
            timer = threading.Timer(0.25, lambda: srv.attach(engine))
            timer.start()
            start = time.monotonic()
            assert client.list_adapters() == []  # retried with backoff until the engine is attached
            assert time.monotonic() - start >= 0.2
            timer.join()
    finally:
        srv.close()


def test_reflection_lists_the_services(served) -> None:
    srv, engine, client = served
    stub = reflection_pb2_grpc.ServerReflectionStub(grpc.insecure_channel(srv.address))
    responses = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5)
    names = {s.name for r in responses for s in r.list_services_response.service}
    assert {"loraplex.v1.InferenceService", "grpc.health.v1.Health",
            "grpc.reflection.v1alpha.ServerReflection"} <= names


def test_server_info_reports_model_and_limits(served) -> None:
    srv, engine, client = served
    info = client.server_info()
    assert info.model_name == "fake-llama" and info.max_context_len == 256 and info.vocab_size == 300
    assert info.default_max_new_tokens == 8 and info.max_upload_bytes == 1_000_000
    assert info.eos_token_ids == (2,) and info.max_lora_rank == 64


@pytest.mark.parametrize("served", [True], indirect=True)
def test_metrics_counters_move(served) -> None:
    srv, engine, client = served
    url = f"http://127.0.0.1:{srv.server.metrics_port}/metrics"

    def scrape() -> str:
        return urllib.request.urlopen(url, timeout=5).read().decode()

    before = scrape()
    assert 'loraplex_generated_tokens_total 0.0' in before
    client.generate_text("x", max_new_tokens=4)
    with pytest.raises(NotFoundError):
        client.generate_text("x", adapter="ghost")
    after = scrape()
    assert 'loraplex_generated_tokens_total 4.0' in after
    assert 'loraplex_generate_requests_total{adapter="base"} 1.0' in after
    assert 'loraplex_rpc_requests_total{code="OK",method="Generate"} 1.0' in after
    assert 'loraplex_rpc_requests_total{code="NOT_FOUND",method="Generate"} 1.0' in after
    assert 'loraplex_time_to_first_token_seconds_count 1.0' in after
    assert 'loraplex_inter_token_latency_seconds_count 3.0' in after
    assert 'loraplex_total_kv_blocks 64.0' in after
    assert 'loraplex_queue_length 0.0' in after
    assert 'loraplex_resident_adapters 0.0' in after
    assert 'loraplex_active_streams 0.0' in after
    prompt_total = lambda: float(re.search(r"^loraplex_prompt_tokens_total (\S+)$", scrape(), re.M).group(1))  # noqa: E731
    start = prompt_total()
    client.generate_text("abcdef", max_new_tokens=2)
    one = prompt_total() - start
    client.generate_choices("abcdef", n=3, max_new_tokens=2)  # n choices share their prompt: counted once
    assert one > 0 and prompt_total() - start == 2 * one
    engine.step_s = 0.01  # streams open now: the gauge an autoscaler may read counts them, and drops as they end
    streams = [client.generate("x", max_new_tokens=60) for _ in range(2)]
    for stream in streams:
        next(stream)
    assert 'loraplex_active_streams 2.0' in scrape()
    streams[0].close()  # leaving the loop early cancels the call
    for _ in streams[1]:
        pass
    wait_for(lambda: 'loraplex_active_streams 0.0' in scrape())


def test_shutdown_drains_open_streams_and_refuses_new_ones(served) -> None:
    srv, engine, client = served
    engine.step_s = 0.01
    stream = client.generate("x", max_new_tokens=60)
    first = next(stream)
    closing = threading.Thread(target=lambda: srv.call(srv.server.shutdown(10.0)))
    closing.start()
    wait_for(lambda: srv.server.state.draining)
    with pytest.raises(UnavailableError, match="shutting down"):
        client.generate_text("y")
    rest = list(stream)
    closing.join(10)
    assert rest[-1].finish_reason == "length"
    assert len(first.token_ids) + sum(len(e.token_ids) for e in rest) == 60
    assert engine.aborted == []


def test_shutdown_aborts_streams_that_outlive_the_grace_period(served) -> None:
    srv, engine, client = served
    engine.step_s = 0.02
    stream = client.generate("x", max_new_tokens=250)
    next(stream)
    srv.call(srv.server.shutdown(0.2))
    events = list(stream)
    assert events[-1].finish_reason == "abort"
    assert engine.aborted == [engine.requests[0].request_id]


def test_message_over_the_size_limit_is_resource_exhausted(tmp_path: Path) -> None:
    srv = ServerThread(ServerOptions(port=0, max_message_bytes=64 * 1024))
    engine = FakeEngine(tmp_path)
    srv.attach(engine)
    try:
        with LoraplexClient(srv.address) as client:
            with pytest.raises(ResourceExhaustedError):
                client.generate_text("x" * 100_000)  # 100 KB on the wire
            assert engine.requests == []
            assert client.generate_text("small", max_new_tokens=2).finish_reason == "length"
    finally:
        srv.close()


def test_uploads_and_listings_fit_the_server_s_message_limit(tmp_path: Path) -> None:
    """A server started with a small --max-message-bytes: the client cuts an adapter larger than the
    limit into chunks that fit (it reads the limit from ServerInfo), and a listing whose infos would
    not fit one message comes in more pages."""
    limit = 64 * 1024
    srv = ServerThread(ServerOptions(port=0, max_message_bytes=limit))
    adapters = tmp_path / "adapters"
    srv.attach(FakeEngine(adapters))
    try:
        big = write_fake_adapter(tmp_path / "big", rank=64, modules=("q_proj", "k_proj", "v_proj", "o_proj",
                                                                     "gate_proj", "up_proj", "down_proj"))
        assert (big / "adapter_model.safetensors").stat().st_size > 2 * limit
        small = write_fake_adapter(tmp_path / "small", rank=1)
        for i in range(400):  # hand-made folders: ~400 infos are more than one 64 KiB message holds
            shutil.copytree(small, adapters / f"a{i:03d}")
        with LoraplexClient(srv.address, timeout=30) as client:
            assert client.upload_adapter("acme/big", big).rank == 64
            listed = client.list_adapters()
        assert [a.adapter_id for a in listed] == sorted([*(f"a{i:03d}" for i in range(400)), "acme/big"])
    finally:
        srv.close()


def test_request_bodies_that_do_not_parse_are_invalid_argument_without_a_traceback(served, caplog) -> None:
    """gRPC's default decoding answered UNKNOWN ('Unexpected DecodeError') and logged an ERROR
    traceback per call, before any handler ran: anyone could fill the log."""
    srv, engine, client = served
    with grpc.insecure_channel(srv.address) as channel, caplog.at_level(logging.INFO):
        for method in ("GetAdapter", "ListAdapters", "DeleteAdapter"):
            call = channel.unary_unary(f"/loraplex.v1.InferenceService/{method}")
            for body in (b"\xff\xff\xff", b"\n\x02\xc3("):  # not a message; invalid UTF-8 in a string
                with pytest.raises(grpc.RpcError) as info:
                    call(body, timeout=10)
                assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, info.value)
                assert "not a valid message" in info.value.details()
        generate = channel.unary_stream("/loraplex.v1.InferenceService/Generate")
        with pytest.raises(grpc.RpcError) as info:
            list(generate(b"\xff\xff\xff", timeout=10))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        upload = channel.stream_unary("/loraplex.v1.InferenceService/UploadAdapter")
        with pytest.raises(grpc.RpcError) as info:
            upload(iter([b"\xff\xff\xff"]), timeout=10)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], [r.getMessage() for r in caplog.records]
    assert engine.requests == []
