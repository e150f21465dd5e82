"""Packing on the device (raw PEFT bytes staged, laid out by batched ops) equals the reference
CPU packing element for element: ranks, rank/alpha patterns, layer subsets, target subsets,
source and pool dtypes, any tensor order in the file. On CPU here; tests/gpu runs the same
on CUDA."""

from __future__ import annotations

import pytest
import torch

from adapter_bytes import ALL, CASES, CFG, adapter_files, reference

from loraplex.adapter_store.format.peft_format import parse_adapter_files
from loraplex.inference_server.lora.pool.device_packing import plan_device_pack, stage, unpack
from loraplex.inference_server.lora.pool.packing import plan_layout
from loraplex.inference_server.model.config import ModelConfig


def device_packed(files: dict[str, bytes], cfg: ModelConfig, dtype: torch.dtype, garbage: float) -> torch.Tensor:
    spec = parse_adapter_files(files, cfg)
    layout = plan_layout(spec, cfg)
    weights = files["adapter_model.safetensors"]
    plan, table = plan_device_pack(spec, weights, layout, cfg)
    staged = torch.empty(plan.staged_bytes, dtype=torch.uint8)
    stage(weights, plan, table, staged)
    dst = torch.full((layout.num_elements,), garbage, dtype=dtype)  # a reused pool range
    unpack(dst, staged, plan, layout)
    return dst


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize(("src", "pool"), [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32),
                                           (torch.float16, torch.bfloat16), (torch.float32, torch.bfloat16),
                                           (torch.bfloat16, torch.float32), (torch.float16, torch.float32)])
def test_device_packing_equals_the_reference(case: str, src: torch.dtype, pool: torch.dtype) -> None:
    files = adapter_files(CFG, CASES[case], src, seed=len(case), shuffle=True)
    expected = reference(files, CFG, pool)
    got = device_packed(files, CFG, pool, garbage=float("nan"))
    assert torch.equal(got, expected)


def test_file_order_does_not_matter() -> None:
    ordered = adapter_files(CFG, CASES["mixed-ranks"], torch.float32, seed=1, shuffle=False)
    shuffled = adapter_files(CFG, CASES["mixed-ranks"], torch.float32, seed=1, shuffle=True)
    assert ordered["adapter_model.safetensors"] != shuffled["adapter_model.safetensors"]
    assert torch.equal(device_packed(ordered, CFG, torch.float32, 1.0), device_packed(shuffled, CFG, torch.float32, 2.0))


def test_gather_works_in_large_chunks_for_a_7b_shaped_adapter() -> None:
    """The gather index has one entry per chunk, not per element: small next to the data."""
    cfg = ModelConfig(model_type="llama", vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_layers=2,
                      num_heads=32, num_kv_heads=32, head_dim=128)
    files = adapter_files(cfg, dict(r=16, lora_alpha=32, target_modules=ALL), torch.bfloat16, seed=0, shuffle=True)
    spec = parse_adapter_files(files, cfg)
    plan, table = plan_device_pack(spec, files["adapter_model.safetensors"], plan_layout(spec, cfg), cfg)
    assert plan.chunk == 16 * 256 and table.numel() == plan.num_chunks == plan.data_bytes // 2 // plan.chunk
    assert all(g.whole for g in plan.groups) and len(plan.groups) == 7 and plan.zero_ranges == ()


@pytest.mark.parametrize("pool", [torch.bfloat16, torch.float32])
def test_manager_loads_and_host_hits_give_the_reference_layout(tmp_path, pool: torch.dtype) -> None:
    """Source load, then a host-tier hit after eviction, each into a pool range holding garbage."""
    from loraplex.inference_server.lora.pool.adapter_pool import AdapterPool
    from loraplex.inference_server.lora.local_directory import LocalAdapterDirectory

    source = LocalAdapterDirectory(tmp_path, CFG)
    cases = {"mixed": (CASES["mixed-ranks"], torch.float16), "layers": (CASES["layers-subset"], torch.float32),
             "all": (CASES["r16"], torch.bfloat16)}
    files = {name: adapter_files(CFG, config, dtype, seed=i, shuffle=i % 2 == 0)
             for i, (name, (config, dtype)) in enumerate(cases.items())}
    for name, f in files.items():
        source.put(name, f)
    biggest = max(plan_layout(parse_adapter_files(f, CFG), CFG).num_elements for f in files.values())
    mgr = AdapterPool(source, CFG, biggest + 64, pool, "cpu", host_cache_bytes=1 << 20)
    for name in [*files, *files]:  # the second round evicts and hits the host tier
        mgr.pool.fill_(float("nan"))
        ra = mgr.acquire(name)
        got = mgr.pool[ra.start : ra.start + ra.layout.num_elements]
        assert torch.equal(got, reference(files[name], CFG, pool)), name
        mgr.release(ra)
    counters = mgr.stats().counters
    assert counters["source_fetches"] == 3 and counters["host_hits"] == 3


def test_a_tensor_outside_the_spec_is_refused_before_anything_is_staged() -> None:
    import dataclasses

    from loraplex.adapter_store.errors import AdapterValidationError

    files = adapter_files(CFG, CASES["r4"], torch.float32, seed=0, shuffle=False)
    spec = parse_adapter_files(files, CFG)
    partial = dataclasses.replace(spec, modules=spec.modules[:-1])
    with pytest.raises(AdapterValidationError, match="belong to none of the adapter's modules"):
        plan_device_pack(partial, files["adapter_model.safetensors"], plan_layout(partial, CFG), CFG)
