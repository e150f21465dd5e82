"""The parameters real OpenAI clients send, over the HTTP edge with the real openai client (#41
item 3): against the fake engine, what reaches the engine and how answers are shaped (unknown
fields accepted and named, ``n`` choices, continuous usage, echo, OpenAI's error codes); against
the real engine on a tiny Llama, the same over real sampling: ``n`` seeded choices, echo with
the prompt's log-probabilities, a prompt plus max_tokens past the window refused, and gRPC's
fields (n, penalties, logit_bias, min_tokens, prompt_logprobs) giving the HTTP edge's answers."""

from __future__ import annotations

import json
import logging
import math
import urllib.request
from pathlib import Path

import grpc
import openai
import pytest

from loraplex.inference_server.build import build_engine

from loraplex.inference_server.engine.async_engine import AsyncEngine
from loraplex.inference_server.engine.config import EngineConfig
from loraplex.inference_server.model.checkpoint import ModelSource
from loraplex.inference_server.server.app import ServerOptions
from loraplex.v1 import inference_pb2 as pb, inference_pb2_grpc as pb_grpc
from server_helpers import ServerThread
from test_http_edge import BASE, _text, served  # noqa: F401  (fixture)


def _post(url: str, body: dict):
    """(status, headers (case-insensitive), JSON answer)."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as r:
        return r.status, r.headers, json.loads(r.read())


def test_unknown_fields_are_accepted_ignored_named_and_logged(served, caplog) -> None:  # noqa: F811
    _, engine, _, url = served
    body = {"model": BASE, "prompt": "hi", "max_tokens": 3, "guided_whatever": 1, "stream_options": None,
            "priority": 0}
    with caplog.at_level(logging.WARNING):
        status, headers, answer = _post(url + "/completions", body)
    assert status == 200 and answer["choices"][0]["text"] == _text("hi", None, 3)
    assert headers["X-Loraplex-Ignored-Fields"] == "guided_whatever,priority"
    assert "guided_whatever, priority" in caplog.text
    chat = {"model": BASE, "messages": [{"role": "user", "content": "hi", "weight": 2}], "max_tokens": 2,
            "store": False}
    assert _post(url + "/chat/completions", chat)[1]["X-Loraplex-Ignored-Fields"] == "messages[0].weight,store"
    _, plain_headers, _ = _post(url + "/completions", {"model": BASE, "prompt": "hi", "max_tokens": 1})
    assert plain_headers.get("X-Loraplex-Ignored-Fields") is None
    # names no header can carry as they are (letters outside Latin-1, a line break, a comma): escaped
    odd = {"model": BASE, "prompt": "hi", "max_tokens": 1, "\u540d\u524d": 1, "a\nb": 2, "x,y": 3}
    status, odd_headers, _ = _post(url + "/completions", odd)
    assert status == 200 and odd_headers["X-Loraplex-Ignored-Fields"] == "a\\nb,x\\x2cy,\\u540d\\u524d"  # in name order
    # hundreds of unknown fields (800 chat messages with a few extra keys each made 33-270 KB): the header
    # and the log line name the first ~1 KB, then how many more
    many = {"model": BASE, "prompt": "hi", "max_tokens": 1, **{f"extra_field_{i:04d}": i for i in range(600)}}
    with caplog.at_level(logging.WARNING):
        status, many_headers, _ = _post(url + "/completions", many)
    names = many_headers["X-Loraplex-Ignored-Fields"].split(",")
    assert status == 200 and names[:2] == ["extra_field_0000", "extra_field_0001"]
    assert len(",".join(names)) < 1100 and names[-1] == f"+{600 - len(names) + 1} more"
    assert f"{names[-2]}, {names[-1]}" in caplog.text and "extra_field_0599" not in caplog.text


def test_parameters_that_change_the_answer_but_are_not_honoured_are_refused_by_name(served) -> None:  # noqa: F811
    """guided_json, functions, include_stop_str_in_output...: ignoring them would answer wrongly
    with a 200 (free text for a schema); a value that asks for nothing, and null, are accepted."""
    _, engine, client, _ = served
    msgs = [{"role": "user", "content": "hi"}]
    asked = [(client.chat.completions.create, dict(functions=[{"name": "f"}]), "functions"),
             (client.chat.completions.create, dict(modalities=["text", "audio"]), "modalities"),
             (client.chat.completions.create, dict(extra_body={"guided_json": {"type": "object"}}), "guided_json"),
             (client.chat.completions.create, dict(extra_body={"echo": True}), "echo"),
             (client.chat.completions.create, dict(extra_body={"best_of": 3}), "best_of"),  # completions' only
             (client.completions.create, dict(extra_body={"include_stop_str_in_output": True}),
              "include_stop_str_in_output"),
             (client.completions.create, dict(extra_body={"prompt_logprobs": 1}), "prompt_logprobs")]
    for create, extra, param in asked:
        args = dict(messages=msgs) if create == client.chat.completions.create else dict(prompt="hi")
        with pytest.raises(openai.BadRequestError) as refused:
            create(model=BASE, max_tokens=2, **args, **extra)
        assert refused.value.body["param"] == param and "not supported" in refused.value.body["message"]
    sent = len(engine.requests)
    client.chat.completions.create(model=BASE, messages=msgs, max_tokens=2, modalities=["text"],
                                   extra_body={"guided_json": None, "echo": False, "functions": []})
    assert len(engine.requests) == sent + 1


def test_max_completion_tokens_bounds_completions_too(served) -> None:  # noqa: F811
    """The newer name of max_tokens, which wins on chat, was ignored on /v1/completions (the
    answer ran to the server's default length); over the window it is named as sent."""
    _, engine, client, _ = served
    client.completions.create(model=BASE, prompt="abc", max_tokens=5, extra_body={"max_completion_tokens": 2})
    assert engine.requests[-1].stopping.max_new_tokens == 2
    client.completions.create(model=BASE, prompt="abc", max_tokens=5, extra_body={"max_completion_tokens": None})
    assert engine.requests[-1].stopping.max_new_tokens == 5
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=BASE, prompt="abc", extra_body={"max_completion_tokens": 0})
    assert refused.value.body["param"] == "max_completion_tokens"


def test_vllm_and_openai_sampling_parameters_reach_the_engine(served) -> None:  # noqa: F811
    _, engine, client, _ = served
    client.completions.create(model=BASE, prompt="abc", max_tokens=6, presence_penalty=0.5, frequency_penalty=-0.5,
                              logit_bias={"7": 5, "9": -100}, extra_body={
                                  "min_p": 0.1, "min_tokens": 2, "stop_token_ids": [4, 5], "top_k": -1,
                                  "skip_special_tokens": False, "response_format": {"type": "text"}})
    r = engine.requests[-1]
    assert (r.sampling.presence_penalty, r.sampling.frequency_penalty, r.sampling.min_p) == (0.5, -0.5, 0.1)
    assert r.sampling.logit_bias == ((7, 5.0), (9, -100.0)) and r.sampling.top_k == 0
    assert r.stopping.min_tokens == 2 and r.stopping.stop_token_ids == (4, 5) and not r.skip_special_tokens


def test_n_choices_each_their_own_request_of_one_prompt_group(served) -> None:  # noqa: F811
    _, engine, client, _ = served
    out = client.chat.completions.create(model=BASE, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                         n=3, seed=10, temperature=0.7)
    assert [c.index for c in out.choices] == [0, 1, 2]
    requests = engine.requests[-3:]
    assert len({r.request_id for r in requests}) == 3 and len({r.prompt_group for r in requests}) == 1
    assert sorted(r.sampling.seed for r in requests) == [10, 11, 12]
    assert out.usage.completion_tokens == 12 and out.usage.prompt_tokens == len(requests[0].prompt_token_ids)
    chunks = list(client.completions.create(model=BASE, prompt="hey", max_tokens=3, n=2, stream=True,
                                            stream_options={"include_usage": True}))
    texts = {0: "", 1: ""}
    for c in chunks[:-1]:
        texts[c.choices[0].index] += c.choices[0].text
    assert texts == {0: _text("hey", None, 3), 1: _text("hey", None, 3)}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6


def test_continuous_usage_stats_put_usage_on_every_chunk(served) -> None:  # noqa: F811
    _, _, client, _ = served
    chunks = list(client.completions.create(model=BASE, prompt="hello", max_tokens=4, stream=True,
                                            stream_options={"include_usage": True, "continuous_usage_stats": True}))
    counted = [c.usage.completion_tokens for c in chunks[:-1]]
    assert counted == [1, 2, 3, 4] and all(c.usage.prompt_tokens == 5 for c in chunks)
    assert chunks[-1].usage.total_tokens == 9


def test_echo_puts_the_prompt_first(served) -> None:  # noqa: F811
    _, _, client, _ = served
    out = client.completions.create(model=BASE, prompt="hello", max_tokens=3, echo=True)
    assert out.choices[0].text == "hello" + _text("hello", None, 3)
    chunks = list(client.completions.create(model=BASE, prompt="hello", max_tokens=3, echo=True, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == out.choices[0].text


def test_past_the_context_window_is_context_length_exceeded(served) -> None:  # noqa: F811
    _, engine, client, _ = served
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=BASE, messages=[{"role": "user", "content": "x" * 40}], max_tokens=230)
    body = caught.value.body
    assert body["code"] == "context_length_exceeded" and body["param"] == "messages"
    assert "maximum context length is 256 tokens" in body["message"]
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=BASE, prompt="x" * 300)
    assert caught.value.body["code"] == "context_length_exceeded" and caught.value.body["param"] == "prompt"
    count = len(engine.requests)
    out = client.completions.create(model=BASE, prompt="x" * 250)  # no max_tokens: the default, cut to the room left
    assert out.usage.completion_tokens <= 6 and len(engine.requests) == count + 1


# -- the real engine ----------------------------------------------------------------------


def _live_server(model_dir: Path, adapter_dir: Path, max_new_tokens: int, **engine):
    """A gRPC + HTTP server over a real engine on ``model_dir``: yields (server, engine, HTTP url)."""
    srv = ServerThread(ServerOptions(port=0, default_max_new_tokens=max_new_tokens))
    url = srv.start_http(default_max_new_tokens=max_new_tokens)
    config = EngineConfig(num_kv_blocks=64, block_size=16, max_num_batched_tokens=256, **engine)
    built = build_engine(AsyncEngine, config, ModelSource(path=str(model_dir)), adapter_dir, progress=False)
    srv.attach(built)
    yield srv, built, url
    srv.close()


@pytest.fixture(scope="module")
def live(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    yield from _live_server(tiny_llama_dir, tmp_path_factory.mktemp("a"), 8, max_num_seqs=8)


@pytest.mark.slow
def test_real_engine_n_choices_and_echo_with_prompt_logprobs(live) -> None:
    srv, engine, url = live
    client = openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=60)
    base = engine.info.model_name
    many = client.completions.create(model=base, prompt="Once upon a time", max_tokens=6, n=3, temperature=1.0,
                                     seed=21, extra_body={"ignore_eos": True})
    one = client.completions.create(model=base, prompt="Once upon a time", max_tokens=6, temperature=1.0, seed=22,
                                    extra_body={"ignore_eos": True})
    assert many.choices[1].text == one.choices[0].text  # choice i is seeded seed + i
    assert len({c.text for c in many.choices}) == 3 and many.usage.completion_tokens == 18
    top = 2**63 - 1  # the largest seed: choice 1 draws with seed 0 (seed + i wraps), never a refusal
    wrapped = client.completions.create(model=base, prompt="Once upon a time", max_tokens=6, n=2, temperature=1.0,
                                        seed=top, extra_body={"ignore_eos": True})
    zero = client.completions.create(model=base, prompt="Once upon a time", max_tokens=6, temperature=1.0, seed=0,
                                     extra_body={"ignore_eos": True})
    assert wrapped.choices[1].text == zero.choices[0].text
    echo = client.completions.create(model=base, prompt="The sky is", max_tokens=2, echo=True, logprobs=2,
                                     temperature=0, extra_body={"ignore_eos": True})
    lp = echo.choices[0].logprobs
    prompt_ids = engine.tokenizer.encode("The sky is")
    assert echo.choices[0].text.startswith("The sky is") and len(lp.tokens) == len(prompt_ids) + 2
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v < 0 for v in lp.token_logprobs[1:]) and all(len(t) <= 3 for t in lp.top_logprobs[1:])
    assert all(t[name] == v for t, name, v in zip(lp.top_logprobs[1:], lp.tokens[1:], lp.token_logprobs[1:]))
    assert lp.text_offset[0] == 0 and lp.text_offset[len(prompt_ids)] == len("The sky is")
    best = client.completions.create(model=base, prompt="Hi", max_tokens=4, n=1, best_of=3, temperature=1.0, seed=1)
    assert len(best.choices) == 1 and best.choices[0].logprobs is None
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=base, prompt="Hi", max_tokens=engine.info.max_context_len)
    assert caught.value.body["code"] == "context_length_exceeded"


@pytest.mark.slow
def test_real_engine_names_a_split_emoji_by_its_bytes_and_logprobs_0_gives_each_token(live) -> None:
    srv, engine, url = live
    client = openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=60)
    out = client.completions.create(model=engine.info.model_name, prompt="Hi 🦙", max_tokens=3, echo=True,
                                    logprobs=0, temperature=0, extra_body={"ignore_eos": True})
    lp, text = out.choices[0].logprobs, out.choices[0].text
    assert lp.tokens[:4] == ["Hi", " \\xf0\\x9f", "\\xa6", "\\x99"]  # " 🦙" in three tokens, named by their bytes
    assert lp.text_offset[:5] == [0, 2, 3, 3, 4]  # the emoji's parts at its offset, the answer after it
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[-1] <= len(text)
    assert lp.top_logprobs[0] is None and len(lp.top_logprobs) == 7  # null: the first prompt token only
    assert lp.top_logprobs[1:] == [{name: value} for name, value in zip(lp.tokens[1:], lp.token_logprobs[1:])]


@pytest.mark.slow
def test_grpc_fields_give_the_http_answers(live) -> None:
    srv, engine, url = live
    client = openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=60)
    base = engine.info.model_name
    eos = engine.info.eos_token_ids[0]
    http = client.completions.create(model=base, prompt="Rust or Go?", max_tokens=8, temperature=0.8, seed=9, n=2,
                                     presence_penalty=0.4, frequency_penalty=0.7, logit_bias={str(eos): 100},
                                     extra_body={"min_tokens": 5, "min_p": 0.05})
    request = pb.GenerateRequest(
        text="Rust or Go?", n=2,
        sampling=pb.SamplingParams(temperature=0.8, seed=9, presence_penalty=0.4, frequency_penalty=0.7, min_p=0.05,
                                   logit_bias={eos: 100.0}, prompt_logprobs=1),
        stopping=pb.StoppingCriteria(max_new_tokens=8, min_tokens=5))
    with grpc.insecure_channel(srv.address) as channel:
        messages = list(pb_grpc.InferenceServiceStub(channel).Generate(request, timeout=60))
    texts, finished = {0: "", 1: ""}, {}
    for m in messages:
        texts[m.index] += m.text
        if m.finish_reason:
            finished[m.index] = m.usage.completion_tokens
    assert texts == {c.index: c.text for c in http.choices}
    assert finished == {0: 6, 1: 6}  # EOS pushed up, held back for 5 tokens
    firsts = [m for m in messages if m.prompt_logprobs]
    assert len(firsts) == 2 and math.isnan(firsts[0].prompt_logprobs[0])
    assert len(firsts[0].prompt_logprobs) == len(engine.tokenizer.encode("Rust or Go?"))
    assert len(firsts[0].prompt_top_logprobs[1].candidates) == 1


@pytest.fixture(scope="module")
def small_queue(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """A real engine that holds 4 streams at once (2 running, 2 waiting)."""
    yield from _live_server(tiny_llama_dir, tmp_path_factory.mktemp("q"), 4, max_num_seqs=2, max_waiting=2)


@pytest.mark.slow
def test_more_choices_than_the_engine_holds_is_a_bad_request_not_a_retry_forever(small_queue) -> None:
    srv, engine, url = small_queue
    client = openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=60)
    base = engine.info.model_name
    refusals = [
        (lambda: client.completions.create(model=base, prompt="Hi", max_tokens=2, n=5), "n", "5 choices is 5"),
        (lambda: client.completions.create(model=base, prompt=["a", "b", "c"], max_tokens=2, n=2), "n",
         "2 choices for each of 3 prompts is 6"),
        (lambda: client.completions.create(model=base, prompt="Hi", max_tokens=2, n=1, best_of=5), "best_of",
         "5 choices is 5"),
        (lambda: client.chat.completions.create(model=base, messages=[{"role": "user", "content": "Hi"}],
                                                max_tokens=2, n=5), "n", "5 choices is 5"),
    ]
    for call, param, said in refusals:
        with pytest.raises(openai.BadRequestError) as caught:
            call()
        assert caught.value.body["param"] == param
        assert said in caught.value.body["message"] and "holds at once" in caught.value.body["message"]
    with grpc.insecure_channel(srv.address) as channel:
        stub = pb_grpc.InferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.Generate(pb.GenerateRequest(text="Hi", n=5), timeout=60))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "n:" in refused.value.details()
    # as many choices as the engine holds are all admitted and answered
    full = client.completions.create(model=base, prompt=["a", "b"], max_tokens=2, n=2, temperature=1.0, seed=3)
    assert len(full.choices) == 4 and all(c.finish_reason for c in full.choices)
