"""The HTTP edge over the real engine (tiny random Llama with PEFT adapters, and SmolLM2),
through the real openai client on loopback: greedy answers equal the gRPC API's for the same
request with adapters mixed across 16 concurrent requests, uploads list at once, a client
that leaves mid-stream frees its KV blocks, and the router gauges move while requests run."""

from __future__ import annotations

import asyncio
import shutil
import threading
import time
import urllib.request
from pathlib import Path

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from loraplex.clients import AsyncLoraplexClient, LoraplexClient
from loraplex.inference_server.model.checkpoint import ModelSource
from served_adapters import ADAPTERS, PROMPTS, _wait_idle, peft_sources  # noqa: F401  (fixture)
from http_engine import NEW_TOKENS, _serve

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def live(tiny_llama_dir: Path, peft_sources: dict[str, Path], tmp_path_factory: pytest.TempPathFactory):  # noqa: F811
    store = tmp_path_factory.mktemp("store")
    for name in ADAPTERS:
        shutil.copytree(peft_sources[name], store / name)
    srv, engine, url = _serve(ModelSource(path=str(tiny_llama_dir)), store)
    yield srv, engine, url
    srv.close()


async def _over_http(url: str, base: str, jobs: list[tuple[str, str | None, bool, bool]]) -> list[str]:
    """Each job (prompt, adapter, chat?, stream?) over HTTP at once; the answers' texts."""
    async with openai.AsyncOpenAI(base_url=url, api_key="x", max_retries=0, timeout=120) as client:
        async def one(prompt: str, adapter: str | None, chat: bool, stream: bool) -> str:
            common = dict(model=adapter or base, max_tokens=NEW_TOKENS, temperature=0, stream=stream,
                          extra_body={"ignore_eos": True})
            if chat:
                out = await client.chat.completions.create(messages=[{"role": "user", "content": prompt}], **common)
                if not stream:
                    return out.choices[0].message.content
                return "".join([c.choices[0].delta.content or "" async for c in out])
            out = await client.completions.create(prompt=prompt, **common)
            return "".join([c.choices[0].text async for c in out]) if stream else out.choices[0].text
        return await asyncio.gather(*(one(*job) for job in jobs))


async def _over_grpc(address: str, jobs: list[tuple[str, str | None, bool, bool]]) -> list[str]:
    async with AsyncLoraplexClient(address) as client:
        async def one(prompt: str, adapter: str | None, chat: bool, _: bool) -> str:
            kind = {"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt}
            out = await client.generate_text(**kind, adapter=adapter, max_new_tokens=NEW_TOKENS, ignore_eos=True)
            return out.text
        return await asyncio.gather(*(one(*job) for job in jobs))


def _jobs(adapters: list[str | None], n: int) -> list[tuple[str, str | None, bool, bool]]:
    return [(PROMPTS[i % len(PROMPTS)], adapters[i % len(adapters)], i % 2 == 0, i % 4 < 2) for i in range(n)]


def test_16_concurrent_mixed_requests_equal_the_grpc_answers(live) -> None:
    srv, engine, url = live
    jobs = _jobs([None, *ADAPTERS], 16)
    http_texts = asyncio.run(_over_http(url, engine.info.model_name, jobs))
    grpc_texts = asyncio.run(_over_grpc(srv.address, jobs))
    assert http_texts == grpc_texts
    same_prompt = [t for t, (p, _, chat, _) in zip(http_texts, jobs) if p == PROMPTS[0] and chat]
    assert len(same_prompt) >= 2 and len(set(same_prompt)) == len(same_prompt)  # its adapters answer differently
    _wait_idle(engine)


def test_uploads_list_at_once_and_generate(live, peft_sources: dict[str, Path]) -> None:  # noqa: F811
    srv, engine, url = live
    client = openai.OpenAI(base_url=url, api_key="x", max_retries=0)
    before = {m.id for m in client.models.list()}
    assert before == {engine.info.model_name, *ADAPTERS}
    with LoraplexClient(srv.address) as grpc_client:
        grpc_client.upload_adapter("acme/extra", peft_sources["extra"])
    listed = {m.id: m for m in client.models.list()}
    assert listed["acme/extra"].parent == engine.info.model_name
    assert client.completions.create(model="acme/extra", prompt="Hi", max_tokens=3).usage.completion_tokens <= 3


def test_disconnect_mid_stream_frees_the_kv_blocks(live) -> None:
    _, engine, url = live
    _wait_idle(engine)
    client = openai.OpenAI(base_url=url, api_key="x", max_retries=0)
    stream = client.completions.create(model=ADAPTERS[0], prompt="Tell me a long story.", max_tokens=1000,
                                       stream=True, extra_body={"ignore_eos": True})
    next(iter(stream))
    assert engine.stats().free_kv_blocks < engine.stats().total_kv_blocks
    stream.close()
    _wait_idle(engine)


def _scrape(url: str) -> dict:
    text = urllib.request.urlopen(url.removesuffix("/v1") + "/metrics", timeout=5).read().decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_router_gauges_move_while_requests_run(live) -> None:
    _, engine, url = live
    _wait_idle(engine)
    client = openai.OpenAI(base_url=url, api_key="x", max_retries=0)

    def run(model: str) -> None:
        client.completions.create(model=model, prompt="Count.", max_tokens=300, extra_body={"ignore_eos": True})

    threads = [threading.Thread(target=run, args=(m,)) for m in (ADAPTERS[0], ADAPTERS[1], ADAPTERS[0])]
    for t in threads:
        t.start()
    seen_running, seen_adapters, seen_usage = 0.0, set(), 0.0
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not (seen_running == 3 and len(seen_adapters) == 2):
        families = _scrape(url)
        seen_running = max(seen_running, families["vllm:num_requests_running"].samples[0].value)
        seen_usage = max(seen_usage, families["vllm:kv_cache_usage_perc"].samples[0].value)
        info = families["vllm:lora_requests_info"].samples[0].labels
        seen_adapters |= set(filter(None, info["running_lora_adapters"].split(",")))
        time.sleep(0.05)
    for t in threads:
        t.join(120)
    assert seen_running == 3 and seen_adapters == {ADAPTERS[0], ADAPTERS[1]} and 0 < seen_usage <= 1
    _wait_idle(engine)
    idle = _scrape(url)
    assert idle["vllm:num_requests_running"].samples[0].value == 0
    assert idle["vllm:lora_requests_info"].samples[0].labels["running_lora_adapters"] == ""


def test_smollm2_chat_over_http_equals_grpc(smollm2_gguf: str, tmp_path: Path) -> None:
    srv, engine, url = _serve(ModelSource(path=smollm2_gguf), tmp_path / "adapters")
    try:
        jobs = [("What is the capital of France?", None, True, True), ("Say hello.", None, True, False),
                ("Once upon a time", None, False, True), ("The sky is", None, False, False)]
        assert asyncio.run(_over_http(url, engine.info.model_name, jobs)) == asyncio.run(_over_grpc(srv.address, jobs))
    finally:
        srv.close()
