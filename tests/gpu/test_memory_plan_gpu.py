"""Memory at start on the GPU (#40 item 4): the profile run measures what steps need beyond the
KV cache and adapter pool, and the server sizes both around it, so the largest batch it can
schedule never runs out of memory in a forward.

The 7B test is the case that ran out of memory in ``silu_and_mul`` on an H100 (bench_textgen at
max batch 256 with 256 distinct adapters and ``--kv-fraction 0.7``): the real server process,
started with those flags, serves a full batch of 256 requests for 256 distinct adapters. It runs
first: it needs the GPU to itself (a server process beside this one's engines sees less free)."""

from __future__ import annotations

import asyncio
import gc
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from benchmarks.common.random_adapters import peft_files
from loraplex.inference_server.engine.config import EngineConfig
from loraplex.inference_server.engine.profile_run import measure_reserve
from loraplex.inference_server.model.dummy import preset_config
from lora_helpers import ADAPTER_CONFIGS, greedy_request, load_engine, make_test_adapters, run_all, tokens_of
from server_helpers import free_port
from server_process import REPO

GiB = 1 << 30


def _write_adapters(root: Path, count: int, rank: int) -> None:
    """``count`` PEFT folders for the llama-7b preset sharing one weights file (hard links: 80 MB
    on disk, not 20 GB); each id is still its own copy in the GPU pool."""
    files = peft_files(preset_config("llama-7b"), rank)
    weights = root / "weights.safetensors"
    weights.write_bytes(files["adapter_model.safetensors"])
    for i in range(count):
        folder = root / "adapters" / f"a{i}"
        folder.mkdir(parents=True)
        (folder / "adapter_config.json").write_bytes(files["adapter_config.json"])
        os.link(weights, folder / "adapter_model.safetensors")


def _gauge(port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


async def _full_batch(address: str, count: int, new_tokens: int) -> list:
    from loraplex.clients.async_client import AsyncLoraplexClient

    async with AsyncLoraplexClient(address, timeout=600) as client:
        await client.wait_until_serving(timeout=600)
        return await asyncio.gather(*(client.generate_text(token_ids=[3 + i, 11, 29, 7] * 16, adapter=f"a{i}",
                                                           max_new_tokens=new_tokens, ignore_eos=True)
                                      for i in range(count)))


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_properties(0).total_memory < 70 * GiB,
                    reason="needs a GPU of 80 GB (the H100 the issue names) or more")
def test_a_7b_server_at_batch_256_with_256_distinct_adapters_runs_a_full_batch(tmp_path: Path) -> None:
    gc.collect()
    torch.cuda.empty_cache()  # what earlier tests of this process freed goes back to the driver
    free = torch.cuda.mem_get_info()[0]
    assert free > 60 * GiB, f"{free / GiB:.1f} GiB free: something in this process still holds GPU memory"
    _write_adapters(tmp_path, 256, rank=16)
    adapter_bytes = (tmp_path / "weights.safetensors").stat().st_size
    port, metrics = free_port(), free_port()
    env = {**os.environ, "LORAPLEX_HTTP_PORT": "0", "LORAPLEX_METRICS_PORT": str(metrics)}
    log = open(tmp_path / "server.log", "w")
    # bench_textgen's flags that ran out of memory: a pool for 264 adapters, 0.7 of the memory to the KV cache
    proc = subprocess.Popen(
        [sys.executable, "-P", "-m", "loraplex.inference_server.main", "--model-format", "dummy", "--model",
         "llama-7b", "--device", "cuda", "--dtype", "bfloat16", "--port", str(port), "--adapter-dir",
         str(tmp_path / "adapters"), "--max-num-seqs", "256", "--max-lora-rank", "16",
         "--adapter-pool-bytes", str(264 * adapter_bytes), "--kv-cache-memory-fraction", "0.7"],
        cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        running = []

        async def run() -> list:
            task = asyncio.ensure_future(_full_batch(f"127.0.0.1:{port}", 256, 64))
            while not task.done():
                if proc.poll() is not None:
                    task.cancel()
                    break
                try:
                    running.append(_gauge(metrics, "loraplex_running_requests"))
                except OSError:
                    pass  # not listening yet
                await asyncio.sleep(0.2)
            return await task

        start = time.monotonic()
        results = asyncio.run(run())
        assert proc.poll() is None, (tmp_path / "server.log").read_text()[-4000:]
        assert [len(r.token_ids) for r in results] == [64] * 256
        assert max(running) == 256, f"the largest batch seen was {max(running, default=0)}"
        assert _gauge(metrics, "loraplex_resident_adapters") >= 256
        print(f"256 requests of 64 tokens in {time.monotonic() - start:.1f} s")
    finally:
        proc.kill()
        proc.wait(30)
        print((tmp_path / "server.log").read_text()[-3000:])


@pytest.fixture(scope="module")
def adapter_dir(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_test_adapters(tiny_llama_dir, tmp_path_factory.mktemp("memory-adapters"))


def _same_tokens(a, b, requests) -> None:
    got, expected = run_all(a, requests), run_all(b, requests)
    assert {k: tokens_of(v) for k, v in got.items()} == {k: tokens_of(v) for k, v in expected.items()}


def test_profile_run_measures_the_largest_steps_and_an_engine_sized_by_it_serves(
        tiny_llama_dir: Path, adapter_dir: Path) -> None:
    small = load_engine(tiny_llama_dir, adapter_dir, device="cuda", dtype="bfloat16", num_kv_blocks=256)
    model_config = small._core.runner.config
    config = EngineConfig(device="cuda", dtype="bfloat16", max_num_seqs=64, max_num_batched_tokens=1024)
    reserve = measure_reserve(small._core.runner.model, model_config, config, 1024, (1, 2, 4, 8, 64))
    # a 1024-token prefill's logits alone (256-row chunks of V float32s) are in the peak
    assert reserve.activations >= 256 * model_config.vocab_size * 4
    assert reserve.buffers > 0 and reserve.graphs > 0
    # sized from memory (no --num-kv-blocks): the same tokens as the engine with a fixed cache
    sized = load_engine(tiny_llama_dir, adapter_dir, device="cuda", dtype="bfloat16", num_kv_blocks=None,
                        kv_cache_memory_fraction=0.02, adapter_pool_memory_fraction=0.01, max_num_seqs=64, max_num_batched_tokens=1024)
    assert sized._core.blocks.num_blocks > 256
    names = [None, *ADAPTER_CONFIGS]
    _same_tokens(sized, small, [greedy_request(f"r{i}", [5 + i, 17, 3, 9], names[i % len(names)], 12)
                                for i in range(10)])
