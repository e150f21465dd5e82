"""/v1/completions with a list of prompts (issue 48 item 4): one choice per prompt and choice,
numbered prompt * n + i as OpenAI and vLLM number them, streamed or whole, usage summed as OpenAI
sums it (each prompt once, every choice's tokens), a per-request cap on the list; against the
real engine, a batch of 4 prompts answers what 4 single requests answer (greedy)."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from loraplex.inference_server.server.app import ServerOptions
from server_helpers import ByteTokenizer, FakeEngine, ServerThread, fake_tokens
from test_http_edge import BASE, _text, served  # noqa: F401  (fixture)
from test_http_sampling import live  # noqa: F401  (fixture)

PROMPTS = ["hello", "a longer prompt", "x"]


def test_a_batch_of_prompts_is_one_choice_per_prompt_and_choice(served) -> None:  # noqa: F811
    _, engine, client, _ = served
    out = client.completions.create(model=BASE, prompt=PROMPTS, max_tokens=4, n=2, seed=3, temperature=0.5)
    assert [c.index for c in out.choices] == list(range(6))
    assert [c.text for c in out.choices] == [_text(p, None, 4) for p in PROMPTS for _ in range(2)]
    requests = engine.requests[-6:]
    assert [r.prompt_token_ids for r in requests] == [tuple(ByteTokenizer().encode(p)) for p in PROMPTS for _ in "ab"]
    assert len({r.prompt_group for r in requests}) == 3 and [r.sampling.seed for r in requests] == [3, 4] * 3
    assert out.usage.prompt_tokens == sum(len(p) for p in PROMPTS)  # each prompt once, as OpenAI sums them
    assert out.usage.completion_tokens == 24 and out.usage.total_tokens == 24 + out.usage.prompt_tokens


def test_a_batch_streams_each_choice_under_its_index_and_sums_its_usage(served) -> None:  # noqa: F811
    _, _, client, _ = served
    chunks = list(client.completions.create(model=BASE, prompt=PROMPTS, max_tokens=3, n=2, stream=True,
                                            stream_options={"include_usage": True}))
    texts: dict[int, str] = {}
    for c in chunks[:-1]:
        texts[c.choices[0].index] = texts.get(c.choices[0].index, "") + c.choices[0].text
    assert texts == {p * 2 + i: _text(prompt, None, 3) for p, prompt in enumerate(PROMPTS) for i in range(2)}
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens == sum(len(p) for p in PROMPTS)
    assert chunks[-1].usage.completion_tokens == 18


def test_token_id_prompts_echo_and_best_of_are_per_prompt(served) -> None:  # noqa: F811
    _, engine, client, _ = served
    ids = [[100, 101], [102]]
    out = client.completions.create(model=BASE, prompt=ids, max_tokens=2, echo=True)
    tok = ByteTokenizer()
    assert [c.text for c in out.choices] == [tok.decode(p) + tok.decode(fake_tokens(tuple(p), None, 2)) for p in ids]
    best = client.completions.create(model=BASE, prompt=["ab", "cd"], max_tokens=2, n=1, best_of=3)
    assert [c.index for c in best.choices] == [0, 1]
    assert [c.text for c in best.choices] == [_text("ab", None, 2), _text("cd", None, 2)]
    assert len(engine.requests) == 2 + 6


def test_more_prompts_than_the_cap_is_400_naming_the_setting(tmp_path: Path) -> None:
    srv = ServerThread(ServerOptions(port=0))
    url = srv.start_http(max_batch_prompts=2)
    engine = FakeEngine(tmp_path / "adapters")
    srv.attach(engine)
    try:
        client = openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=10)
        assert len(client.completions.create(model=BASE, prompt=["a", "b"], max_tokens=1).choices) == 2
        with pytest.raises(openai.BadRequestError) as caught:
            client.completions.create(model=BASE, prompt=["a", "b", "c"], max_tokens=1)
        assert caught.value.body["param"] == "prompt" and "--max-batch-prompts" in caught.value.body["message"]
        assert len(engine.requests) == 2
    finally:
        srv.close()


@pytest.mark.slow
def test_real_engine_a_batch_of_4_prompts_answers_what_4_single_requests_answer(live) -> None:  # noqa: F811
    _, engine, url = live
    client = openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=60)
    base = engine.info.model_name
    prompts = ["Once upon a time", "The capital of France is", "1, 2, 3,", "def main():"]
    args = dict(model=base, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    singles = [client.completions.create(prompt=p, **args).choices[0].text for p in prompts]
    batch = client.completions.create(prompt=prompts, **args)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert [c.text for c in batch.choices] == singles
    assert batch.usage.prompt_tokens == sum(len(engine.tokenizer.encode(p)) for p in prompts)
    assert batch.usage.completion_tokens == 32
    streamed: dict[int, str] = {}
    for chunk in client.completions.create(prompt=prompts, stream=True, **args):
        streamed[chunk.choices[0].index] = streamed.get(chunk.choices[0].index, "") + chunk.choices[0].text
    assert [streamed[i] for i in range(4)] == singles
