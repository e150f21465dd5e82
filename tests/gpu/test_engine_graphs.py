"""The engine at speed on CUDA: decode steps replayed from CUDA graphs give the eager
engine's tokens; chunked prefill gives the unchunked tokens; SmolLM2 with adapters in
float32 on the GPU gives transformers + PEFT's tokens (the CPU float32 reference)."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import pytest
import torch

from lora_helpers import ADAPTER_CONFIGS, check_exact_against_peft, greedy_request, load_engine, make_test_adapters
from lora_helpers import run_all, tokens_of

TEXTS = ["Hello there, how are you?", "The quick brown fox", "Once upon a time", "1, 2, 3, 4,", "Rust or Go?",
         "A long time ago in a galaxy", "def main():", "Dear Sir or Madam,"]


@pytest.fixture(scope="module")
def adapter_dir(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_test_adapters(tiny_llama_dir, tmp_path_factory.mktemp("graph-adapters"))


def _requests(engine, n: int, new_tokens: int = 24) -> list:
    names = [None, *ADAPTER_CONFIGS]
    prompts = [engine.tokenizer.encode(t) for t in TEXTS]
    return [greedy_request(f"r{i}", prompts[i % len(prompts)], names[i % len(names)], new_tokens) for i in range(n)]


@pytest.mark.parametrize("n", [8, 5])  # 8: a captured size; 5: padded to 8
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_graph_replay_gives_the_eager_tokens(tiny_llama_dir: Path, adapter_dir: Path, dtype: str, n: int) -> None:
    eager = load_engine(tiny_llama_dir, adapter_dir, device="cuda", dtype=dtype, enforce_eager=True)
    graphs = load_engine(tiny_llama_dir, adapter_dir, device="cuda", dtype=dtype, max_num_seqs=16)
    assert eager._core.runner.graphs is None
    assert graphs._core.runner.graphs is not None
    expected = run_all(eager, _requests(eager, n))
    got = run_all(graphs, _requests(graphs, n))
    assert graphs._core.runner.graphs.replays >= 20  # the decode steps really replayed graphs
    assert {k: tokens_of(v) for k, v in got.items()} == {k: tokens_of(v) for k, v in expected.items()}


def _copy_step_state(dst, src) -> None:
    """Everything a graph replay reads: KV caches, adapter pool, LoRA tables, step buffers."""
    d, s = dst._core.runner, src._core.runner
    for a, b in zip(d.kv_caches, s.kv_caches, strict=True):
        a.copy_(b)
    d.lora_builder.pool.copy_(s.lora_builder.pool)
    d.lora_builder._dev_bytes.copy_(s.lora_builder._dev_bytes)
    d.graphs.dev_i64.copy_(s.graphs.dev_i64)
    d.graphs.dev_i32.copy_(s.graphs.dev_i32)


def test_lora_shrinks_beside_the_gemms_change_nothing(tiny_llama_dir: Path, adapter_dir: Path) -> None:
    """The LoRA graphs with each shrink on a side stream (the default) and on one stream run
    the same kernels on the same data: the same tokens, and from the same inputs the same
    logits bit for bit at every captured size."""
    side = load_engine(tiny_llama_dir, adapter_dir, device="cuda", dtype="bfloat16", max_num_seqs=8)
    one = load_engine(tiny_llama_dir, adapter_dir, device="cuda", dtype="bfloat16", max_num_seqs=8,
                      lora_side_stream=False)
    assert side._core.runner.graphs.lora_stream is not None and one._core.runner.graphs.lora_stream is None
    got = run_all(side, _requests(side, 8, new_tokens=32))
    expected = run_all(one, _requests(one, 8, new_tokens=32))
    assert side._core.runner.graphs.replays >= 30
    assert {k: tokens_of(v) for k, v in got.items()} == {k: tokens_of(v) for k, v in expected.items()}
    _copy_step_state(one, side)  # the last step's tables name real adapters in both pools
    for key, (graph, logits) in side._core.runner.graphs.graphs.items():
        if key[1]:
            other, other_logits = one._core.runner.graphs.graphs[key]
            _copy_step_state(one, side)  # replays write the KV cache: start each pair equal
            graph.replay()
            other.replay()
            torch.cuda.synchronize()
            assert torch.equal(logits, other_logits), f"graph {key}"


@pytest.mark.parametrize("side_stream", [True, False], ids=["side-stream", "one-stream"])
def test_a_step_graph_replayed_from_the_same_state_gives_the_same_logits(tiny_llama_dir: Path, adapter_dir: Path,
                                                                        side_stream: bool) -> None:
    """Reproducibility of one engine's step graphs: from the same KV caches, pool and tables
    every captured graph gives the same logits bit for bit, replay after replay (a race inside
    a graph, e.g. between the side stream's shrinks and the main stream, shows up here)."""
    engine = load_engine(tiny_llama_dir, adapter_dir, device="cuda", dtype="bfloat16", max_num_seqs=8,
                         lora_side_stream=side_stream)
    run_all(engine, _requests(engine, 8, new_tokens=8))  # the last step's tables name real adapters
    runner = engine._core.runner
    live = [*runner.kv_caches, runner.lora_builder._dev_bytes, runner.graphs.dev_i64, runner.graphs.dev_i32]
    state = [t.clone() for t in live]  # everything a replay reads (as _copy_step_state copies it)
    for key, (graph, logits) in runner.graphs.graphs.items():
        if not key[1]:
            continue
        first = None
        for _ in range(4):
            for t, saved in zip(live, state, strict=True):
                t.copy_(saved)  # replays write the KV cache: start each one equal
            graph.replay()
            torch.cuda.synchronize()
            if first is None:
                first = logits.clone()
            assert torch.equal(logits, first), f"graph {key}"


def test_graphs_serve_batches_that_shrink_and_grow(tiny_llama_dir: Path, adapter_dir: Path) -> None:
    """Requests of different lengths: the decode batch shrinks through several captured sizes,
    and a second wave refills it; every request still gets the eager engine's tokens."""
    eager = load_engine(tiny_llama_dir, adapter_dir, device="cuda", dtype="float16", enforce_eager=True,
                        max_num_seqs=8)
    graphs = load_engine(tiny_llama_dir, adapter_dir, device="cuda", dtype="float16", max_num_seqs=8)

    def requests(engine):
        reqs = _requests(engine, 14)
        return [greedy_request(r.request_id, r.prompt_token_ids, r.adapter_id, 4 + 3 * i) for i, r in enumerate(reqs)]

    expected = run_all(eager, requests(eager))
    got = run_all(graphs, requests(graphs))
    assert graphs._core.runner.graphs.replays > 0
    assert {k: tokens_of(v) for k, v in got.items()} == {k: tokens_of(v) for k, v in expected.items()}


def test_chunked_prefill_gives_the_unchunked_tokens(tiny_llama_dir: Path, adapter_dir: Path) -> None:
    """float32: a chunk attends to the cache through an explicit mask, a whole prompt through
    the causal kernel, so 16-bit results differ in rounding (not compared bitwise)."""
    dtype = "float32"
    whole = load_engine(tiny_llama_dir, adapter_dir, device="cuda", dtype=dtype, max_num_batched_tokens=2048,
                        max_num_seqs=8)
    chunked = load_engine(tiny_llama_dir, adapter_dir, device="cuda", dtype=dtype, max_num_batched_tokens=64,
                          max_num_seqs=8)
    long_text = " ".join(f"item {i} is {i * i % 97}." for i in range(120))

    def requests(engine):
        prompt = engine.tokenizer.encode(long_text)
        assert len(prompt) > 600
        names = [None, *ADAPTER_CONFIGS]
        return [greedy_request(f"c{i}", prompt[i * 7 :], names[i % len(names)], 16) for i in range(4)]

    expected = run_all(whole, requests(whole))
    got = run_all(chunked, requests(chunked))
    assert {k: tokens_of(v) for k, v in got.items()} == {k: tokens_of(v) for k, v in expected.items()}


def test_prompts_of_hundreds_of_tokens_beside_decodes_replay_graphs(tiny_llama_dir: Path, adapter_dir: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Prompts of ~300 tokens admitted while others decode: every step is a graph replay (no eager
    forward), and the tokens are those of an eager engine that runs the same spans on the paged
    decode kernel (the same arithmetic), for requests with and without adapters."""
    from loraplex.inference_server.engine import model_runner, step_plan

    def requests(engine):
        long_text = " ".join(f"item {i} is {i * i % 97}." for i in range(120))
        prompt = engine.tokenizer.encode(long_text)[:300]
        assert len(prompt) == 300
        names = [None, *ADAPTER_CONFIGS]
        short = [greedy_request(f"s{i}", engine.tokenizer.encode(t), names[i % len(names)], 40)
                 for i, t in enumerate(TEXTS[:4])]
        return short + [greedy_request(f"l{i}", prompt[i * 5 :], names[(i + 1) % len(names)], 12) for i in range(3)]

    graphs = load_engine(tiny_llama_dir, adapter_dir, device="cuda", dtype="bfloat16", max_num_seqs=8,
                         max_num_batched_tokens=512)
    eager_forwards = []
    forward = model_runner.run_forward
    monkeypatch.setattr(model_runner, "run_forward", lambda *a: eager_forwards.append(1) or forward(*a))
    got = run_all(graphs, requests(graphs))
    assert not eager_forwards, f"{len(eager_forwards)} eager steps"
    assert graphs._core.runner.graphs.replays >= 40
    monkeypatch.setattr(model_runner, "run_forward", forward)

    monkeypatch.setattr(step_plan, "SHORT_PREFILL_READS", step_plan.GRAPH_PREFILL_READS * 8)  # the same kernel
    eager = load_engine(tiny_llama_dir, adapter_dir, device="cuda", dtype="bfloat16", max_num_seqs=8,
                        max_num_batched_tokens=512, enforce_eager=True)
    expected = run_all(eager, requests(eager))
    assert {k: tokens_of(v) for k, v in got.items()} == {k: tokens_of(v) for k, v in expected.items()}


@pytest.mark.slow
def test_smollm2_float32_on_cuda_equals_transformers_peft(carried_gguf: str, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    smollm2_gguf = carried_gguf
    hf_model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(smollm2_gguf), gguf_file=os.path.basename(smollm2_gguf), dtype=torch.float32
    ).eval()
    check_exact_against_peft(Path(smollm2_gguf), hf_model, tmp_path, std=0.02, device="cuda", max_num_seqs=32,
                             max_num_batched_tokens=1024)


@pytest.mark.parametrize("penalty, logprobs", [(1.0, False), (1.3, False), (1.0, True)],
                         ids=["sampling", "sampling with a repetition penalty", "sampling with log-probabilities"])
def test_launch_ahead_gives_the_step_by_step_outputs(tiny_llama_dir: Path, adapter_dir: Path, penalty: float,
                                                     logprobs: bool) -> None:
    """Steps launched before the previous step's tokens are read (token ids fed on the
    device) give exactly what the step-by-step engine gives, with requests stopping
    mid-stream on a token id or a string and one request (r4) that samples, with a repetition
    penalty or log-probabilities or neither. Its steps are launched too (its draw, the
    penalty on its newest token and its log-probabilities on the device): here every step
    replays a graph (the prompts are a few tokens, so even prefill rows are paged-decode
    rows) and every placeholder input is in the step in flight, so each of r4's tokens comes
    from a launched step, counted exactly by ``rows_if_all_launched`` (r4 stops early, on a
    string of its ~4th token: a bound like "5 launched steps" would not hold). Both engines
    replay the same graphs, so bf16 outputs compare exactly."""
    from launch_ahead import _mixed_requests, _summary, assert_same_logprobs, rows_if_all_launched

    def engine(ahead: bool):
        return load_engine(tiny_llama_dir, adapter_dir, device="cuda", dtype="bfloat16", max_num_seqs=6,
                           launch_ahead=ahead)

    def requests(e, stops: dict):
        return _mixed_requests(e, stops, sampled=4, penalty=penalty, logprobs=logprobs)

    first = engine(False)
    free = run_all(first, requests(first, {}))
    stops = {rid: (tokens_of(ev)[3], "".join(e.text for e in ev[2:4]).strip()[:3] or None)
             for rid, ev in free.items() if len(tokens_of(ev)) > 4}
    step_by_step, ahead = engine(False), engine(True)
    launch, launched_rows = ahead._core.runner.launch, Counter()

    def counting(seqs, num_tokens, feed):
        step = launch(seqs, num_tokens, feed)
        if step is not None:
            launched_rows.update(s.request_id for s in step.sample_seqs)
        return step

    ahead._core.runner.launch = counting
    expected = run_all(step_by_step, requests(step_by_step, stops))
    got = run_all(ahead, requests(ahead, stops))
    assert ahead._core._launch_ahead and not step_by_step._core._launch_ahead
    assert launched_rows["r4"] == rows_if_all_launched(got["r4"]), (launched_rows["r4"], tokens_of(got["r4"]))
    assert {k: _summary(v) for k, v in got.items()} == {k: _summary(v) for k, v in expected.items()}
    assert_same_logprobs(got, expected)
    assert all(e.top_logprobs and len(e.top_logprobs[0]) == 3 for e in expected["r4"]) == logprobs
    assert sum(v[-1].finish_reason.name == "STOP" for v in expected.values()) >= 3
    assert ahead._core.blocks.num_free == ahead._core.blocks.num_blocks
