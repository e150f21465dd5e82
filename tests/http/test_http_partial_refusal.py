"""A call of several generations (n, a list of prompts) of which the engine refuses one: the 429
comes at once, not once the admitted ones have their first token (a chaos run's finding: with the
queue one place short, an n=3 request hung behind the whole queue, holding that place, instead of
answering 'request queue is full'); the admitted generations are aborted with it."""

from __future__ import annotations

import gc
import logging
import time
from pathlib import Path

import openai
import pytest

from loraplex.inference_server.server.app import ServerOptions
from server_helpers import FakeEngine, ServerThread

BASE = "fake-llama"
TOKEN_S = 20.0  # the fake engine's time to each token: a first token never comes during the test


@pytest.fixture
def one_place(tmp_path: Path):
    """(fake engine with room for one generation, taking TOKEN_S per token; openai client)."""
    srv = ServerThread(ServerOptions(port=0, default_max_new_tokens=4))
    url = srv.start_http(default_max_new_tokens=4)
    engine = FakeEngine(tmp_path / "adapters", step_s=TOKEN_S, max_running=1)
    srv.attach(engine)
    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=TOKEN_S * 2)
    yield engine, client
    client.close()
    srv.close(grace_s=0.5)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("call", ["chat-n", "completion-prompts"])
def test_one_refused_generation_refuses_the_call_at_once(one_place, call: str, stream: bool) -> None:
    engine, client = one_place
    started = time.monotonic()
    with pytest.raises(openai.RateLimitError, match="queue is full"):
        if call == "chat-n":
            client.chat.completions.create(model=BASE, messages=[{"role": "user", "content": "hi"}], n=2,
                                           stream=stream)
        else:
            client.completions.create(model=BASE, prompt=["a", "b"], stream=stream)
    assert time.monotonic() - started < TOKEN_S / 4
    deadline = time.monotonic() + 5
    while engine.running and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not engine.running  # the admitted generation went with the refusal


def test_every_refusal_of_a_call_is_read_not_logged_as_lost(tmp_path: Path, caplog) -> None:
    """Both choices refused: the second refusal is read too, not left for asyncio to log as an
    ERROR 'Task exception was never retrieved' with a traceback."""
    srv = ServerThread(ServerOptions(port=0, default_max_new_tokens=4))
    url = srv.start_http(default_max_new_tokens=4)
    srv.attach(FakeEngine(tmp_path / "adapters", max_running=0))
    with openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=10) as client, \
            caplog.at_level(logging.ERROR, logger="asyncio"):
        with pytest.raises(openai.RateLimitError):
            client.chat.completions.create(model=BASE, messages=[{"role": "user", "content": "hi"}], n=3)
        srv.call(_collect_garbage())
    srv.close(grace_s=0.5)
    assert "never retrieved" not in caplog.text


async def _collect_garbage() -> None:
    gc.collect()  # a task whose exception nobody read logs it when collected
