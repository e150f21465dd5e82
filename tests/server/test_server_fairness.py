"""A flooding tenant does not starve another: 200 queued requests from A, then one from B,
over gRPC against the real engine (tiny random Llama on the CPU), tenants from tokens."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest
from server_helpers import ServerThread

from loraplex.clients import AsyncLoraplexClient
from loraplex.inference_server.auth.security import Security
from loraplex.inference_server.auth.tokens import TokenFile, hash_token
from loraplex.inference_server.build import build_engine
from loraplex.inference_server.engine.async_engine import AsyncEngine
from loraplex.inference_server.engine.config import EngineConfig
from loraplex.inference_server.model.checkpoint import ModelSource
from loraplex.inference_server.server.app import ServerOptions

pytestmark = pytest.mark.slow
TOKENS = {"a": "token-tenant-a-0123456789", "b": "token-tenant-b-0123456789"}
FLOOD, A_TOKENS, B_TOKENS, BATCH = 200, 32, 8, 4  # A's requests outlast B's trip through the edge


@pytest.fixture
def fair_server(tiny_llama_dir: Path, tmp_path: Path):
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps({"tokens": [{"sha256": hash_token(t), "tenant": who, "role": "tenant"}
                                             for who, t in TOKENS.items()]}))
    srv = ServerThread(ServerOptions(port=0), security=Security(tokens=TokenFile(str(tokens))))
    config = EngineConfig(num_kv_blocks=128, block_size=16, max_num_seqs=BATCH, max_num_batched_tokens=256)
    engine = build_engine(AsyncEngine, config, ModelSource(path=str(tiny_llama_dir)), tmp_path / "adapters",
                          progress=False)
    srv.attach(engine)
    yield srv, engine
    srv.close(grace_s=0.5)


async def _flood(address: str, engine: AsyncEngine) -> tuple[int, float, float]:
    """(A's requests that got their first token before B's, B's time to first token, one request alone)."""
    firsts: dict[str, float] = {}

    async def run(client: AsyncLoraplexClient, who: str, new_tokens: int) -> None:
        async for event in client.generate(f"request {who} says hello", max_new_tokens=new_tokens,
                                           ignore_eos=True, timeout=120):
            if event.token_ids and who not in firsts:
                firsts[who] = time.monotonic()

    async with AsyncLoraplexClient(address, token=TOKENS["a"], timeout=120) as a, \
            AsyncLoraplexClient(address, token=TOKENS["b"], timeout=120) as b:
        start = time.monotonic()
        await run(b, "warm-up", A_TOKENS)
        alone = time.monotonic() - start
        flood = [asyncio.create_task(run(a, f"a{i}", A_TOKENS)) for i in range(FLOOD)]
        deadline = time.monotonic() + 60
        while engine.stats().num_waiting < FLOOD - 2 * BATCH - 8:  # A's flood is queued in the engine
            assert time.monotonic() < deadline, f"flood not queued: {engine.stats()}"
            await asyncio.sleep(0.01)
        sent = time.monotonic()
        await run(b, "b", B_TOKENS)
        b_ttft = firsts["b"] - sent
        before_b = sum(1 for who, t in firsts.items() if who.startswith("a") and t < firsts["b"])
        for task in flood:
            task.cancel()
        await asyncio.gather(*flood, return_exceptions=True)
    return before_b, b_ttft, alone


def test_flood_from_one_tenant_does_not_starve_another(fair_server) -> None:
    srv, engine = fair_server
    before_b, b_ttft, alone = srv.call(_flood(srv.address, engine), timeout=300)
    # FCFS would give B its first token after all 200 of A's; round-robin admits it at the next free
    # slot, so only the batch running when B arrived and one admission round of A's go first.
    assert before_b <= 3 * BATCH, f"{before_b} of A's requests got a first token before B's"
    # In time: about one of A's requests (a slot frees), not the flood's 200 / 4 requests' lengths.
    assert b_ttft < 10 * alone + 1.0, f"B waited {b_ttft:.2f}s; one request alone takes {alone:.2f}s"
