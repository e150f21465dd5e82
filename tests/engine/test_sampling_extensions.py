"""The sampling parameters clients send (#41 item 3), in the sampler and through the engine on the
CPU: logit_bias, tokens banned before min_tokens, presence and frequency penalties (their output
counts kept on the device across steps, a launched step's newest token from the device), min_p,
stop_token_ids, skip_special_tokens, the prompt's own log-probabilities (against transformers'),
and ``n`` choices of one prompt sharing its KV blocks through the prefix cache. With steps
launched ahead (the CPU stand-in of tests/engine/test_engine_launch_ahead.py) every output equals the
plain engine's."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from loraplex.adapter_store.errors import InvalidRequestError
from loraplex.inference_server.engine.request import GenerationRequest, SamplingParams, StoppingCriteria
from loraplex.inference_server.engine.sampler import SampleRow, apply_penalties, choose, output_counts
from loraplex.inference_server.engine.seen_tokens import OutputCounts
from loraplex.inference_server.engine.sequence import PLACEHOLDER, Sequence
from lora_helpers import load_engine, run_all, tokens_of
from launch_ahead import _deferred, _summary, assert_same_logprobs

VOCAB = 50
CPU = torch.device("cpu")


def _row(seen=(), num_prompt=0, banned=(), **params) -> SampleRow:
    return SampleRow(SamplingParams(**params), list(seen), None, tuple(banned), num_prompt)


def test_logit_bias_and_banned_tokens_steer_a_greedy_row() -> None:
    logits = torch.zeros(3, VOCAB)
    logits[:, 7] = 5.0
    rows = [_row(logit_bias=((11, 10.0),)), _row(banned=(7,)), _row(logit_bias=((7, -100.0),), banned=(3,))]
    tokens = choose(apply_penalties(logits, rows), rows).tolist()
    assert tokens[0] == 11 and tokens[1] != 7 and tokens[2] not in (7, 3)
    assert logits[0, 7] == 5.0 and logits[0, 11] == 0.0  # the raw logits (log-probabilities read them) are kept


def test_presence_and_frequency_penalties_count_the_output_only() -> None:
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(0))
    rows = [_row(seen=(4, 4, 9, 4, 4, 6), num_prompt=3, presence_penalty=0.5, frequency_penalty=0.25), _row()]
    got = apply_penalties(logits, rows)
    expected = logits.clone()
    expected[0, 4] -= 0.5 + 2 * 0.25  # twice in the output (its prompt occurrences do not count)
    expected[0, 6] -= 0.5 + 0.25
    assert torch.allclose(got, expected)
    assert output_counts(rows, VOCAB, CPU)[0, 9] == 0  # a prompt-only token


def test_min_p_keeps_tokens_at_least_that_fraction_of_the_most_likely() -> None:
    probs = torch.tensor([0.5, 0.3, 0.12, 0.08])
    rows = [_row(temperature=1.0, min_p=0.2)] * 4000
    torch.manual_seed(0)
    drawn = choose(probs.log().expand(len(rows), -1).contiguous(), rows)
    freq = torch.bincount(drawn, minlength=4).double() / len(rows)
    assert freq[2] > 0.1 and freq[3] == 0  # 0.12 >= 0.2 * 0.5 stays, 0.08 goes
    assert torch.allclose(freq[:3], (probs[:3] / probs[:3].sum()).double(), atol=0.03)


def _seq(rid: str, prompt: tuple[int, ...], **params) -> Sequence:
    request = GenerationRequest(rid, prompt, None, SamplingParams(**params), StoppingCriteria(max_new_tokens=50))
    return Sequence.create(request, None, None, None)


def _counts_from_scratch(seqs: list[Sequence]) -> torch.Tensor:
    return output_counts([SampleRow(s.request.sampling, s.token_ids, None, (), s.num_prompt) for s in seqs], VOCAB, CPU)


def test_output_counts_grow_by_new_tokens_each_counted_once() -> None:
    """Host tokens, then a launched step's newest token from the device (later read by the host:
    not counted again), then a preempted sequence rebuilt: always the counts from scratch."""
    a, b, c = _seq("a", (1, 2, 2), frequency_penalty=0.5), _seq("b", (3,)), _seq("c", (4,), presence_penalty=1.0)
    counts = OutputCounts(max_seqs=3)
    gen = torch.Generator().manual_seed(0)
    for step in range(10):
        seqs = [a, b, c]
        if step % 3 == 2:  # launched: the newest token is still on the device
            for s in seqs:
                s.token_ids.append(PLACEHOLDER)
            newest = [int(torch.randint(VOCAB, (1,), generator=gen)) for _ in seqs]
            got = counts.mask(seqs, VOCAB, CPU, newest=([0, 1, 2], torch.tensor(newest)))
            for s, t in zip(seqs, newest):
                s.token_ids[-1] = t
        else:
            got = counts.mask(seqs, VOCAB, CPU)
        assert torch.equal(got, _counts_from_scratch(seqs)), step
        for s in seqs:
            s.token_ids.append(int(torch.randint(5, (1,), generator=gen)))  # repeats: counts above 1
    assert counts.mask([b], VOCAB, CPU) is None
    assert torch.equal(counts.mask([c], VOCAB, CPU), _counts_from_scratch([c]))  # c keeps its row; a's is freed
    assert torch.equal(counts.mask([a, c], VOCAB, CPU), _counts_from_scratch([a, c]))  # a rebuilt from its tokens


@pytest.mark.parametrize("changes, field", [
    (dict(presence_penalty=2.5), "presence_penalty"), (dict(frequency_penalty=math.nan), "frequency_penalty"),
    (dict(min_p=1.5), "min_p"), (dict(logit_bias=((1, 200.0),)), "logit_bias"),
    (dict(logit_bias=((1, 1.0), (1, 2.0))), "logit_bias"), (dict(prompt_logprobs=21), "prompt_logprobs"),
])
def test_bad_values_name_their_field(changes: dict, field: str) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        SamplingParams(**changes)
    assert caught.value.field == field


# -- through the engine -------------------------------------------------------------------


@pytest.fixture(scope="module")
def no_adapters(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("no-adapters")


def _request(rid: str, prompt: list[int], max_new: int = 8, skip_special_tokens: bool = True, group=None,
             stopping: dict | None = None, **sampling) -> GenerationRequest:
    return GenerationRequest(rid, tuple(prompt), None, SamplingParams(**sampling),
                             StoppingCriteria(max_new_tokens=max_new, **(stopping or {})),
                             skip_special_tokens=skip_special_tokens, prompt_group=group)


@pytest.mark.slow
def test_min_tokens_holds_back_eos_and_stop_ids(tiny_llama_dir: Path, no_adapters: Path) -> None:
    engine = load_engine(tiny_llama_dir, no_adapters)
    eos = engine.info.eos_token_ids[0]
    prompt = engine.tokenizer.encode("Once upon a time")
    push_eos = ((eos, 100.0),)
    out = run_all(engine, [
        _request("eos-at-once", prompt, logit_bias=push_eos),
        _request("eos-after-5", prompt, logit_bias=push_eos, stopping=dict(min_tokens=5)),
        _request("stop-id-after-3", prompt, logit_bias=((77, 100.0),), stopping=dict(min_tokens=3, stop_token_ids=(77,))),
        _request("ignored-eos", prompt, max_new=4, logit_bias=push_eos, skip_special_tokens=False,
                 stopping=dict(ignore_eos=True)),
    ])
    assert tokens_of(out["eos-at-once"]) == [eos] and out["eos-at-once"][-1].finish_reason.value == "stop"
    held = tokens_of(out["eos-after-5"])
    assert len(held) == 6 and held[-1] == eos and eos not in held[:5]
    assert out["eos-after-5"][-1].usage.completion_tokens == 6
    assert tokens_of(out["stop-id-after-3"])[3:] == [77] and out["stop-id-after-3"][-1].finish_reason.value == "stop"
    special = engine.tokenizer.decode([eos])
    assert "".join(e.text for e in out["ignored-eos"]) == special * 4  # not skipped: its text is there


@pytest.mark.slow
def test_prompt_logprobs_equal_transformers(tiny_llama_dir: Path, no_adapters: Path) -> None:
    """Computed in chunks (a prompt longer than the step's token budget) and with a cached prefix
    of the same prompt in the KV cache (not reused for it: every prompt row is computed)."""
    from transformers import LlamaForCausalLM  # noqa: PLC0415

    engine = load_engine(tiny_llama_dir, no_adapters, max_num_batched_tokens=32, max_num_seqs=4)
    prompt = engine.tokenizer.encode("The history of the city goes back to ancient times, when " * 4)
    assert len(prompt) > 40
    out = run_all(engine, [_request("warm", prompt, max_new=2), _request("p", prompt, max_new=2, prompt_logprobs=3)])
    first = out["p"][0]
    assert out["warm"][0].prompt_logprobs is None and all(e.prompt_logprobs is None for e in out["p"][1:])
    hf = LlamaForCausalLM.from_pretrained(tiny_llama_dir, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        logp = hf(torch.tensor([prompt])).logits[0].log_softmax(-1)
    expected = [None] + [logp[i - 1, t].item() for i, t in enumerate(prompt) if i > 0]
    assert first.prompt_logprobs[0] is None and first.prompt_top_logprobs[0] is None
    assert list(first.prompt_logprobs[1:]) == pytest.approx(expected[1:], abs=2e-4)
    top = first.prompt_top_logprobs[5]
    assert len(top) == 3 and set(top) == set(logp[4].topk(3).indices.tolist())


@pytest.mark.slow
def test_choices_of_one_prompt_share_its_kv_blocks(tiny_llama_dir: Path, no_adapters: Path) -> None:
    engine = load_engine(tiny_llama_dir, no_adapters)
    prompt = engine.tokenizer.encode("A long shared prompt, " * 12)
    full_blocks = len(prompt) // 16 * 16
    group = [_request(f"c{i}", prompt, temperature=1.0, seed=5 + i, group="g") for i in range(3)]
    out = run_all(engine, group)
    stats = engine.stats()
    assert stats.prefix_hit_tokens == 2 * full_blocks  # the 2nd and 3rd took the 1st's blocks
    assert len({tuple(tokens_of(v)) for v in out.values()}) == 3  # their own draws
    alone = run_all(load_engine(tiny_llama_dir, no_adapters), [_request("c1", prompt, temperature=1.0, seed=6)])
    assert tokens_of(alone["c1"]) == tokens_of(out["c1"])  # sharing the prompt changes no answer


def _extended(engine, eos: int) -> list[GenerationRequest]:
    prompt = engine.tokenizer.encode
    return [
        _request("pen", prompt("1, 2, 3, 4,"), max_new=16, temperature=0.9, seed=3, presence_penalty=0.8,
                 frequency_penalty=0.6, stopping=dict(ignore_eos=True)),
        _request("greedy-pen", prompt("Hello there"), max_new=12, frequency_penalty=1.5, repetition_penalty=1.2,
                 stopping=dict(ignore_eos=True)),
        _request("min-p", prompt("Once upon a time"), max_new=10, temperature=1.2, seed=4, min_p=0.3, top_k=40,
                 logprobs=True, top_logprobs=2, stopping=dict(ignore_eos=True)),
        _request("bias", prompt("Rust or Go?"), max_new=9, logit_bias=((eos, 100.0),), stopping=dict(min_tokens=6)),
        _request("plain", prompt("The quick brown fox"), max_new=14, stopping=dict(ignore_eos=True)),
    ]


@pytest.mark.slow
def test_launched_steps_give_the_same_outputs_with_every_new_parameter(tiny_llama_dir: Path,
                                                                       no_adapters: Path) -> None:
    plain = load_engine(tiny_llama_dir, no_adapters, max_num_seqs=6)
    ahead = load_engine(tiny_llama_dir, no_adapters, runner_factory=_deferred, max_num_seqs=6)
    eos = plain.info.eos_token_ids[0]
    expected = run_all(plain, _extended(plain, eos))
    got = run_all(ahead, _extended(ahead, eos))
    assert ahead._core.runner.launches >= 10
    assert {k: _summary(v) for k, v in got.items()} == {k: _summary(v) for k, v in expected.items()}
    assert_same_logprobs(got, expected)
    counts = {}
    for t in tokens_of(expected["greedy-pen"]):
        counts[t] = counts.get(t, 0) + 1
    assert max(counts.values()) <= 3  # the frequency penalty spreads the greedy output
    assert len(tokens_of(expected["bias"])) == 7
