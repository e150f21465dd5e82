"""The OpenAI-compatible HTTP edge against the fake engine, through the real openai client.

Completions and chat, streamed and whole; adapters by id and as ``base:adapter``; uploads
listed at once; every refusal as the openai exception with its ``param``; malformed, mistyped
and oversized bodies as precise 4xx while the server keeps serving; a client that leaves
mid-stream or mid-answer aborts its request; the router gauges on /metrics; tenants' tokens.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_helpers import ByteTokenizer, FakeEngine, ServerThread, fake_tokens, write_fake_adapter

from loraplex.clients import LoraplexClient
from loraplex.inference_server.auth.security import Security
from loraplex.inference_server.auth.tokens import TokenFile
from loraplex.inference_server.server.app import ServerOptions
from tenant_tokens import TOKENS, write_tokens

BASE = "fake-llama"


@pytest.fixture
def served(tmp_path: Path):
    """(server thread, fake engine, openai client, base URL) with gRPC and HTTP on one state."""
    srv = ServerThread(ServerOptions(port=0, default_max_new_tokens=8))
    url = srv.start_http(default_max_new_tokens=8, max_body_bytes=1_000_000)
    engine = FakeEngine(tmp_path / "adapters")
    srv.attach(engine)
    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=10)
    yield srv, engine, client, url
    client.close()
    srv.close()


def _text(prompt: str, adapter: str | None, n: int) -> str:
    tok = ByteTokenizer()
    return tok.decode(fake_tokens(tuple(tok.encode(prompt)), adapter, n))


def _chat_prompt(content: str) -> str:
    return f"user: {content}\nassistant:"  # ByteTokenizer's chat template, as text


def wait_for(predicate, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def test_completions_whole_and_streamed_match_the_engine(served) -> None:
    _, _, client, _ = served
    whole = client.completions.create(model=BASE, prompt="hello", max_tokens=6)
    assert whole.choices[0].text == _text("hello", None, 6)
    assert whole.choices[0].finish_reason == "length" and whole.model == BASE
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens, whole.usage.total_tokens) == (5, 6, 11)
    chunks = list(client.completions.create(model=BASE, prompt="hello", max_tokens=6, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks][-1] == "length"
    assert len({c.id for c in chunks}) == 1


def test_parameters_openai_lets_be_null_are_read_as_unset(served) -> None:
    """The openai client sends an explicit None as null; OpenAI and vLLM read it as the default (it
    was a 400 "Input should be a valid boolean")."""
    _, _, client, _ = served
    chat = client.chat.completions.create(model=BASE, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                          logprobs=None, n=None, stream=None,
                                          extra_body={"ignore_eos": None, "min_tokens": None,
                                                      "skip_special_tokens": None})
    assert len(chat.choices) == 1 and chat.choices[0].logprobs is None and chat.usage.completion_tokens == 3
    whole = client.completions.create(model=BASE, prompt="hello", max_tokens=6, echo=None, n=None)
    assert whole.choices[0].text == _text("hello", None, 6)


def test_a_refusal_names_the_parameters_as_the_caller_sent_them(served) -> None:
    """min_tokens past the maximum: the message names max_tokens / max_completion_tokens as sent,
    not the engine's max_new_tokens."""
    _, _, client, _ = served
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=BASE, prompt="hi", max_tokens=2, extra_body={"min_tokens": 5})
    assert refused.value.body["param"] == "min_tokens" and "max_tokens=2" in refused.value.body["message"]
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=BASE, messages=[{"role": "user", "content": "hi"}],
                                       max_completion_tokens=2, extra_body={"min_tokens": 5})
    assert "max_completion_tokens=2" in refused.value.body["message"]
    assert "max_new_tokens" not in refused.value.body["message"]


def test_chat_streams_with_role_first_and_usage_last(served) -> None:
    _, engine, client, _ = served
    messages = [{"role": "user", "content": "hi"}]
    chunks = list(client.chat.completions.create(model=BASE, messages=messages, max_completion_tokens=4, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == _text(_chat_prompt("hi"), None, 4)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4
    assert all(c.usage is None for c in chunks[:-1])
    assert engine.requests[-1].prompt_token_ids == tuple(ByteTokenizer().encode(_chat_prompt("hi")))
    whole = client.chat.completions.create(model=BASE, messages=[{"role": "user", "content": [
        {"type": "text", "text": "h"}, {"type": "text", "text": "i"}]}], max_tokens=4)
    assert whole.choices[0].message.content == _text(_chat_prompt("h\ni"), None, 4)  # parts are lines, as vLLM's
    assert whole.choices[0].message.role == "assistant"


def test_sampling_parameters_reach_the_engine(served) -> None:
    _, engine, client, _ = served
    client.completions.create(model=BASE, prompt="x", max_tokens=3, temperature=0.5, top_p=0.9, seed=7,
                              stop=["zz", "yy"], user="u1", extra_body={"top_k": 5, "repetition_penalty": 1.1,
                                                                      "ignore_eos": True})
    r = engine.requests[-1]
    assert (r.sampling.temperature, r.sampling.top_p, r.sampling.top_k, r.sampling.seed) == (0.5, 0.9, 5, 7)
    assert r.sampling.repetition_penalty == 1.1 and r.stopping.ignore_eos
    assert r.stopping.stop_strings == ("zz", "yy") and r.stopping.max_new_tokens == 3
    client.completions.create(model=BASE, prompt=[3, 4, 5])  # token ids; OpenAI's temperature default
    r = engine.requests[-1]
    assert r.prompt_token_ids == (3, 4, 5) and r.sampling.temperature == 1.0 and r.stopping.max_new_tokens == 8


def test_logprobs_in_both_shapes(served) -> None:
    _, _, client, _ = served
    out = client.completions.create(model=BASE, prompt="ab", max_tokens=3, logprobs=2)
    lp = out.choices[0].logprobs
    assert lp.tokens[:2] == list(out.choices[0].text[:2]) and lp.text_offset[:3] == [0, 1, 2]
    assert lp.token_logprobs[0] == -0.5 and list(lp.top_logprobs[0].values()) == [-0.5, -1.5]
    chat = client.chat.completions.create(model=BASE, messages=[{"role": "user", "content": "ab"}], max_tokens=3,
                                          logprobs=True, top_logprobs=2)
    first = chat.choices[0].logprobs.content[0]
    assert first.logprob == -0.5 and [t.logprob for t in first.top_logprobs] == [-0.5, -1.5]
    assert first.bytes == list(first.token.encode())


def test_adapters_by_id_and_base_colon_adapter_and_listed_at_once(served, tmp_path: Path) -> None:
    srv, _, client, url = served
    assert [m.id for m in client.models.list()] == [BASE]
    with LoraplexClient(srv.address, timeout=10) as grpc_client:
        grpc_client.upload_adapter("acme/pirate", write_fake_adapter(tmp_path / "peft"))
    models = {m.id: m for m in client.models.list()}
    assert set(models) == {BASE, "acme/pirate"}
    assert models["acme/pirate"].parent == BASE and models["acme/pirate"].owned_by == "acme"
    assert client.models.retrieve("acme/pirate").id == "acme/pirate"
    assert client.models.retrieve(f"{BASE}:acme/pirate").id == "acme/pirate"  # as a request's model may name it
    assert client.models.retrieve(BASE).id == BASE
    for unknown in ("acme/nobody", "other-base:acme/pirate", "bad name!"):
        with pytest.raises(openai.NotFoundError):
            client.models.retrieve(unknown)
    status, listing = _get(url + "/models/")  # a trailing slash: the list, not the model ''
    assert status == 200 and [m["id"] for m in json.loads(listing)["data"]] == [BASE, "acme/pirate"]
    by_id = client.completions.create(model="acme/pirate", prompt="hello", max_tokens=5).choices[0].text
    colon = client.completions.create(model=f"{BASE}:acme/pirate", prompt="hello", max_tokens=5).choices[0].text
    assert by_id == colon == _text("hello", "acme/pirate", 5) != _text("hello", None, 5)


BAD_COMPLETIONS = [
    ({"n": 0}, "n"), ({"n": 17}, "n"), ({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"),
    ({"seed": -1}, "seed"), ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": 100_000}, "max_tokens"),
    ({"max_tokens": "8"}, "max_tokens"), ({"stop": [""]}, "stop"), ({"logprobs": 30}, "logprobs"),
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"n": 2, "best_of": 1}, "best_of"), ({"best_of": 3, "stream": True}, "best_of"),
    ({"logit_bias": {"x": 1}}, "logit_bias"), ({"logit_bias": {"999": 1}}, "logit_bias"),
    ({"logit_bias": {"\u00b2": 1}}, "logit_bias"), ({"logit_bias": {"1" * 5000: 1}}, "logit_bias"),  # were 500s
    ({"logit_bias": {"\u0661\u0662": 1}}, "logit_bias"),  # Arabic-Indic digits: not token 12
    ({"logit_bias": {"5": 101}}, "logit_bias"), ({"min_p": 2}, "min_p"), ({"min_tokens": -1}, "min_tokens"),
    ({"max_tokens": 4, "min_tokens": 5}, "min_tokens"), ({"stop_token_ids": [999]}, "stop_token_ids"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema"),
    # a strict that is no boolean (was accepted as it came): a known field's bad value is named
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "strict": "yes"}}},
     "response_format.json_schema.strict"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": 5, "schema": {}}}},
     "response_format.json_schema.name"),
    ({"suffix": "x"}, "suffix"),
    ({"stream_options": {"continuous_usage_stats": "yes"}, "stream": True}, "stream_options.continuous_usage_stats"),
    ({"prompt": ["a"] * 65}, "prompt"), ({"prompt": ["a", ""]}, "prompt[1]"), ({"prompt": [[3], [999]]}, "prompt[1]"),
    ({"prompt": [999]}, "prompt"), ({"prompt": ""}, "prompt"),
    ({"prompt": "x" * 300}, "prompt"), ({"stream_options": {"include_usage": True}},
                                                                     "stream_options"),
]
BAD_CHAT = [
    ({"messages": []}, "messages"), ({"messages": [{"role": "function", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"), ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"), ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages[0].content[0].text"),
    ({"tools": [{"type": "function"}]}, "tools[0]"), ({"n": 2, "stream_options": {}}, "stream_options"),
    # calls on a user turn were dropped from the prompt without a word
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [{"id": "1", "type": "function",
                                                                  "function": {"name": "f", "arguments": "{}"}}]}]},
     "messages[0].tool_calls"),
]


@pytest.mark.parametrize(("changes", "param"), BAD_COMPLETIONS)
def test_bad_completion_parameters_are_400_naming_the_param(served, changes: dict, param: str) -> None:
    _, _, client, _ = served
    body = {"model": BASE, "prompt": "hello", **changes}
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(**{k: body.pop(k) for k in ("model", "prompt")}, extra_body=body)
    assert caught.value.body["param"] == param, caught.value.body
    assert caught.value.status_code == 400


def test_top_k_refusal_names_the_values_this_api_takes(served) -> None:
    _, _, client, _ = served
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=BASE, prompt="hello", extra_body={"top_k": -2})
    assert caught.value.body["param"] == "top_k" and "-1" in caught.value.body["message"], caught.value.body


@pytest.mark.parametrize(("changes", "param"), BAD_CHAT)
def test_bad_chat_parameters_are_400_naming_the_param(served, changes: dict, param: str) -> None:
    _, _, client, _ = served
    body = {"model": BASE, "messages": [{"role": "user", "content": "hi"}], **changes}
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(**{k: body.pop(k) for k in ("model", "messages")}, extra_body=body)
    assert caught.value.body["param"] == param, caught.value.body


def test_an_unknown_role_names_its_message_and_every_role(served) -> None:
    _, engine, client, _ = served
    messages = [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "hi"},
                {"role": "wizard", "content": "abracadabra"}]
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=BASE, messages=messages)
    assert caught.value.body["param"] == "messages[2].role"
    assert caught.value.body["message"] == ("messages[2].role: message 2 has role 'wizard'; roles are system, "
                                            "developer, user, assistant, tool")
    assert engine.requests == []


@pytest.mark.parametrize("part", [{"type": "image_url", "image_url": {"url": "https://x/cat.png"}},
                                  {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}},
                                  {"type": "file", "file": {"file_id": "file-1"}}, {"type": "hologram"}])
def test_a_content_part_other_than_text_is_refused_naming_the_part_and_its_type(served, part: dict) -> None:
    _, engine, client, _ = served
    content = [{"type": "text", "text": "what is this?"}, part]
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=BASE, messages=[{"role": "user", "content": content}])
    assert caught.value.body["param"] == "messages[0].content[1].type"
    assert caught.value.body["message"] == (f"messages[0].content[1].type: {part['type']!r} is not supported: "
                                            "the model takes text")
    assert engine.requests == []


@pytest.mark.parametrize("model", ["nope", "acme/nope", "other-base:acme/pirate",
                                   "accounts/fireworks/models/llama-v3", "My Model"])  # no adapter can be named so
def test_unknown_adapter_is_404_never_the_base_model(served, model: str) -> None:
    _, engine, client, _ = served
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], stream=True)
    assert caught.value.body["param"] == "model" and caught.value.body["code"] == "model_not_found"
    assert engine.requests == []


def test_full_queue_is_429_and_not_ready_is_503(served, tmp_path: Path) -> None:
    srv, engine, client, _ = served
    engine.max_running = 0
    with pytest.raises(openai.RateLimitError):
        client.completions.create(model=BASE, prompt="hi")
    engine.max_running = 64
    loading = ServerThread(ServerOptions(port=0))  # no engine attached: the model is "loading"
    try:
        url = loading.start_http()
        with pytest.raises(openai.InternalServerError) as caught:
            openai.OpenAI(base_url=url, api_key="x", max_retries=0).completions.create(model=BASE, prompt="hi")
        assert caught.value.status_code == 503
        assert _get(url.removesuffix("/v1") + "/health")[0] == 503
    finally:
        loading.close()
    assert _get(served[3].removesuffix("/v1") + "/health") == (200, b'{"status":"SERVING"}')


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _post(url: str, body: bytes, content_type: str = "application/json") -> tuple[int, dict]:
    request = urllib.request.Request(url, data=body, headers={"Content-Type": content_type})
    try:
        with urllib.request.urlopen(request, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.mark.parametrize(("body", "content_type", "status", "fragment"), [
    (b'{"model": "fake-llama", "prompt": ', "application/json", 400, "not valid JSON"),
    (b'[1, 2]', "application/json", 400, "JSON object"),
    (b'{"model": "fake-llama", "prompt": "hi"}', "text/plain", 415, "Content-Type"),
])
def test_malformed_mistyped_and_huge_bodies_are_4xx_and_serving_goes_on(served, body, content_type, status,
                                                                         fragment) -> None:
    _, _, client, url = served
    got, answer = _post(url + "/completions", body, content_type)
    assert got == status and fragment in answer["error"]["message"], answer
    assert client.completions.create(model=BASE, prompt="hi", max_tokens=2).choices[0].text == _text("hi", None, 2)


def _send_ignoring_a_closed_socket(sock: socket.socket, data: bytes) -> None:
    try:
        sock.sendall(data)
    except OSError:
        pass  # the server answered 413 and closed before the whole body arrived, as it should


@pytest.mark.parametrize("chunked", [False, True])
def test_a_10_mb_body_is_413_before_it_is_read_whole(served, chunked: bool) -> None:
    _, _, client, url = served
    host, port = url.split("//")[1].split("/")[0].split(":")
    body = b'{"model": "fake-llama", "prompt": "' + b"x" * (10 << 20) + b'"}'
    framing = b"Transfer-Encoding: chunked\r\n" if chunked else b"Content-Length: %d\r\n" % len(body)
    if chunked:
        body = b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in (body[i:i + 65536] for i in range(0, len(body), 65536)))
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" + framing
                     + b"\r\n")
        sender = threading.Thread(target=_send_ignoring_a_closed_socket, args=(sock, body))
        sender.start()
        response = http.client.HTTPResponse(sock)
        response.begin()
        answer = json.loads(response.read())
        sender.join(10)
    assert response.status == 413 and "larger than this server's limit of 1000000 bytes" in answer["error"]["message"]
    assert client.completions.create(model=BASE, prompt="hi", max_tokens=2).choices[0].text == _text("hi", None, 2)


def test_a_refused_body_is_drained_not_reset(served) -> None:
    """A server that closes with a refused body's bytes still arriving makes the kernel reset the
    connection, and a reset can destroy the answer before the client reads it (the client's writes
    fail, its reads end early). So after a 413 the server half-closes and reads the rest of the body
    away: the client reads the whole answer, then sends its 4 MB body without an error, and the
    connection ends cleanly once it stops sending."""
    _, _, client, url = served
    host, port = url.split("//")[1].split("/")[0].split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % (4 << 20))
        response = http.client.HTTPResponse(sock)
        response.begin()
        answer = json.loads(response.read())
        assert response.status == 413 and response.getheader("connection") == "close"
        assert "larger than this server's limit" in answer["error"]["message"]
        sock.sendall(b"x" * (4 << 20))  # a reset connection raises here
        sock.shutdown(socket.SHUT_WR)
        assert sock.recv(1) == b""
    assert client.completions.create(model=BASE, prompt="hi", max_tokens=2).choices[0].text == _text("hi", None, 2)


def test_unknown_route_and_method_are_openai_shaped(served) -> None:
    url = served[3]
    status, body = _get(url + "/nothing")
    assert status == 404 and json.loads(body)["error"]["type"] == "invalid_request_error"
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(url + "/completions", timeout=5)
    assert caught.value.code == 405 and caught.value.headers["Allow"] == "POST"  # RFC 9110: a 405 names the methods


def _open_stream(url: str, body: dict) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    host, port = url.split("//")[1].split("/")[0].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    return conn, conn.getresponse()


def test_disconnect_mid_stream_aborts_the_request(served) -> None:
    _, engine, _, url = served
    conn, response = _open_stream(url, {"model": BASE, "prompt": "hi", "max_tokens": 240, "stream": True})
    assert response.status == 200 and response.getheader("content-type").startswith("text/event-stream")
    assert response.readline().startswith(b"data: {")
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    wait_for(lambda: len(engine.aborted) == 1 and not engine.running)
    assert engine.aborted == [engine.requests[-1].request_id]


def test_disconnect_while_waiting_for_a_whole_answer_aborts_it(served) -> None:
    _, engine, _, url = served
    host, port = url.split("//")[1].split("/")[0].split(":")
    body = json.dumps({"model": BASE, "prompt": "hi", "max_tokens": 240}).encode()
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        wait_for(lambda: engine.running)
    wait_for(lambda: len(engine.aborted) == 1 and not engine.running)


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_gone_before_its_first_token_is_aborted_at_once(tmp_path: Path, stream: bool) -> None:
    """A request still queued (or waiting for its adapter) when its client leaves is aborted
    then, not when its first token arrives: it would hold a slot and be prefilled for nobody."""
    srv = ServerThread(ServerOptions(port=0, default_max_new_tokens=4))
    url = srv.start_http(default_max_new_tokens=4)
    engine = FakeEngine(tmp_path / "adapters", step_s=3.0)  # the first token takes 3 s
    srv.attach(engine)
    try:
        host, port = url.split("//")[1].split("/")[0].split(":")
        body = json.dumps({"model": BASE, "prompt": "hi", "max_tokens": 4, "stream": stream}).encode()
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            wait_for(lambda: engine.running)
        left = time.monotonic()
        wait_for(lambda: len(engine.aborted) == 1, timeout=10)
        assert time.monotonic() - left < 1.5, "aborted only when the first token came"
    finally:
        srv.close()


def _families(url: str) -> dict:
    text = _get(url.removesuffix("/v1") + "/metrics")[1].decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_router_gauges_move_while_requests_run(served, tmp_path: Path) -> None:
    srv, engine, client, url = served
    with LoraplexClient(srv.address, timeout=10) as grpc_client:
        grpc_client.upload_adapter("acme/pirate", write_fake_adapter(tmp_path / "peft"))
    idle = _families(url)
    assert idle["vllm:num_requests_running"].samples[0].value == 0
    assert idle["vllm:lora_requests_info"].samples[0].labels["running_lora_adapters"] == ""
    threads = [threading.Thread(target=lambda m=m: client.completions.create(model=m, prompt="x", max_tokens=200))
               for m in ("acme/pirate", BASE, "acme/pirate")]
    for t in threads:
        t.start()
    wait_for(lambda: len(engine.running) == 3)
    busy = _families(url)
    for t in threads:
        t.join(10)
    assert busy["vllm:num_requests_running"].samples[0].value == 3
    assert busy["vllm:kv_cache_usage_perc"].samples[0].value == pytest.approx(3 / FakeEngine.TOTAL_BLOCKS)
    info = busy["vllm:lora_requests_info"].samples[0]
    assert info.labels == {"running_lora_adapters": "acme/pirate", "waiting_lora_adapters": "", "max_lora": "2"}
    assert info.value == pytest.approx(time.time(), abs=30)
    done = {(s.labels["route"], s.labels["status"]): s.value for s in _families(url)["loraplex_http_requests"].samples
            if s.name.endswith("_total")}
    assert done[("/v1/completions", "200")] == 3 and _families(url)["vllm:num_requests_running"].samples[0].value == 0


@pytest.fixture
def tenant_http(tmp_path: Path):
    tokens_path = tmp_path / "tokens.json"
    write_tokens(tokens_path, TOKENS)
    srv = ServerThread(ServerOptions(port=0), security=Security(tokens=TokenFile(str(tokens_path))))
    url = srv.start_http()
    srv.attach(FakeEngine(tmp_path / "adapters"))
    with LoraplexClient(srv.address, timeout=10, token=TOKENS["admin"]) as admin:
        for adapter_id in ("a/private", "b/private", "shared"):
            admin.upload_adapter(adapter_id, write_fake_adapter(tmp_path / "peft"))
    yield url
    srv.close()


def test_bearer_tokens_map_to_the_grpc_tenants(tenant_http) -> None:
    def as_(who: str | None) -> openai.OpenAI:
        return openai.OpenAI(base_url=tenant_http, api_key=TOKENS.get(who, "wrong-token-0123456789"), max_retries=0)

    with pytest.raises(openai.AuthenticationError):
        as_(None).models.list()
    assert [m.id for m in as_("a").models.list()] == [BASE, "a/private", "shared"]
    assert as_("a").completions.create(model="a/private", prompt="x", max_tokens=2).choices[0].text
    with pytest.raises(openai.NotFoundError):  # another tenant's private adapter does not exist for a
        as_("a").completions.create(model="b/private", prompt="x", max_tokens=2)
    assert {m.id for m in as_("admin").models.list()} == {BASE, "a/private", "b/private", "shared"}
    assert _get(tenant_http.removesuffix("/v1") + "/health")[0] == 200  # probes need no token


def test_tls_uses_the_grpc_ports_certificate(tmp_path: Path) -> None:
    import ssl  # noqa: PLC0415

    from loraplex.inference_server.auth.security import TlsFiles  # noqa: PLC0415
    from tls_helpers import make_tls_files  # noqa: PLC0415

    files = make_tls_files(tmp_path)
    security = Security(tls=TlsFiles(str(files.server_cert), str(files.server_key)))
    srv = ServerThread(ServerOptions(port=0), security=security)
    try:
        url = srv.start_http()
        srv.attach(FakeEngine(tmp_path / "adapters"))
        assert url.startswith("https://")
        trusted = openai.OpenAI(base_url=url, api_key="x", max_retries=0,
                                http_client=openai.DefaultHttpxClient(verify=ssl.create_default_context(
                                    cafile=str(files.ca))))
        assert trusted.completions.create(model=BASE, prompt="hi", max_tokens=2).choices[0].text == _text("hi", None, 2)
        with pytest.raises(openai.APIConnectionError):  # plaintext, or a certificate it cannot verify
            openai.OpenAI(base_url=url, api_key="x", max_retries=0).models.list()
    finally:
        srv.close()
