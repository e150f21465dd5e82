"""Logprobs answers name tokens by their own bytes (Tokenizer.token_bytes), over the HTTP edge with
the real openai client: the fake engine answering with SmolLM2's real tokenizer, whose ids 111-125
are single bytes 0xA1-0xB0 (parts of multi-byte characters, which ``decode`` turns into U+FFFD).
A part is named by its bytes escaped (``\\xa1``), so the alternatives of one position keep distinct
names, and chat's ``bytes`` are the token's own. The real engine's split emoji and offsets are
test_http_sampling.py's."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
from server_helpers import FakeEngine, ServerThread, fake_tokens

from loraplex.inference_server.model.tokenizer import Tokenizer
from loraplex.inference_server.server.app import ServerOptions

BASE = "fake-llama"
PARTS = [37]  # a prompt whose fake tokens are 111, 112, ...: the bytes 0xA1, 0xA2, ...


@pytest.fixture(scope="module")
def smollm2(smollm2_tokenizer_dir: Path) -> Tokenizer:
    return Tokenizer.from_folder(smollm2_tokenizer_dir)


@pytest.fixture
def served(smollm2: Tokenizer, tmp_path: Path):
    """(openai client, SmolLM2's tokenizer) of the fake engine answering with SmolLM2's tokens."""
    srv = ServerThread(ServerOptions(port=0, default_max_new_tokens=8))
    url = srv.start_http(default_max_new_tokens=8)
    engine = FakeEngine(tmp_path / "adapters")
    engine.tokenizer = smollm2
    srv.attach(engine)
    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=10)
    yield client, smollm2
    client.close()
    srv.close()


def test_completion_alternatives_that_are_parts_of_characters_keep_distinct_names(served) -> None:
    client, tok = served
    assert fake_tokens(tuple(PARTS), None, 3) == [111, 112, 113] and tok.token_bytes(111) == b"\xa1"
    out = client.completions.create(model=BASE, prompt=PARTS, max_tokens=3, logprobs=2)
    lp = out.choices[0].logprobs
    assert lp.tokens == ["\\xa1", "\\xa2", "\\xa3"]  # a literal backslash-x, not U+FFFD
    assert lp.top_logprobs[:2] == [{"\\xa1": -0.5, "\\xa2": -1.5}, {"\\xa2": -0.5, "\\xa3": -1.5}]
    assert lp.text_offset == [0, 1, 2] and len(out.choices[0].text) == 3  # each lone byte one U+FFFD
    chunks = list(client.completions.create(model=BASE, prompt=PARTS, max_tokens=3, logprobs=2, stream=True))
    assert [t for c in chunks for t in c.choices[0].logprobs.tokens] == lp.tokens
    assert [o for c in chunks for o in c.choices[0].logprobs.text_offset] == lp.text_offset


def test_chat_logprobs_carry_each_tokens_own_bytes(served) -> None:
    client, tok = served
    messages = [{"role": "user", "content": "hi"}]
    ids = fake_tokens(tuple(tok.apply_chat_template(messages)), None, 26)  # every residue: 11 lone bytes
    out = client.chat.completions.create(model=BASE, messages=messages, max_tokens=26, logprobs=True,
                                         top_logprobs=2)
    content = out.choices[0].logprobs.content
    assert len(content) == 25  # the fake's last token comes without a log-probability
    assert [c.bytes for c in content] == [list(tok.token_bytes(i)) for i in ids[:25]]
    parts = [c for c in content if c.bytes[0] >= 0x80]
    assert len(parts) >= 10 and all(c.token == f"\\x{c.bytes[0]:02x}" for c in parts)
    assert all(len({t.token for t in c.top_logprobs}) == 2 for c in content)
