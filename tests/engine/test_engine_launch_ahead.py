"""The engine's launch-ahead loop (LLMEngine.step) on the CPU: a step is launched, the next
one is scheduled and launched before the first one's tokens are read, and sequences carry a
placeholder token meanwhile. On CUDA the runner does this with graphs and device-side
token feeding (tests/gpu); here a runner that computes each step at launch but hands its
tokens over only when they are read exercises the same engine code. Every output must equal
the plain engine's: tokens, text, finish reasons, usage, with stops landing on a token that
has a next step already launched, aborts and preemptions while a step is in flight."""

from __future__ import annotations

from pathlib import Path

import pytest

from loraplex.inference_server.engine.model_runner import ModelRunner
from loraplex.inference_server.engine.sequence import PLACEHOLDER
from lora_helpers import greedy_request, load_engine, make_test_adapters, run_all, tokens_of
from launch_ahead import (DeferredRunner, TEXTS, _deferred, _mixed_requests, _summary, assert_same_logprobs,
                          rows_if_all_launched)


@pytest.fixture(scope="module")
def adapter_dir(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_test_adapters(tiny_llama_dir, tmp_path_factory.mktemp("launch-ahead-adapters"))


def _engines(tiny_llama_dir: Path, adapter_dir: Path, **config):
    """(the plain engine, the launch-ahead engine) on the same model and adapters."""
    return (load_engine(tiny_llama_dir, adapter_dir, **config),
            load_engine(tiny_llama_dir, adapter_dir, runner_factory=_deferred, **config))


def _stops_from_a_free_run(tiny_llama_dir: Path, adapter_dir: Path, sampled: int | None,
                           penalty: float = 1.0, logprobs: bool = False) -> dict[str, tuple[int, str]]:
    """Per request, a token id and a string its unstopped output has mid-stream (4th token)."""
    plain = load_engine(tiny_llama_dir, adapter_dir, max_num_seqs=6)
    stops = {}
    for rid, events in run_all(plain, _mixed_requests(plain, {}, sampled, penalty, logprobs)).items():
        toks = tokens_of(events)
        if len(toks) > 4:
            stops[rid] = (toks[3], "".join(e.text for e in events[2:4]).strip()[:3] or None)
    return stops


@pytest.mark.parametrize("sampled, penalty, logprobs", [(None, 1.0, False), (4, 1.0, False), (4, 1.3, False),
                                                       (4, 1.0, True)],
                         ids=["greedy", "a sampling request", "a sampling request with a penalty",
                              "a sampling request with log-probabilities"])
def test_launched_steps_give_the_plain_engines_outputs(tiny_llama_dir: Path, adapter_dir: Path, sampled,
                                                       penalty, logprobs) -> None:
    """Every step launched ahead, a sampling request's too (its draws on the device, from its
    own generator: the same tokens), with a repetition penalty (its newest token counted
    from the device) or log-probabilities (computed there, read with the tokens) too."""
    stops = _stops_from_a_free_run(tiny_llama_dir, adapter_dir, sampled, penalty, logprobs)
    plain, ahead = _engines(tiny_llama_dir, adapter_dir, max_num_seqs=6)
    expected = run_all(plain, _mixed_requests(plain, stops, sampled, penalty, logprobs))
    got = run_all(ahead, _mixed_requests(ahead, stops, sampled, penalty, logprobs))
    runner = ahead._core.runner
    assert runner.launches >= 10 and runner.fed >= 20, (runner.launches, runner.fed)
    if sampled is None:
        assert runner.sampled == 0, runner.sampled
    else:  # here every step is launched (the runner above computes any step): the sampling one's too
        rid = f"r{sampled}"
        assert runner.rows[rid] == rows_if_all_launched(got[rid]), (runner.rows[rid], tokens_of(got[rid]))
    assert {k: _summary(v) for k, v in got.items()} == {k: _summary(v) for k, v in expected.items()}
    assert_same_logprobs(got, expected)
    assert all(e.top_logprobs and len(e.top_logprobs[0]) == 3 for e in expected["r4"]) == logprobs
    stopped = [k for k, v in expected.items() if v[-1].finish_reason.name == "STOP"]
    assert len(stopped) >= 3, "the case must stop some requests mid-stream"
    assert ahead._core.blocks.num_free == ahead._core.blocks.num_blocks


def test_preemption_while_a_step_is_in_flight(tiny_llama_dir: Path, adapter_dir: Path) -> None:
    plain, ahead = _engines(tiny_llama_dir, adapter_dir, num_kv_blocks=14, block_size=4, max_model_len=48)
    reqs = lambda e: [greedy_request(f"p{i}", e.tokenizer.encode(TEXTS[i % 5]), None, 24) for i in range(6)]  # noqa: E731
    expected = run_all(plain, reqs(plain))
    got = run_all(ahead, reqs(ahead))
    assert ahead.stats().preemptions > 0, "the test must exhaust the KV cache"
    assert {k: _summary(v) for k, v in got.items()} == {k: _summary(v) for k, v in expected.items()}


def test_abort_of_a_sequence_in_a_launched_step(tiny_llama_dir: Path, adapter_dir: Path) -> None:
    _, ahead = _engines(tiny_llama_dir, adapter_dir)
    core = ahead._core
    prompt = ahead.tokenizer.encode(TEXTS[0])
    for i in range(3):
        core.add_request(greedy_request(f"a{i}", prompt, None, 30), None)
    events = []
    for _ in range(4):
        events += core.step()
    assert core._launched is not None and any(s.request_id == "a1" for s in core._launched.sample_seqs)
    core.abort("a1")
    while core.has_work():
        events += core.step()
    by_id = {}
    for e in events:
        by_id.setdefault(e.request_id, []).append(e)
    aborted = by_id["a1"][-1]
    assert aborted.finish_reason.name == "ABORT" and aborted.usage.completion_tokens == len(tokens_of(by_id["a1"]))
    assert PLACEHOLDER not in tokens_of(by_id["a1"])
    for rid in ("a0", "a2"):
        assert len(tokens_of(by_id[rid])) == 30 and by_id[rid][-1].finish_reason.name == "LENGTH"
    assert core.blocks.num_free == core.blocks.num_blocks


class _FailingOnce(DeferredRunner):
    """Raises in the third launch, as a device error would."""

    def launch(self, seqs, num_tokens, feed):
        if self.launches == 2 and not getattr(self, "failed", False):
            self.failed = True
            raise RuntimeError("device error")
        return super().launch(seqs, num_tokens, feed)


def test_a_failed_launch_ends_its_requests_with_an_error_and_the_engine_goes_on(
        tiny_llama_dir: Path, adapter_dir: Path) -> None:
    engine = load_engine(tiny_llama_dir, adapter_dir, runner_factory=lambda *a: _FailingOnce(
        ModelRunner(a[0], a[1], a[2], a[3].pool, a[4], a[5])))
    core, prompt = engine._core, engine.tokenizer.encode(TEXTS[1])

    def run(requests) -> dict:
        for r in requests:
            core.add_request(r, None)
        events = []
        while core.has_work():
            events += core.step()
        return {r.request_id: [e for e in events if e.request_id == r.request_id] for r in requests}

    failed = run([greedy_request(f"f{i}", prompt, None, 12) for i in range(3)])
    assert {v[-1].finish_reason.name for v in failed.values()} == {"ERROR"}
    assert core.blocks.num_free == core.blocks.num_blocks and core._launched is None
    plain = load_engine(tiny_llama_dir, adapter_dir)
    expected = tokens_of(run_all(plain, [greedy_request("p", prompt, None, 12)])["p"])
    again = run([greedy_request("g", prompt, None, 12)])["g"]
    assert again[-1].finish_reason.name == "LENGTH" and tokens_of(again) == expected
    assert core.runner.launches > 2


@pytest.mark.slow
def test_launch_ahead_asked_for_by_name_is_refused_where_it_cannot_run(tiny_llama_dir: Path, adapter_dir: Path) -> None:
    """--launch-ahead on / --cuda-graphs on on the CPU: the engine refuses to start, naming the
    flag and why; auto (the default) runs one step at a time there without a word."""
    with pytest.raises(ValueError, match=r"--launch-ahead on needs CUDA graphs: CUDA graphs need a GPU .*auto or off"):
        load_engine(tiny_llama_dir, adapter_dir, require_launch_ahead=True)
    with pytest.raises(ValueError, match=r"--cuda-graphs on: CUDA graphs need a GPU \(the engine runs on cpu\)"):
        load_engine(tiny_llama_dir, adapter_dir, require_cuda_graphs=True)
    assert not load_engine(tiny_llama_dir, adapter_dir)._core._launch_ahead
