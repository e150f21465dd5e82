"""A text prompt far past the context window is refused before it is tokenized (#29 item 4):
at once, naming the field, without the CPU and memory that tokenizing megabytes costs, while
other requests go on being served. The real engine (tiny random Llama with SmolLM2's
tokenizer) behind the real gRPC edge."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from loraplex.clients import LoraplexClient
from loraplex.clients.errors import InvalidArgumentError
from loraplex.inference_server.build import build_engine
from loraplex.inference_server.engine.async_engine import AsyncEngine
from loraplex.inference_server.engine.config import EngineConfig
from loraplex.inference_server.model.checkpoint import ModelSource
from loraplex.inference_server.model.tokenizer import Tokenizer
from loraplex.inference_server.server.app import ServerOptions
from server_helpers import ServerThread



def _rss_bytes() -> int:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.fixture(scope="module")
def served(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    srv = ServerThread(ServerOptions(port=0, default_max_new_tokens=4))
    srv.http_url = srv.start_http(default_max_new_tokens=4)
    config = EngineConfig(num_kv_blocks=64, block_size=16, max_num_seqs=4, max_num_batched_tokens=256)
    engine = build_engine(AsyncEngine, config, ModelSource(path=str(tiny_llama_dir)), tmp_path_factory.mktemp("a"),
                               progress=False)
    srv.attach(engine)
    yield srv, engine
    srv.close()


@pytest.mark.slow
def test_a_7_mib_text_prompt_is_refused_at_once_without_growing_the_server(served) -> None:
    srv, engine = served
    text = "lorem ipsum dolor sit amet " * (7 * 2**20 // 27)
    with LoraplexClient(srv.address, retry_attempts=1, timeout=30) as client:
        client.generate_text("warm up", max_new_tokens=1)
        carried = _rss_bytes()  # what carrying 7 MiB through gRPC (both ends in this process) keeps
        with pytest.raises(InvalidArgumentError, match="top_p"):
            client.generate_text(text, max_new_tokens=1, top_p=2.0)  # refused before the prompt is read
        rss, carried = _rss_bytes(), _rss_bytes() - carried
        cpu, started = time.process_time(), time.monotonic()
        with pytest.raises(InvalidArgumentError, match=r"text: .*characters.*context window") as err:
            client.generate_text(text, max_new_tokens=1)
        wall, spent, grown = time.monotonic() - started, time.process_time() - cpu, _rss_bytes() - rss
        assert err.value.field == "text"
        assert wall < 2.0 and spent < 2.0, (wall, spent)  # tokenizing it took 11-13 s of CPU
        assert grown < carried + 32 * 2**20, (grown / 2**20, carried / 2**20)  # tokenizing it kept ~600 MiB
        assert client.generate_text("still serving", max_new_tokens=2).usage.completion_tokens == 2


@pytest.mark.slow
def test_a_prompt_just_inside_the_bound_is_tokenized_and_judged_by_its_tokens(served) -> None:
    """Under the character bound the prompt is tokenized as always: the window is then judged in
    tokens (the bound never refuses a prompt that would fit)."""
    srv, engine = served
    limit = engine.info.max_context_len
    with LoraplexClient(srv.address, retry_attempts=1, timeout=30) as client:
        fits = "hi " * (limit // 4)
        assert client.generate_text(fits, max_new_tokens=1).usage.prompt_tokens < limit
        with pytest.raises(InvalidArgumentError, match=r"text: the prompt has \d+ tokens"):
            client.generate_text("hi " * (limit * 2), max_new_tokens=1)


def test_the_character_bound_is_sound_for_the_tokenizer(tiny_llama_dir: Path) -> None:
    """No text of more characters than max_chars_for(n) has fewer than n tokens: the longest
    token of the vocabulary, repeated, is the densest text there is."""
    tok = Tokenizer.from_folder(tiny_llama_dir)
    n = 64
    bound = tok.max_chars_for(n)
    assert bound is not None and bound >= n
    densest = max((tok.decode([i]) for i in range(tok.vocab_size)), key=len)
    text = densest * (bound // len(densest) + 1)
    assert len(tok.encode(text, add_special_tokens=False)) >= n


def test_a_pipeline_that_can_drop_text_bounds_nothing() -> None:
    """A whitespace-splitting pre-tokenizer drops the spaces (a megabyte of them is no token at
    all), and WordPiece folds an unknown word into one [UNK]: no character bound is claimed."""
    from tokenizers import Tokenizer as RustTokenizer  # noqa: PLC0415
    from tokenizers import models, pre_tokenizers  # noqa: PLC0415
    from transformers import PreTrainedTokenizerFast  # noqa: PLC0415

    for model in (models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"),
                  models.WordPiece({"a": 0, "[UNK]": 1}, unk_token="[UNK]")):
        rust = RustTokenizer(model)
        rust.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        tok = Tokenizer(PreTrainedTokenizerFast(tokenizer_object=rust, unk_token="[UNK]"))
        assert len(tok.encode(" " * 10_000 + "a", add_special_tokens=False)) == 1
        assert tok.max_chars_for(8) is None


@pytest.mark.slow
def test_an_oversized_chat_or_http_prompt_is_refused_before_it_is_tokenized(served) -> None:
    """The same bound holds for a chat's messages over gRPC and for both HTTP routes: a chat
    template's text holds every message's content, so their total length alone can refuse it."""
    import openai  # noqa: PLC0415

    srv, engine = served
    text = "lorem ipsum dolor sit amet " * (7 * 2**20 // 27)
    with LoraplexClient(srv.address, retry_attempts=1, timeout=30) as client:
        started = time.monotonic()
        with pytest.raises(InvalidArgumentError, match="characters") as err:
            client.generate_text(messages=[{"role": "user", "content": text[: len(text) // 2]},
                                           {"role": "user", "content": text[len(text) // 2 :]}], max_new_tokens=1)
        assert err.value.field == "chat.messages" and time.monotonic() - started < 2.0
    http = openai.OpenAI(base_url=srv.http_url, api_key="unused", max_retries=0, timeout=30)
    model = engine.info.model_name
    for call, param in ((lambda: http.completions.create(model=model, prompt=text, max_tokens=1), "prompt"),
                        (lambda: http.chat.completions.create(model=model, max_tokens=1,
                                                              messages=[{"role": "user", "content": text}]),
                         "messages")):
        started = time.monotonic()
        with pytest.raises(openai.BadRequestError) as bad:
            call()
        assert bad.value.body["param"] == param and "characters" in bad.value.body["message"]
        assert time.monotonic() - started < 3.0
    assert http.completions.create(model=model, prompt="still serving", max_tokens=2).usage.completion_tokens == 2
    http.close()
