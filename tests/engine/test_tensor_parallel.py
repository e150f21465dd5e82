"""Tensor parallelism on the CPU (gloo): the sharded engine gives the unsharded engine's tokens.

World size 2 runs as real processes (rank 0 = the engine, started in a child process so a
failure can never hang pytest; it spawns rank 1 exactly as ``--tensor-parallel 2`` does).
World size 1 runs in-process and must equal the plain engine exactly.
"""

from __future__ import annotations

import multiprocessing
import traceback
from pathlib import Path

import pytest
import torch

from lora_helpers import ADAPTER_CONFIGS, greedy_request, load_engine, make_peft_adapter, run_all, tokens_of

from loraplex.adapter_store.format.peft_format import parse_adapter_files
from loraplex.inference_server.engine.async_engine import AsyncEngine
from loraplex.inference_server.build import build_engine
from loraplex.inference_server.engine.config import EngineConfig
from loraplex.inference_server.engine.request import FinishReason
from loraplex.inference_server.lora.local_directory import LocalAdapterDirectory
from loraplex.inference_server.lora.pool.packing import plan_layout
from loraplex.inference_server.model.checkpoint import ModelSource
from loraplex.inference_server.model.config import ModelConfig
from loraplex.inference_server.parallel.launch import build_parallel_engine
from loraplex.inference_server.parallel.lora import pack_shards
from loraplex.inference_server.parallel.shard import local_config
from loraplex.kernels.reference import _a_matrix, _b_matrix

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers."]
NEW_TOKENS = 12
ENGINE = dict(num_kv_blocks=128, block_size=16, max_num_seqs=32, max_num_batched_tokens=512)
RANK0_TIMEOUT_S = 150


@pytest.fixture(scope="module")
def adapter_dir(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import AutoModelForCausalLM

    hf_model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    out = tmp_path_factory.mktemp("tp-adapters")
    for seed, (name, kwargs) in enumerate(ADAPTER_CONFIGS.items()):
        make_peft_adapter(hf_model, out / name, kwargs, seed=seed, std=0.1)
    return out


@pytest.fixture(scope="module")
def workload(tiny_llama_dir: Path, adapter_dir: Path) -> tuple[list, dict[str, list[int]]]:
    """Every prompt with the base model and each adapter, all in one engine at once; the
    unsharded engine's greedy tokens for each."""
    engine = load_engine(tiny_llama_dir, adapter_dir, **ENGINE)
    prompts = [engine.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]
    requests = [greedy_request(f"{i}-{name}", p, name, NEW_TOKENS)
                for i, p in enumerate(prompts) for name in [None, *ADAPTER_CONFIGS]]
    expected = {rid: tokens_of(events) for rid, events in run_all(engine, requests).items()}
    for name in ADAPTER_CONFIGS:  # the adapters must matter, or the test proves nothing
        assert any(expected[f"{i}-{name}"] != expected[f"{i}-None"] for i in range(len(prompts))), name
    return requests, expected


def test_world_size_one_equals_the_plain_engine(tiny_llama_dir: Path, adapter_dir: Path, workload) -> None:
    requests, expected = workload
    engine = build_parallel_engine(AsyncEngine, EngineConfig(tensor_parallel_size=1, **ENGINE),
                                   ModelSource(path=str(tiny_llama_dir)), adapter_dir, progress=False)
    got = {rid: tokens_of(events) for rid, events in run_all(engine, requests).items()}
    assert got == expected


def test_launch_ahead_asked_for_under_tensor_parallelism_is_refused(tiny_llama_dir: Path, adapter_dir: Path) -> None:
    """Sharded steps run eager: --launch-ahead on names tensor parallelism as the reason."""
    config = EngineConfig(tensor_parallel_size=1, require_launch_ahead=True, **ENGINE)
    with pytest.raises(ValueError, match="--launch-ahead on needs CUDA graphs: tensor parallelism runs every step eager"):
        build_parallel_engine(AsyncEngine, config, ModelSource(path=str(tiny_llama_dir)), adapter_dir, progress=False)


def _rank0(model_dir: str, adapter_dir: str, requests: list, out) -> None:
    """Rank 0 in a child process: the engine with --tensor-parallel 2 (spawns rank 1)."""
    try:
        config = EngineConfig(tensor_parallel_size=2, **ENGINE)
        engine = build_engine(AsyncEngine, config, ModelSource(path=model_dir), adapter_dir, progress=False)
        model = engine._core.runner.model.model
        shapes = {"qkv": tuple(model.layers[0].self_attn.qkv_proj.base.weight.shape),
                  "down": tuple(model.layers[0].mlp.down_proj.base.weight.shape),
                  "embed": tuple(model.embed_tokens.weight.shape),
                  "kv_cache": tuple(engine._core.runner.kv_caches[0].shape)}
        tokens = {rid: tokens_of(events) for rid, events in run_all(engine, requests).items()}
        # a worker that dies fails the next step with an error instead of hanging it
        engine = build_engine(AsyncEngine, config, ModelSource(path=model_dir), adapter_dir, progress=False)
        for proc in engine._core.runner.peers.workers.procs:
            proc.kill()
            proc.join(10)
        after = run_all(engine, [requests[1]])[requests[1].request_id]
        out.put(("ok", tokens, shapes, after[-1].finish_reason))
    except BaseException:  # noqa: BLE001  (reported to the test)
        out.put(("error", traceback.format_exc()))


def _two_ranks(model_dir: Path, adapter_dir: Path, requests: list) -> tuple[tuple, int | None]:
    """(rank 0's report, its exit code): the engine with two ranks in a child process."""
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_rank0, args=(str(model_dir), str(adapter_dir), requests, out))
    proc.start()
    try:
        result = out.get(timeout=RANK0_TIMEOUT_S)
        proc.join(30)
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(10)
    return result, proc.exitcode


def test_two_ranks_give_the_single_process_tokens(tiny_llama_dir: Path, adapter_dir: Path, workload) -> None:
    requests, expected = workload
    result, exitcode = _two_ranks(tiny_llama_dir, adapter_dir, requests)
    assert result[0] == "ok", result[1]
    _, tokens, shapes, failed_reason = result
    mismatches = sorted(rid for rid in expected if tokens[rid] != expected[rid])
    assert not mismatches, f"tensor-parallel tokens differ for {mismatches}"
    # each rank holds half: 2 of 4 query heads, 1 of 2 kv heads (16 dims), half of the MLP and vocab
    assert shapes == {"qkv": (64, 64), "down": (64, 64), "embed": (49152 // 2, 64), "kv_cache": (2, 128, 16, 1, 16)}
    assert failed_reason is FinishReason.ERROR
    assert exitcode == 0


@pytest.mark.parametrize("case", ["phi3", "gemma3"])
def test_two_ranks_serve_other_families(case: str, smollm2_tokenizer_dir: Path, tmp_path: Path) -> None:
    """Phi-3's checkpoint fuses q/k/v and gate/up, and its adapters target those fused linears: each
    rank takes its heads' rows of every part (and of each fused B). Gemma 3: q/k norms, windows,
    local RoPE, embedding scale and the (1 + w) norms under sharding. Two ranks, the tokens of one."""
    from transformers import AutoModelForCausalLM

    from family_models import CASES, tiny_family_model

    folder = tiny_family_model(case, smollm2_tokenizer_dir, tmp_path / "model")
    hf_model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    for seed, (name, kwargs) in enumerate(CASES[case][2].items()):
        make_peft_adapter(hf_model, tmp_path / "adapters" / name, kwargs, seed=seed, std=0.2)
    engine = load_engine(folder, tmp_path / "adapters", **ENGINE)
    prompts = [engine.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]
    requests = [greedy_request(f"{i}-{name}", p, name, NEW_TOKENS)
                for i, p in enumerate(prompts) for name in [None, *CASES[case][2]]]
    expected = {rid: tokens_of(events) for rid, events in run_all(engine, requests).items()}
    result, _ = _two_ranks(folder, tmp_path / "adapters", requests)
    assert result[0] == "ok", result[1]
    tokens = result[1]
    assert sorted(rid for rid in expected if tokens[rid] != expected[rid]) == []


def test_kv_heads_must_divide_by_the_world_size(tiny_llama_dir: Path, adapter_dir: Path) -> None:
    cfg = ModelConfig("llama", 100, 64, 128, 2, 4, 2, 16)
    with pytest.raises(ValueError, match="does not divide the model's 2 KV heads"):
        local_config(cfg, 4)
    with pytest.raises(ValueError, match="KV heads"):  # refused before any process starts
        build_parallel_engine(AsyncEngine, EngineConfig(tensor_parallel_size=4, **ENGINE),
                              ModelSource(path=str(tiny_llama_dir)), adapter_dir, progress=False)


def test_adapter_shards_follow_s_lora(tiny_llama_dir: Path, adapter_dir: Path) -> None:
    """Column projections: A whole, B's columns split; row projections: A's rows split, B whole."""
    from safetensors.torch import load as load_safetensors

    directory = LocalAdapterDirectory(adapter_dir, None)
    files = directory.resolve("all-r16-rslora").files
    from loraplex.inference_server.model.hf_folder import read_config

    cfg = read_config(str(tiny_llama_dir))
    spec = parse_adapter_files(files, cfg)
    tensors = load_safetensors(files["adapter_model.safetensors"])
    flat, layout = pack_shards(spec, tensors, cfg, 2, torch.float32)
    n = layout.num_elements
    assert layout == plan_layout(spec, local_config(cfg, 2)) and flat.numel() == 2 * n
    for proj, p, fan_in, fan_out, column in [("q_proj", 0, 64, 32, True), ("v_proj", 2, 64, 16, True),
                                             ("o_proj", 3, 32, 64, False), ("down_proj", 6, 64, 64, False)]:
        a_full = tensors[f"base_model.model.model.layers.1.{_parent(proj)}.{proj}.lora_A.weight"].t()
        b_full = tensors[f"base_model.model.model.layers.1.{_parent(proj)}.{proj}.lora_B.weight"].t()
        for rank in range(2):
            shard = flat[rank * n : (rank + 1) * n]
            a = _a_matrix(shard, layout.a_offsets[p], 1, fan_in, 16)
            b = _b_matrix(shard, layout.b_offsets[p], 1, fan_out, 16)
            if column:
                assert torch.equal(a, a_full) and torch.equal(b, b_full[:, rank * fan_out : (rank + 1) * fan_out])
            else:
                assert torch.equal(a, a_full[rank * fan_in : (rank + 1) * fan_in]) and torch.equal(b, b_full)


def _parent(proj: str) -> str:
    return "mlp" if proj in ("gate_proj", "up_proj", "down_proj") else "self_attn"


def test_cli_flag_reaches_the_engine_config() -> None:
    from loraplex.inference_server.main import engine_config
    from loraplex.inference_server.settings import ServerSettings

    settings = ServerSettings.from_sources(["--tensor-parallel", "2", "--device", "cpu"], env={})
    assert engine_config(settings).tensor_parallel_size == 2
    assert ServerSettings.from_sources([], env={"LORAPLEX_TENSOR_PARALLEL": "4"}).tensor_parallel == 4
    with pytest.raises(ValueError, match="tensor-parallel"):
        ServerSettings.from_sources(["--tensor-parallel", "0"], env={})
