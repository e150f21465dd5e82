"""The real server (real engine, tiny random Llama, PEFT adapters made with peft) over gRPC on
a free loopback port: token-exact streams, cancellation and deadlines free the KV blocks,
status codes, uploads, health, reflection, metrics; SIGTERM drains (in a subprocess)."""

from __future__ import annotations

import asyncio
import shutil
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from server_helpers import ServerThread, free_port, write_fake_adapter

from loraplex.clients import AsyncLoraplexClient, LoraplexClient
from loraplex.clients.errors import DeadlineExceededError, InvalidArgumentError, NotFoundError
from loraplex.inference_server.build import build_engine
from loraplex.inference_server.engine.async_engine import AsyncEngine
from loraplex.inference_server.engine.config import EngineConfig
from loraplex.inference_server.engine.request import GenerationRequest, SamplingParams, StoppingCriteria
from loraplex.inference_server.model.checkpoint import ModelSource
from loraplex.inference_server.server.app import ServerOptions
from served_adapters import ADAPTERS, PROMPTS, _wait_idle, peft_sources  # noqa: F401  (fixture)

pytestmark = pytest.mark.slow

NEW_TOKENS = 24


@pytest.fixture(scope="module")
def live(tiny_llama_dir: Path, peft_sources: dict[str, Path], tmp_path_factory: pytest.TempPathFactory):
    """(server thread, engine, adapter dir): the real engine behind the gRPC edge, with metrics."""
    store = tmp_path_factory.mktemp("store")
    for name in ADAPTERS:
        shutil.copytree(peft_sources[name], store / name)
    srv = ServerThread(ServerOptions(port=0, metrics_port=free_port(), default_max_new_tokens=NEW_TOKENS))
    config = EngineConfig(num_kv_blocks=256, block_size=16, max_num_seqs=32, max_num_batched_tokens=512)
    engine = build_engine(AsyncEngine, config, ModelSource(path=str(tiny_llama_dir)), store, progress=False)
    srv.attach(engine)
    yield srv, engine, store
    srv.close()


def _request(i: int, tokens: list[int], adapter: str | None) -> GenerationRequest:
    return GenerationRequest(f"ref-{i}", tuple(tokens), adapter, SamplingParams(),
                             StoppingCriteria(max_new_tokens=NEW_TOKENS, ignore_eos=True))


def test_32_concurrent_streams_over_4_adapters_and_base_are_token_exact(live) -> None:
    srv, engine, _ = live
    jobs = [(PROMPTS[i % len(PROMPTS)], [None, *ADAPTERS][i % 5]) for i in range(32)]
    chats = [[{"role": "user", "content": p}] for p, _ in jobs]
    requests = [_request(i, engine.tokenizer.apply_chat_template(c), a) for i, (c, (_, a)) in enumerate(zip(chats, jobs))]

    async def in_process() -> list[list[int]]:
        async def one(r: GenerationRequest) -> list[int]:
            return [t async for e in engine.generate(r) for t in e.token_ids]
        return await asyncio.gather(*(one(r) for r in requests))

    expected = srv.call(in_process())

    async def over_grpc() -> list:
        async with AsyncLoraplexClient(srv.address) as client:
            return await asyncio.gather(*(client.generate_text(messages=c, adapter=a, ignore_eos=True)
                                          for c, (_, a) in zip(chats, jobs)))

    got = asyncio.run(over_grpc())
    assert [list(r.token_ids) for r in got] == expected
    assert all(r.finish_reason == "length" and r.usage.completion_tokens == NEW_TOKENS for r in got)
    assert got[0].text == engine.tokenizer.decode(expected[0])
    by_model = {a: expected[i] for i, (_, a) in enumerate(jobs[:5])}
    assert len({tuple(v) for v in by_model.values()}) == 5  # every adapter changes the answer
    _wait_idle(engine)


def test_cancel_mid_stream_frees_the_kv_blocks(live) -> None:
    srv, engine, _ = live
    _wait_idle(engine)
    with LoraplexClient(srv.address) as client:
        stream = client.generate("Tell me a long story.", adapter=ADAPTERS[0], max_new_tokens=1000, ignore_eos=True)
        next(stream)
        next(stream)
        assert engine.stats().free_kv_blocks < engine.stats().total_kv_blocks
        stream.close()
    _wait_idle(engine)


def test_deadline_exceeded_aborts_and_frees(live) -> None:
    srv, engine, _ = live
    with LoraplexClient(srv.address) as client, pytest.raises(DeadlineExceededError):
        list(client.generate("Count forever.", max_new_tokens=1500, ignore_eos=True, timeout=0.5))
    _wait_idle(engine)


def test_status_codes_from_the_real_engine(live) -> None:
    srv, engine, _ = live
    with LoraplexClient(srv.address) as client:
        with pytest.raises(NotFoundError):
            client.generate_text("hi", adapter="no-such-adapter")
        with pytest.raises(InvalidArgumentError) as info:
            client.generate_text("hi", top_p=0.0)
        assert info.value.field == "sampling.top_p"
        with pytest.raises(InvalidArgumentError) as info:
            client.generate_text(token_ids=[1] * 5000)
        assert info.value.field == "token_ids"
    _wait_idle(engine)


def test_upload_generate_delete_and_bad_uploads(live, peft_sources: dict[str, Path], tmp_path: Path) -> None:
    srv, engine, store = live
    with LoraplexClient(srv.address) as client:
        before = sorted(p.name for p in store.iterdir())
        with pytest.raises(InvalidArgumentError, match="shape"):  # made for another base model
            client.upload_adapter("mismatched", write_fake_adapter(tmp_path / "mismatched"))
        corrupt = tmp_path / "corrupt"
        shutil.copytree(peft_sources["extra"], corrupt)
        (corrupt / "adapter_model.safetensors").write_bytes(b"garbage" * 10)
        with pytest.raises(InvalidArgumentError):
            client.upload_adapter("corrupt", corrupt)
        assert sorted(p.name for p in store.iterdir()) == before
        assert {a.adapter_id for a in client.list_adapters()} == set(ADAPTERS)

        info = client.upload_adapter("team/extra", peft_sources["extra"])
        assert info.rank == 8 and set(info.target_modules) == {"q_proj", "k_proj", "down_proj"}
        with_adapter = client.generate_text("hi", adapter="team/extra", ignore_eos=True)
        base = client.generate_text("hi", ignore_eos=True)
        assert with_adapter.finish_reason == "length" and with_adapter.token_ids != base.token_ids
        client.delete_adapter("team/extra")
        with pytest.raises(NotFoundError):
            client.generate_text("hi", adapter="team/extra")
    _wait_idle(engine)


def test_health_reflection_and_metrics(live) -> None:
    srv, engine, _ = live
    with LoraplexClient(srv.address) as client:
        assert client.health() == "SERVING"
        url = f"http://127.0.0.1:{srv.server.metrics_port}/metrics"
        before = urllib.request.urlopen(url, timeout=5).read().decode()
        client.generate_text("hi", adapter=ADAPTERS[1], max_new_tokens=5, ignore_eos=True)
        after = urllib.request.urlopen(url, timeout=5).read().decode()

    def value(text: str, name: str) -> float:
        lines = [line for line in text.splitlines() if line.startswith(name + " ")]
        return float(lines[0].split()[-1]) if lines else 0.0

    assert value(after, "loraplex_generated_tokens_total") == value(before, "loraplex_generated_tokens_total") + 5
    label = f'loraplex_generate_requests_total{{adapter="{ADAPTERS[1]}"}}'
    assert value(after, label) == value(before, label) + 1
    assert value(after, "loraplex_resident_adapters") >= 1
    assert value(after, "loraplex_total_kv_blocks") == 256
    stub = reflection_pb2_grpc.ServerReflectionStub(grpc.insecure_channel(srv.address))
    responses = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5)
    names = {s.name for r in responses for s in r.list_services_response.service}
    assert {"loraplex.v1.InferenceService", "grpc.health.v1.Health"} <= names
