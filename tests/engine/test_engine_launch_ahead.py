"""The engine's launch-ahead loop (LLMEngine.step) on the CPU: a step is launched, the next
one is scheduled and launched before the first one's tokens are read, and sequences carry a
placeholder token meanwhile. On CUDA the runner does this with graphs and device-side
token feeding (tests/gpu); here a runner that computes each step at launch but hands its
tokens over only when they are read exercises the same engine code. Every output must equal
the plain engine's: tokens, text, finish reasons, usage, with stops landing on a token that
has a next step already launched, aborts and preemptions while a step is in flight."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch

from loraplex.inference_server.engine.launched import LaunchedStep
from loraplex.inference_server.engine.model_runner import ModelRunner
from loraplex.inference_server.engine.request import GenerationRequest, SamplingParams, StoppingCriteria
from loraplex.inference_server.engine.sequence import PLACEHOLDER
from lora_helpers import ADAPTER_CONFIGS, greedy_request, load_engine, make_test_adapters, run_all, tokens_of

TEXTS = ["Hello there, how are you?", "The quick brown fox", "Once upon a time", "1, 2, 3, 4,", "Rust or Go?"]


class _Ready:
    def synchronize(self) -> None:
        pass


class DeferredRunner:
    """A ModelRunner whose ``launch`` computes the step at once (placeholders resolved from
    the step it is fed by, as the device copy does) and returns the tokens only when read."""

    can_launch = True

    def __init__(self, runner: ModelRunner) -> None:
        self._runner = runner
        self.launches = 0
        self.fed = 0  # placeholder inputs taken from a launched step
        self.sampled = 0  # launched steps with a row drawn from its generator
        self.rows: Counter[str] = Counter()  # per request id: its sampled rows in launched steps

    def __getattr__(self, name: str):
        return getattr(self._runner, name)

    def launch(self, seqs, num_tokens, feed: LaunchedStep | None) -> LaunchedStep | None:
        index = feed.index_of() if feed is not None else {}
        patched = [s for s in seqs if s.token_ids[-1] == PLACEHOLDER]
        if any(id(s) not in index for s in patched):
            return None
        for s in patched:  # a placeholder that is the sequence's last token must not be run on
            assert len(s.token_ids) - s.num_prompt < s.request.stopping.max_new_tokens, "ran past max_new_tokens"
            s.token_ids[-1] = int(feed.tokens[index[id(s)]])
        try:
            out = self._runner.execute(seqs, num_tokens)
        finally:
            for s in patched:
                s.token_ids[-1] = PLACEHOLDER
        self.launches += 1
        self.fed += len(patched)
        self.sampled += any(not s.request.sampling.greedy for s in seqs)
        self.rows.update(s.request_id for s in out.sampled_seqs)
        tokens = torch.tensor(out.result.token_ids if out.result else [], dtype=torch.int64)
        logprobs = _ReadLogprobs(out.result) if out.result and any(x is not None for x in out.result.logprobs) else None
        return LaunchedStep(list(seqs), list(num_tokens), list(out.sampled_seqs), tokens, tokens.clone(), _Ready(),
                            logprobs=logprobs)


class _ReadLogprobs:
    """A launched step's log-probabilities as the engine reads them (``LaunchedLogprobs.read``)."""

    def __init__(self, result) -> None:
        self._result = result

    def read(self):
        return self._result.logprobs, self._result.top_logprobs


def _deferred(module, cfg, blocks, manager, max_seqs, max_tokens):
    return DeferredRunner(ModelRunner(module, cfg, blocks, manager.pool, max_seqs, max_tokens))


@pytest.fixture(scope="module")
def adapter_dir(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_test_adapters(tiny_llama_dir, tmp_path_factory.mktemp("launch-ahead-adapters"))


def _engines(tiny_llama_dir: Path, adapter_dir: Path, **config):
    """(the plain engine, the launch-ahead engine) on the same model and adapters."""
    return (load_engine(tiny_llama_dir, adapter_dir, **config),
            load_engine(tiny_llama_dir, adapter_dir, runner_factory=_deferred, **config))


def _summary(events) -> dict:
    last = events[-1]
    return dict(tokens=tokens_of(events), text="".join(e.text for e in events), reason=last.finish_reason,
                usage=last.usage)


def _logprobs(events) -> list:
    """Each token's log-probabilities as a flat list: (chosen, then (id, value) of the top ones).
    Steps may batch differently with launch-ahead, so the values agree to rounding, not bits;
    token by token, since a reader that fell behind gets several tokens in one event."""
    out = []
    for e in events:
        for i in range(len(e.token_ids)):
            out.append(None if e.logprobs is None else [e.logprobs[i]])
            out.append(None if e.top_logprobs is None else [sorted(e.top_logprobs[i].items())])
    return out


def assert_same_logprobs(got: dict, expected: dict) -> None:
    for rid, events in expected.items():
        want, have = _logprobs(events), _logprobs(got[rid])
        assert [x is None for x in have] == [x is None for x in want], rid
        for a, b in zip(have, want):
            if a is not None and isinstance(a[0], float):
                assert a == pytest.approx(b, rel=1e-5, abs=1e-5), rid
            elif a is not None:  # tops: the same ids, values to rounding
                assert [[i for i, _ in t] for t in a] == [[i for i, _ in t] for t in b], rid
                assert [v for t in a for _, v in t] == pytest.approx([v for t in b for _, v in t], rel=1e-5, abs=1e-5)


def rows_if_all_launched(events) -> int:
    """The sampled rows a request has in launched steps when every step that samples it is
    launched: one per token it produced (its prefill step's too: nothing there waits for the
    host), and one more when it stopped on a token id or a string, since the engine launches
    the next step, with its row, before it reads that token (the row's token is dropped). A
    request ending on its length has no such row (LLMEngine._ending keeps it out)."""
    return len(tokens_of(events)) + (events[-1].finish_reason.name == "STOP")


def _mixed_requests(engine, stops: dict[str, tuple[int, str]], sampled: int | None = None,
                    penalty: float = 1.0, logprobs: bool = False) -> list[GenerationRequest]:
    """Adapters and base rows; some stop on a token id or a string the plain engine produced
    mid-stream; each has its own length; request ``sampled`` samples (seeded, with a
    repetition ``penalty``, and with ``logprobs`` the chosen token's log-probability and the top 3)."""
    names = [None, *ADAPTER_CONFIGS]
    out = []
    for i in range(12):
        rid = f"r{i}"
        prompt = tuple(engine.tokenizer.encode(TEXTS[i % len(TEXTS)]))
        token, text = stops.get(rid, (None, None))
        stopping = StoppingCriteria(max_new_tokens=6 + 3 * i, ignore_eos=True,
                                    stop_token_ids=(token,) if token is not None and i % 3 == 0 else (),
                                    stop_strings=(text,) if text and i % 3 == 1 else ())
        sampling = (SamplingParams(temperature=0.8, top_p=0.9, seed=7, repetition_penalty=penalty, logprobs=logprobs,
                                   top_logprobs=3 if logprobs else 0) if i == sampled else SamplingParams())
        out.append(GenerationRequest(rid, prompt, names[i % len(names)], sampling, stopping))
    return out


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
