"""AsyncLoraplexClient against a server with a fake engine: streams, concurrency, cancellation,
uploads with progress, errors as client exceptions."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from loraplex.clients import AsyncLoraplexClient
from loraplex.clients.errors import DeadlineExceededError, InvalidArgumentError, NotFoundError
from loraplex.clients.requests import generate_request
from loraplex.inference_server.server.app import ServerOptions
from server_helpers import ByteTokenizer, FakeEngine, ServerThread, fake_tokens, write_fake_adapter


@pytest.fixture
def served(tmp_path: Path):
    srv = ServerThread(ServerOptions(port=0))
    engine = FakeEngine(tmp_path / "store")
    srv.attach(engine)
    yield srv, engine
    srv.close()


def test_concurrent_streams_each_get_their_own_tokens(served) -> None:
    srv, engine = served

    async def go() -> list:
        async with AsyncLoraplexClient(srv.address) as client:
            return await asyncio.gather(*(client.generate_text(f"prompt {i}", max_new_tokens=7) for i in range(20)))

    results = asyncio.run(go())
    for i, r in enumerate(results):
        assert list(r.token_ids) == fake_tokens(tuple(ByteTokenizer().encode(f"prompt {i}")), None, 7)
        assert r.usage.completion_tokens == 7


def test_breaking_out_of_the_stream_cancels_on_the_server(served) -> None:
    srv, engine = served
    engine.step_s = 0.02

    async def go() -> None:
        async with AsyncLoraplexClient(srv.address) as client:
            stream = client.generate("x", max_new_tokens=250)
            async for _ in stream:
                break
            await stream.aclose()
            for _ in range(200):
                if engine.aborted and not engine.running:
                    return
                await asyncio.sleep(0.01)

    asyncio.run(go())
    assert engine.aborted == [engine.requests[0].request_id] and not engine.running


def test_errors_and_deadline(served) -> None:
    srv, engine = served
    engine.step_s = 0.02

    async def go() -> None:
        async with AsyncLoraplexClient(srv.address) as client:
            with pytest.raises(NotFoundError):
                await client.generate_text("x", adapter="ghost")
            with pytest.raises(InvalidArgumentError) as info:
                await client.generate_text("x", repetition_penalty=0.0)
            assert info.value.field == "sampling.repetition_penalty"
            with pytest.raises(DeadlineExceededError):
                await client.generate_text("x", max_new_tokens=250, timeout=0.2)

    asyncio.run(go())


def test_upload_list_get_delete_with_progress(served, tmp_path: Path) -> None:
    srv, engine = served
    folder = write_fake_adapter(tmp_path / "a")
    seen: list[int] = []

    async def go() -> None:
        async with AsyncLoraplexClient(srv.address) as client:
            info = await client.upload_adapter("t/a", folder, progress=lambda sent, total: seen.append(sent))
            assert info.adapter_id == "t/a" and not info.public
            assert [a.adapter_id for a in await client.list_adapters()] == ["t/a"]
            assert (await client.get_adapter("t/a")).version == info.version
            assert (await client.upload_adapter("t/a", folder, public=True)).public
            assert [a.public for a in await client.list_adapters()] == [True]
            assert (await client.server_info()).model_name == "fake-llama"
            assert await client.health() == "SERVING"
            await client.delete_adapter("t/a")
            with pytest.raises(NotFoundError):
                await client.get_adapter("t/a")

    asyncio.run(go())
    assert seen[-1] == sum(f.stat().st_size for f in folder.iterdir())


def test_generate_request_needs_exactly_one_prompt_kind() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        generate_request()
    with pytest.raises(ValueError, match="exactly one"):
        generate_request("x", token_ids=[1])
    req = generate_request(messages=[{"role": "user", "content": "hi"}], stop="END", seed=3)
    assert req.WhichOneof("prompt") == "chat" and list(req.stopping.stop_strings) == ["END"]
    assert req.sampling.HasField("seed") and not req.sampling.HasField("top_p")


@pytest.mark.parametrize("n", [0, -1])
def test_generate_request_refuses_fewer_than_one_choice(n: int) -> None:
    # 0 would go out as unset (one choice); -1 does not fit the field
    with pytest.raises(ValueError, match=f"n: must be at least 1, got {n}"):
        generate_request("x", n=n)
    assert generate_request("x", n=2).n == 2
