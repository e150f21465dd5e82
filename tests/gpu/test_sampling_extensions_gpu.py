"""The sampling extensions of #41 on CUDA: logit_bias, tokens banned before min_tokens, presence
and frequency penalties (OutputCounts on the device, a launched step's newest token taken from
the device) and min_p read nothing back to the host (torch's sync debug mode turns any
synchronizing call into an error), so a launched step can still sample; and the engine with CUDA
graphs and launch-ahead gives the eager engine's outputs for requests using every new parameter,
while a request asking for its prompt's log-probabilities runs its prefill eagerly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from loraplex.inference_server.engine.request import GenerationRequest, SamplingParams, StoppingCriteria
from loraplex.inference_server.engine.sampler import SampleRow, apply_penalties, choose, output_counts
from loraplex.inference_server.engine.seen_tokens import OutputCounts
from loraplex.inference_server.engine.sequence import PLACEHOLDER, Sequence
from lora_helpers import load_engine, run_all, tokens_of

CUDA = torch.device("cuda")
V = 32000


def _seq(rid: str, prompt: tuple[int, ...], **params) -> Sequence:
    request = GenerationRequest(rid, prompt, None, SamplingParams(**params), StoppingCriteria(max_new_tokens=50))
    return Sequence.create(request, None, None, None)


def _rows(seqs: list[Sequence], banned: dict[int, tuple[int, ...]]) -> list[SampleRow]:
    out = []
    for i, s in enumerate(seqs):
        generator = None if s.request.sampling.greedy else torch.Generator(device=CUDA).manual_seed(i)
        out.append(SampleRow(s.request.sampling, s.token_ids, generator, banned.get(i, ()), s.num_prompt))
    return out


def test_new_parameters_read_nothing_back_and_equal_the_counts_from_scratch() -> None:
    logits = torch.randn(4, V, device=CUDA, generator=torch.Generator(device=CUDA).manual_seed(0)) * 4
    seqs = [_seq("a", (5, 9, 5), presence_penalty=0.7, frequency_penalty=0.3, logit_bias=((17, 4.0), (3, -50.0))),
            _seq("b", (7,), temperature=0.9, seed=1, min_p=0.1, frequency_penalty=1.0),
            _seq("c", (1, 2), repetition_penalty=1.2, presence_penalty=-0.5),
            _seq("d", (4,))]
    counts = OutputCounts(max_seqs=4)
    for newest in (123, 456, 123):
        for s in seqs:
            s.token_ids.append(PLACEHOLDER)
        on_device = torch.tensor([newest, newest + 1, newest + 2, newest + 3], device=CUDA)
        feed = ([0, 1, 2], on_device[:3])
        rows = _rows(seqs, {0: (2,), 3: (2, 31999)})
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            table = counts.mask(seqs, V, CUDA, feed)
            adjusted = apply_penalties(logits, rows, None, table)
            tokens = choose(adjusted, rows)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        for s, t in zip(seqs, on_device.tolist()):
            s.token_ids[-1] = t  # what the host reads later
        scratch = output_counts(_rows(seqs, {}), V, CUDA)
        assert torch.equal(table, scratch)
        assert tokens.device.type == "cuda" and tokens[3].item() not in (2, 31999)
    assert table[0, 123].item() == 2 and table[0, 456].item() == 1  # the output only, each position once


@pytest.fixture(scope="module")
def no_adapters(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("no-adapters")


def _requests(engine) -> list[GenerationRequest]:
    eos = engine.info.eos_token_ids[0]
    enc = engine.tokenizer.encode

    def req(rid: str, text: str, max_new: int, stopping: dict | None = None, **sampling) -> GenerationRequest:
        return GenerationRequest(rid, tuple(enc(text)), None, SamplingParams(**sampling),
                                 StoppingCriteria(max_new_tokens=max_new, **(stopping or {"ignore_eos": True})))
    return [
        req("pen", "1, 2, 3, 4,", 24, temperature=0.9, seed=3, presence_penalty=0.8, frequency_penalty=0.6),
        req("greedy-pen", "Hello there", 20, frequency_penalty=1.5, repetition_penalty=1.2),
        req("min-p", "Once upon a time", 20, temperature=1.2, seed=4, min_p=0.3, top_k=40, logprobs=True,
            top_logprobs=2),
        req("bias", "Rust or Go?", 12, stopping={"min_tokens": 6}, logit_bias=((eos, 100.0),)),
        req("prompt-lp", "The quick brown fox jumps", 10, prompt_logprobs=2),
        req("plain", "Dear Sir or Madam,", 24),
    ]


@pytest.mark.parametrize("dtype", ["bfloat16"])
def test_graphs_and_launch_ahead_give_the_eager_outputs(tiny_llama_dir: Path, no_adapters: Path, dtype: str) -> None:
    eager = load_engine(tiny_llama_dir, no_adapters, device="cuda", dtype=dtype, enforce_eager=True, max_num_seqs=8)
    fast = load_engine(tiny_llama_dir, no_adapters, device="cuda", dtype=dtype, max_num_seqs=8)
    assert fast._core._launch_ahead
    expected = run_all(eager, _requests(eager))
    got = run_all(fast, _requests(fast))
    assert fast._core.runner.graphs.replays >= 10
    assert {k: tokens_of(v) for k, v in got.items()} == {k: tokens_of(v) for k, v in expected.items()}
    assert len(tokens_of(got["bias"])) == 7 and got["bias"][-1].finish_reason.value == "stop"
    first = got["prompt-lp"][0]
    assert first.prompt_logprobs[0] is None and len(first.prompt_logprobs) == len(_requests(fast)[4].prompt_token_ids)
    assert first.prompt_logprobs[1:] == pytest.approx(expected["prompt-lp"][0].prompt_logprobs[1:], abs=0.05)
