"""Packing on the GPU: the CUDA pool after a source load and after a host-tier hit equals the
CPU reference packing element for element, and the load (one pinned H2D copy plus the
layout ops on the side stream) does not wait for the compute stream."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from adapter_bytes import ALL, CASES, CFG, adapter_files, reference

from loraplex.adapter_store.format.files import AdapterFiles, make_info
from loraplex.adapter_store.format.peft_format import parse_adapter_files
from loraplex.inference_server.lora.pool.adapter_pool import AdapterPool
from loraplex.inference_server.lora.pool.packing import plan_layout
from loraplex.inference_server.model.config import ModelConfig


class MemorySource:
    """AdapterSource over in-memory PEFT files, one set of files per id."""

    def __init__(self, files: dict[str, dict[str, bytes]], base: ModelConfig) -> None:
        self.files, self.base = files, base

    def resolve(self, adapter_id: str) -> AdapterFiles:
        files = self.files[adapter_id]
        spec = parse_adapter_files(files, self.base)
        return AdapterFiles(make_info(adapter_id, files, spec, 0.0), spec, files)


def _manager(files: dict[str, dict[str, bytes]], cfg: ModelConfig, pool: torch.dtype, adapters_fit: int):
    biggest = max(plan_layout(parse_adapter_files(f, cfg), cfg).num_elements for f in files.values())
    return AdapterPool(MemorySource(files, cfg), cfg, adapters_fit * (biggest + 64), pool, "cuda",
                          host_cache_bytes=64 << 20)


@pytest.mark.parametrize(("src", "pool"), [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.bfloat16),
                                           (torch.float32, torch.bfloat16), (torch.float32, torch.float32),
                                           (torch.bfloat16, torch.float32)])
def test_gpu_pool_equals_the_reference_packing(src: torch.dtype, pool: torch.dtype) -> None:
    files = {case: adapter_files(CFG, config, src, seed=i, shuffle=True) for i, (case, config) in enumerate(CASES.items())}
    mgr = _manager(files, CFG, pool, adapters_fit=1)  # every load evicts the previous one
    for case in [*files, *files]:  # the second round is served by the host tier
        mgr.pool.fill_(float("nan"))
        ra = mgr.acquire(case)
        got = mgr.pool[ra.start : ra.start + ra.layout.num_elements].cpu()
        assert torch.equal(got, reference(files[case], CFG, pool)), case
        mgr.release(ra)
    assert mgr.stats().counters["host_hits"] == len(files)


def test_gpu_load_overlaps_compute() -> None:
    """A 7B-shaped adapter (8 layers, ~20 MB) loads from the host tier while a long matmul
    chain still runs on the compute stream, and lands correctly."""
    cfg = ModelConfig(model_type="llama", vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                      num_layers=8, num_heads=32, num_kv_heads=32, head_dim=128)
    files = {"a": adapter_files(cfg, dict(r=16, lora_alpha=32, target_modules=ALL), torch.bfloat16, 0, False),
             "b": adapter_files(cfg, dict(r=16, lora_alpha=32, target_modules=ALL), torch.bfloat16, 1, False)}
    mgr = _manager(files, cfg, torch.bfloat16, adapters_fit=1)
    mgr.release(mgr.acquire("a"))
    mgr.release(mgr.acquire("b"))  # "a" now only in the host tier
    x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(40):
        x = (x @ x).clamp_(-1, 1)
    end.record()
    t0 = time.perf_counter()
    got = []
    loader = threading.Thread(target=lambda: got.append(mgr.acquire("a")))
    loader.start()
    loader.join(timeout=30)
    load_s = time.perf_counter() - t0
    still_running = not end.query()
    torch.cuda.synchronize()
    ra = got[0]
    assert torch.equal(mgr.pool[ra.start : ra.start + ra.layout.num_elements].cpu(),
                       reference(files["a"], cfg, torch.bfloat16))
    assert still_running, f"compute finished before the {load_s * 1e3:.1f} ms load: no overlap shown"
    assert load_s * 1e3 < start.elapsed_time(end), "the load waited for the compute stream"
