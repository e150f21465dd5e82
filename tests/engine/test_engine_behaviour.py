"""Engine behaviour on a tiny random Llama: batching limits, preemption, abort, stops, sampling."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from loraplex.adapter_store.errors import ResourceExhaustedError
from loraplex.inference_server.engine.request import (FinishReason, GenerationRequest, GrammarSpec, SamplingParams,
                                                      StoppingCriteria)
from lora_helpers import ADAPTER_CONFIGS, collect, greedy_request, load_engine, make_test_adapters, run_all, text_of, tokens_of

TEXTS = ["Hello there, how are you?", "The quick brown fox", "Once upon a time", "1, 2, 3, 4,", "Rust or Go?"]


@pytest.fixture(scope="module")
def adapter_dir(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_test_adapters(tiny_llama_dir, tmp_path_factory.mktemp("adapters"))


def _requests(engine, n: int, new_tokens: int = 24) -> list[GenerationRequest]:
    names = [None, *ADAPTER_CONFIGS]
    prompts = [engine.tokenizer.encode(t) for t in TEXTS]
    return [greedy_request(f"r{i}", prompts[i % len(prompts)], names[i % len(names)], new_tokens) for i in range(n)]


def test_more_requests_than_batch_size_all_finish_with_the_same_tokens(tiny_llama_dir: Path, adapter_dir: Path) -> None:
    wide = load_engine(tiny_llama_dir, adapter_dir, max_num_seqs=32)
    narrow = load_engine(tiny_llama_dir, adapter_dir, max_num_seqs=3, max_num_batched_tokens=16)
    expected = run_all(wide, _requests(wide, 20))
    got = run_all(narrow, _requests(narrow, 20))
    assert {k: tokens_of(v) for k, v in got.items()} == {k: tokens_of(v) for k, v in expected.items()}
    assert all(v[-1].finish_reason is FinishReason.LENGTH and v[-1].usage.completion_tokens == 24 for v in got.values())


def test_kv_exhaustion_preempts_and_resumes_with_identical_output(tiny_llama_dir: Path, adapter_dir: Path) -> None:
    roomy = load_engine(tiny_llama_dir, adapter_dir)
    tight = load_engine(tiny_llama_dir, adapter_dir, num_kv_blocks=14, block_size=4, max_model_len=48)
    expected = run_all(roomy, _requests(roomy, 8, new_tokens=30))
    got = run_all(tight, _requests(tight, 8, new_tokens=30))
    assert tight.stats().preemptions > 0, "the test must exhaust the KV cache"
    assert {k: tokens_of(v) for k, v in got.items()} == {k: tokens_of(v) for k, v in expected.items()}
    assert tight.stats().free_kv_blocks == tight.stats().total_kv_blocks


def test_abort_ends_the_stream_and_frees_kv_blocks(tiny_llama_dir: Path, adapter_dir: Path) -> None:
    engine = load_engine(tiny_llama_dir, adapter_dir)
    long = greedy_request("long", engine.tokenizer.encode(TEXTS[0]), "attn-r8", 500)
    short = greedy_request("short", engine.tokenizer.encode(TEXTS[1]), None, 8)

    async def main():
        await engine.start()
        events = []
        async for event in engine.generate(long):
            events.append(event)
            if len(events) == 3:
                engine.abort("long")
        other = await collect(engine, short)
        await asyncio.sleep(0.05)
        stats = engine.stats()
        await engine.shutdown()
        return events, other, stats

    events, other, stats = asyncio.run(main())
    assert events[-1].finish_reason is FinishReason.ABORT
    assert len(tokens_of(events)) < 500
    assert other[-1].finish_reason is FinishReason.LENGTH
    assert stats.free_kv_blocks == stats.total_kv_blocks and stats.num_running == 0


def test_closing_the_stream_aborts_the_request(tiny_llama_dir: Path, adapter_dir: Path) -> None:
    engine = load_engine(tiny_llama_dir, adapter_dir)
    request = greedy_request("gone", engine.tokenizer.encode(TEXTS[2]), "mlp-r64", 500)

    async def main():
        await engine.start()
        stream = engine.generate(request)
        await anext(stream)
        await stream.aclose()  # what a cancelled RPC does
        for _ in range(100):
            await asyncio.sleep(0.02)
            if engine.stats().num_running == 0:
                break
        stats = engine.stats()
        await engine.shutdown()
        return stats

    stats = asyncio.run(main())
    assert stats.num_running == 0 and stats.free_kv_blocks == stats.total_kv_blocks


def test_the_queue_bound_holds_for_requests_whose_grammar_compiles(tiny_llama_dir: Path, adapter_dir: Path) -> None:
    """A stream counted against --max-waiting only once its grammar had compiled (an await): every
    structured-output request arriving meanwhile found the room the others had not taken yet, so a
    burst of them went past the bound instead of getting RESOURCE_EXHAUSTED."""
    engine = load_engine(tiny_llama_dir, adapter_dir, max_num_seqs=1, max_waiting=1)  # room for 2 streams
    prompt = tuple(engine.tokenizer.encode(TEXTS[0]))
    held = greedy_request("held", list(prompt), None, 500)
    burst = [GenerationRequest(f"json{i}", prompt, None, SamplingParams(), StoppingCriteria(max_new_tokens=4),
                               grammar=GrammarSpec("json_schema", json.dumps({"type": "integer", "maximum": i})))
             for i in range(6)]

    async def outcome(request: GenerationRequest) -> str:
        try:
            await collect(engine, request)
            return "done"
        except ResourceExhaustedError:
            return "refused"

    async def main():
        await engine.start()
        stream = engine.generate(held)
        await anext(stream)  # holds one of the two places
        outcomes = await asyncio.gather(*(outcome(r) for r in burst))
        await stream.aclose()
        await asyncio.sleep(0.05)
        stats = engine.stats()
        await engine.shutdown()
        return outcomes, stats

    outcomes, stats = asyncio.run(main())
    assert sorted(outcomes) == ["done"] + ["refused"] * 5
    assert stats.num_running == stats.num_waiting == 0


def test_an_abort_while_the_adapter_waits_for_pool_space_ends_the_stream(tiny_llama_dir: Path,
                                                                          adapter_dir: Path) -> None:
    """An abort of a request the step loop did not have yet (its adapter waiting for pool space
    held by running requests) was lost: the request waited on, was queued once the space came and
    ran on. A shutdown whose grace period was over aborted it for nothing; the gRPC server's stop
    cut it later (UNAVAILABLE, not a last 'abort' message) after waiting 10 s for it. Now the
    wait ends at once, the stream's last event is ABORT, and nothing stays held."""
    probe = load_engine(tiny_llama_dir, adapter_dir)
    prompt = probe.tokenizer.encode(TEXTS[0])
    run_all(probe, [greedy_request("probe", prompt, "mlp-r64", 1)])
    one = probe.pool_stats().used_bytes  # mlp-r64's place in the pool
    engine = load_engine(tiny_llama_dir, adapter_dir, adapter_pool_bytes=one + one // 4)  # it alone fits
    holder = greedy_request("holder", prompt, "mlp-r64", 500)
    waiter = greedy_request("waiter", prompt, "all-r16-rslora", 8)

    async def main():
        await engine.start()
        held = engine.generate(holder)
        await anext(held)  # mlp-r64 fills the pool while this runs
        waiting = asyncio.ensure_future(collect(engine, waiter))
        for _ in range(200):
            await asyncio.sleep(0.01)
            if engine.pool_stats().waiting:
                break
        engine.abort("waiter")
        events = await asyncio.wait_for(waiting, 10)
        await held.aclose()
        await asyncio.sleep(0.05)
        stats, pool = engine.stats(), engine.pool_stats()
        await engine.shutdown()
        return events, stats, pool

    events, stats, pool = asyncio.run(main())
    assert [e.finish_reason for e in events] == [FinishReason.ABORT] and not tokens_of(events)
    assert stats.num_running == stats.num_waiting == 0 and pool.waiting == 0 and pool.in_use == 0


def test_stop_string_cuts_the_text_exactly(tiny_llama_dir: Path, adapter_dir: Path) -> None:
    engine = load_engine(tiny_llama_dir, adapter_dir)
    prompt = engine.tokenizer.encode(TEXTS[3])
    full = text_of(run_all(engine, [greedy_request("a", prompt, "layers-r4", 40)])["a"])
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    assert stop.strip(), f"need a visible stop string in {full!r}"
    engine = load_engine(tiny_llama_dir, adapter_dir)
    events = run_all(engine, [greedy_request("b", prompt, "layers-r4", 40, stop_strings=(stop,))])["b"]
    assert text_of(events) == full[: full.index(stop)]
    assert events[-1].finish_reason is FinishReason.STOP


def test_seeded_sampling_reproduces(tiny_llama_dir: Path, adapter_dir: Path) -> None:
    def sampled(seed: int) -> list[int]:
        engine = load_engine(tiny_llama_dir, adapter_dir)
        params = SamplingParams(temperature=0.9, top_k=100, top_p=0.95, seed=seed, repetition_penalty=1.1)
        request = GenerationRequest("s", tuple(engine.tokenizer.encode(TEXTS[4])), "all-r16-rslora", params,
                                    StoppingCriteria(max_new_tokens=24, ignore_eos=True))
        return tokens_of(run_all(engine, [request])["s"])

    assert sampled(7) == sampled(7)
    assert sampled(7) != sampled(8)


def test_logprobs_are_returned_when_asked(tiny_llama_dir: Path, adapter_dir: Path) -> None:
    engine = load_engine(tiny_llama_dir, adapter_dir)
    request = GenerationRequest("lp", tuple(engine.tokenizer.encode(TEXTS[0])), None,
                                SamplingParams(logprobs=True, top_logprobs=3), StoppingCriteria(max_new_tokens=5, ignore_eos=True))
    events = run_all(engine, [request])["lp"]
    chosen_all = [lp for e in events for lp in e.logprobs]
    tops_all = [t for e in events for t in e.top_logprobs]
    assert len(chosen_all) == len(tops_all) == len(tokens_of(events)) == 5
    for chosen, top in zip(chosen_all, tops_all):
        assert len(top) == 3 and chosen <= 0.0
        assert max(top.values()) == pytest.approx(chosen)  # greedy picks the most likely token
