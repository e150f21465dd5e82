"""Adapter-aware admission: a request whose adapter finds the pool full of in-use adapters is
queued until a place frees (never refused), and a caller that leaves while it waits gives its
place in the queue back and pins nothing."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from pathlib import Path

import pytest
import torch

from lora_helpers import collect, greedy_request, load_engine, make_peft_adapter, run_all, tokens_of

from loraplex.inference_server.engine.config import EngineConfig
from loraplex.inference_server.lora.local_directory import LocalAdapterDirectory
from loraplex.inference_server.lora.pool.adapter_pool import AcquireCancelled, AdapterPool
from loraplex.inference_server.lora.pool.packing import plan_layout

NAMES = ("a0", "a1", "a2", "a3")


@pytest.fixture(scope="module")
def four_adapters(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import AutoModelForCausalLM

    hf_model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    root = tmp_path_factory.mktemp("admission")
    for seed, name in enumerate(NAMES):
        make_peft_adapter(hf_model, root / name, dict(r=8, target_modules=["q_proj", "v_proj"]), seed=seed, std=0.1)
    return root


def _one_adapter_bytes(tiny_llama_dir: Path, root: Path) -> int:
    probe = load_engine(tiny_llama_dir, root)
    size = plan_layout(probe.adapters.resolve("a0").spec, probe._core.runner.config).num_elements
    return (size + 64) * 4  # float32, one allocation's alignment


def _pool(root: Path, tiny_llama_dir: Path, places: int) -> AdapterPool:
    probe = load_engine(tiny_llama_dir, root)
    cfg = probe._core.runner.config
    size = plan_layout(probe.adapters.resolve("a0").spec, cfg).num_elements
    return AdapterPool(LocalAdapterDirectory(root, cfg), cfg, places * (size + 64), torch.float32, "cpu")


def test_a_full_pool_queues_without_a_time_limit_by_default() -> None:
    assert EngineConfig().adapter_acquire_timeout_s is None


def test_a_cancelled_wait_leaves_the_queue_and_the_next_waiter_is_served(
    tiny_llama_dir: Path, four_adapters: Path,
) -> None:
    pool = _pool(four_adapters, tiny_llama_dir, places=2)
    held = [pool.acquire("a0"), pool.acquire("a1")]
    cancel, outcome, later = threading.Event(), [], []

    def first() -> None:
        try:
            outcome.append(pool.acquire("a2", cancel))
        except AcquireCancelled as e:
            outcome.append(e)

    waiter = threading.Thread(target=first)
    waiter.start()
    time.sleep(1.5)  # still queued: no bound of its own
    assert waiter.is_alive() and pool.stats().waiting == 1
    behind = threading.Thread(target=lambda: later.append(pool.acquire("a3")))
    behind.start()
    time.sleep(0.2)
    pool.cancel_wait(cancel)
    waiter.join(timeout=2)
    assert not waiter.is_alive() and isinstance(outcome[0], AcquireCancelled)
    pool.release(held[0])  # the place goes to the waiter behind, not to the one that left
    behind.join(timeout=5)
    assert later and later[0].adapter_id == "a3"
    assert set(pool.resident_ids()) == {"a1", "a3"} and pool.stats().waiting == 0


def test_cold_requests_wait_for_running_ones_and_a_caller_that_left_pins_nothing(
    tiny_llama_dir: Path, four_adapters: Path,
) -> None:
    """A pool of one place: a1's request waits while a0's runs; b leaves while it waits; once a0's
    request ends, a2's request is served (a place pinned by the caller that left would stall it),
    with the tokens of an engine whose pool holds every adapter."""
    one = _one_adapter_bytes(tiny_llama_dir, four_adapters)
    engine = load_engine(tiny_llama_dir, four_adapters, adapter_pool_bytes=one, max_num_seqs=4,
                         max_num_batched_tokens=256)
    prompt = engine.tokenizer.encode("Tell me about the sea")
    running, queued, leaving, after = (greedy_request(r, prompt, a, n) for r, a, n in
                                       (("run", "a0", 200), ("queued", "a1", 8), ("leaves", "a3", 8), ("after", "a2", 8)))

    async def main() -> dict[str, list[int]]:
        await engine.start()
        try:
            first = asyncio.create_task(collect(engine, running))
            while engine.stats().num_running == 0:
                await asyncio.sleep(0.01)
            waiting = asyncio.create_task(collect(engine, queued))
            gone = asyncio.create_task(collect(engine, leaving))
            while engine.pool_stats().waiting < 2:  # both wait for a0's place
                await asyncio.sleep(0.005)
            assert not first.done(), "the running request ended before the others queued: lengthen it"
            gone.cancel()
            got = {"run": tokens_of(await first), "queued": tokens_of(await asyncio.wait_for(waiting, 30))}
            got["after"] = tokens_of(await asyncio.wait_for(collect(engine, after), 30))
            with pytest.raises(asyncio.CancelledError):
                await gone
            stats = engine.pool_stats()
            assert stats.in_use == 0 and stats.waiting == 0, "a reference or a queue place outlived its caller"
            assert "a3" not in engine.adapters.resident_ids()
            return got
        finally:
            await engine.shutdown()

    got = asyncio.run(main())
    everything = load_engine(tiny_llama_dir, four_adapters, adapter_pool_bytes=8 * one)
    expected = run_all(everything, [running, queued, after])
    assert got == {rid: tokens_of(events) for rid, events in expected.items()}


def test_an_adapter_larger_than_the_whole_pool_is_refused_for_good_not_retry_later(
    tiny_llama_dir: Path, four_adapters: Path, tmp_path: Path,
) -> None:
    """A pool smaller than one adapter can never serve it: its request gets an error naming the
    sizes that a retry cannot change (400 / INVALID_ARGUMENT, not 429), and an upload to this
    server's own adapter directory is refused the same way before anything is stored."""
    from loraplex.adapter_store.errors import AdapterValidationError

    half = _one_adapter_bytes(tiny_llama_dir, four_adapters) // 2
    engine = load_engine(tiny_llama_dir, four_adapters, adapter_pool_bytes=half)
    request = greedy_request("big", engine.tokenizer.encode("Hi"), "a0", 4)

    async def main() -> None:
        await engine.start()
        try:
            with pytest.raises(AdapterValidationError, match=r"'a0' \(rank 8\) needs \d+ bytes of the adapter pool, "
                                                             r"which holds \d+ on this server"):
                await asyncio.wait_for(collect(engine, request), 30)
        finally:
            await engine.shutdown()

    asyncio.run(main())
    files = {p.name: p.read_bytes() for p in (four_adapters / "a1").iterdir()}
    with pytest.raises(AdapterValidationError, match="cannot be served here"):
        engine.adapters.put("new", files)
    assert "new" not in [i.adapter_id for i in engine.adapters.list()]


def test_a_request_admitted_for_one_version_never_runs_the_version_that_replaced_it_while_it_waited(
    tiny_llama_dir: Path, four_adapters: Path, tmp_path: Path,
) -> None:
    """Another tenant's public adapter is admitted for the version whose record was read (the edge
    pins it); re-uploaded while the request waits for pool space (as private, new weights), the
    request ends NOT_FOUND instead of generating with the new version. Unpinned, it runs the new one."""
    import shutil

    from loraplex.adapter_store.errors import AdapterNotFoundError

    root = tmp_path / "adapters"
    shutil.copytree(four_adapters, root)
    one = _one_adapter_bytes(tiny_llama_dir, four_adapters)
    engine = load_engine(tiny_llama_dir, root, adapter_pool_bytes=one, max_num_seqs=4, max_num_batched_tokens=256)
    prompt = engine.tokenizer.encode("Tell me about the sea")
    admitted = engine.adapters.get("a1").version
    pinned = dataclasses.replace(greedy_request("pinned", prompt, "a1", 8), adapter_version=admitted)
    unpinned = greedy_request("unpinned", prompt, "a1", 8)
    replacement = {p.name: p.read_bytes() for p in (four_adapters / "a2").iterdir()}

    async def main():
        await engine.start()
        try:
            running = asyncio.create_task(collect(engine, greedy_request("run", prompt, "a0", 200)))
            while engine.stats().num_running == 0:
                await asyncio.sleep(0.01)
            waiting = [asyncio.create_task(collect(engine, r)) for r in (pinned, unpinned)]
            while engine.pool_stats().waiting < 2:
                await asyncio.sleep(0.005)
            assert not running.done(), "the running request ended before the others queued: lengthen it"
            await asyncio.to_thread(engine.adapters.put, "a1", replacement)  # a new version, a2's weights
            await running
            return await asyncio.gather(*waiting, return_exceptions=True)
        finally:
            await engine.shutdown()

    pinned_result, unpinned_result = asyncio.run(main())
    assert isinstance(pinned_result, AdapterNotFoundError), pinned_result
    assert engine.adapters.get("a1").version != admitted
    expected = run_all(load_engine(tiny_llama_dir, four_adapters), [greedy_request("x", prompt, "a2", 8)])
    assert tokens_of(unpinned_result) == tokens_of(expected["x"])  # the new weights, as a2's
