"""The CPU stand-in of launch-ahead (a runner whose launch computes at once and hands its tokens over only when read), and comparing two engines' outputs."""

from __future__ import annotations

from collections import Counter
import pytest
import torch
from loraplex.inference_server.engine.launched import LaunchedStep
from loraplex.inference_server.engine.model_runner import ModelRunner
from loraplex.inference_server.engine.request import GenerationRequest, SamplingParams, StoppingCriteria
from loraplex.inference_server.engine.sequence import PLACEHOLDER
from lora_helpers import ADAPTER_CONFIGS, tokens_of


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
