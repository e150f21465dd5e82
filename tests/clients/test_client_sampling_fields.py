"""The client's Generate fields against a real server (#41): SmolLM2-135M-Instruct on the CPU
behind the gRPC edge, the loraplex client (sync and asyncio) and CLI. Each field changes the
answer the way it says: logit_bias forces a token, stop_token_ids stops at it, min_tokens holds
EOS back, min_p=1 makes sampling greedy, the penalties change a greedy answer, n gives n choices
(each its own index, seeded ones reproducible), prompt_logprobs gives one per prompt token,
skip_special_tokens=False shows special tokens, json_object gives JSON; and what the message cannot
hold is refused by the client naming the argument."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import pytest

from loraplex.clients import AsyncLoraplexClient, LoraplexClient
from loraplex.clients.cli import main
from loraplex.clients.errors import InvalidArgumentError
from loraplex.clients.requests import generate_request
from loraplex.inference_server.model.checkpoint import ModelSource
from http_engine import _serve

pytestmark = pytest.mark.slow

ASK = [{"role": "user", "content": "What is the capital of France?"}]
STORY = "Once upon a time, in a small village,"


@pytest.fixture(scope="module")
def client(smollm2_gguf: str, tmp_path_factory: pytest.TempPathFactory):
    srv, _, _ = _serve(ModelSource(path=smollm2_gguf), tmp_path_factory.mktemp("adapters"))
    with LoraplexClient(srv.address, timeout=300) as c:
        yield c
    srv.close()


def test_logit_bias_forces_a_token(client: LoraplexClient) -> None:
    free = client.generate_text(STORY, max_new_tokens=6, ignore_eos=True)
    forced_id = 1024
    assert forced_id not in free.token_ids
    forced = client.generate_text(STORY, max_new_tokens=6, ignore_eos=True, logit_bias={forced_id: 100.0})
    assert forced.token_ids == (forced_id,) * 6
    banned = client.generate_text(STORY, max_new_tokens=6, ignore_eos=True, logit_bias={free.token_ids[0]: -100})
    assert banned.token_ids[0] != free.token_ids[0]


def test_stop_token_ids_stop_at_the_token(client: LoraplexClient) -> None:
    free = client.generate_text(STORY, max_new_tokens=12, ignore_eos=True)
    stop_at = free.token_ids[4]
    first = free.token_ids.index(stop_at)
    stopped = client.generate_text(STORY, max_new_tokens=12, ignore_eos=True, stop_token_ids=[stop_at])
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == free.token_ids[: first + 1]


def test_min_tokens_holds_eos_back(client: LoraplexClient) -> None:
    short = client.generate_text(messages=ASK, max_new_tokens=64)
    assert short.finish_reason == "stop" and short.usage is not None
    at_least = short.usage.completion_tokens + 8
    longer = client.generate_text(messages=ASK, max_new_tokens=64, min_tokens=at_least)
    assert longer.usage is not None and longer.usage.completion_tokens >= at_least
    assert longer.token_ids[: short.usage.completion_tokens - 1] == short.token_ids[:-1]


def test_min_p_one_is_greedy_and_the_penalties_change_the_answer(client: LoraplexClient) -> None:
    greedy = client.generate_text(STORY, max_new_tokens=16, ignore_eos=True)
    sampled = client.generate_text(STORY, max_new_tokens=16, ignore_eos=True, temperature=1.5, seed=3, min_p=1.0)
    assert sampled.token_ids == greedy.token_ids
    for penalty in ({"presence_penalty": 2.0}, {"frequency_penalty": 2.0}):
        penalised = client.generate_text(STORY, max_new_tokens=16, ignore_eos=True, **penalty)
        assert penalised.token_ids != greedy.token_ids, penalty
        # a penalised greedy answer repeats fewer tokens than the plain one may
        assert len(set(penalised.token_ids)) >= len(set(greedy.token_ids)), penalty


def test_n_gives_n_choices_each_reproducible(client: LoraplexClient) -> None:
    kwargs = dict(max_new_tokens=10, ignore_eos=True, temperature=1.0, seed=7, n=3)
    choices = client.generate_choices(STORY, **kwargs)
    assert [c.index for c in choices] == [0, 1, 2]
    assert all(len(c.token_ids) == 10 and c.finish_reason == "length" for c in choices)
    assert len({c.token_ids for c in choices}) == 3
    assert [c.token_ids for c in client.generate_choices(STORY, **kwargs)] == [c.token_ids for c in choices]
    with pytest.raises(ValueError, match="generate_choices"):
        client.generate_text(STORY, **kwargs)

    async def over_asyncio() -> list[tuple[int, ...]]:
        async with AsyncLoraplexClient(client.address, timeout=300) as aclient:
            return [c.token_ids for c in await aclient.generate_choices(STORY, **kwargs)]
    assert asyncio.run(over_asyncio()) == [c.token_ids for c in choices]


def test_prompt_logprobs_one_per_prompt_token(client: LoraplexClient) -> None:
    out = client.generate_text(STORY, max_new_tokens=2, prompt_logprobs=2, logprobs=True, top_logprobs=1)
    assert out.usage is not None and out.prompt_logprobs is not None and out.prompt_top_logprobs is not None
    assert len(out.prompt_logprobs) == out.usage.prompt_tokens == len(out.prompt_top_logprobs)
    assert math.isnan(out.prompt_logprobs[0]) and all(lp <= 0 for lp in out.prompt_logprobs[1:])
    assert all(len(top) == 2 for top in out.prompt_top_logprobs[1:])
    assert out.top_logprobs is not None and len(out.top_logprobs) == 2
    assert out.top_logprobs[0][0][0] == out.token_ids[0]  # greedy: the chosen token is the most likely


def test_skip_special_tokens_false_shows_special_tokens(client: LoraplexClient) -> None:
    im_start = 1  # SmolLM2's <|im_start|>, a special token that does not stop, forced by logit_bias
    kwargs = dict(max_new_tokens=2, ignore_eos=True, logit_bias={im_start: 100.0})
    hidden = client.generate_text(STORY, **kwargs)
    shown = client.generate_text(STORY, skip_special_tokens=False, **kwargs)
    assert hidden.token_ids == shown.token_ids == (im_start, im_start)
    assert hidden.text == "" and shown.text == "<|im_start|><|im_start|>"


def test_the_server_names_a_field_out_of_range(client: LoraplexClient) -> None:
    for kwargs, field in (({"min_p": 2.0}, "sampling.min_p"), ({"presence_penalty": 3.0}, "sampling.presence_penalty"),
                          ({"logit_bias": {1: 500.0}}, "sampling.logit_bias"), ({"n": 99}, "n")):
        with pytest.raises(InvalidArgumentError) as refused:
            client.generate_choices(STORY, max_new_tokens=2, **kwargs)
        assert refused.value.field == field, kwargs


@pytest.mark.parametrize("kwargs, message", [
    ({"logit_bias": {"13": 1.0}}, r"^logit_bias: keys are token ids"),
    ({"logit_bias": {True: 1.0}}, r"^logit_bias: keys are token ids"),
    ({"logit_bias": {13: "x"}}, r"^logit_bias\[13\]: "),
    ({"logit_bias": [(13, 1.0)]}, r"^logit_bias: must be a mapping"),
    ({"n": -1}, r"^n: "),
    ({"min_tokens": -2}, r"^min_tokens: "),
    ({"prompt_logprobs": 2**33}, r"^prompt_logprobs: "),
])
def test_what_the_message_cannot_hold_is_refused_by_the_client(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        generate_request(STORY, **kwargs)


def test_the_cli_flags(client: LoraplexClient, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    base = ["--address", client.address, "--timeout", "300", "generate", "--quiet"]
    assert main([*base, "--raw", "--max-new-tokens", "3", "--ignore-eos", "--logit-bias", "1024=100", "--json",
                 STORY]) == 0
    events = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [t for e in events for t in e["token_ids"]] == [1024] * 3
    schema = tmp_path / "cat.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}},
                                  "required": ["name"], "additionalProperties": False}))
    assert main([*base, "--json-schema", f"@{schema}", "-n", "2", "--temperature", "1", "--seed", "1",
                 "--max-new-tokens", "40", "A cat's name, as JSON"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [out[0], out[2]] == ["[choice 0]", "[choice 1]"]
    assert all(set(json.loads(line)) == {"name"} for line in (out[1], out[3]))
    with pytest.raises(SystemExit):
        main([*base, "--logit-bias", "oops", "x"])
    assert "TOKEN_ID=BIAS" in capsys.readouterr().err
