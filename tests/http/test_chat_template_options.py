"""vLLM's chat-template parameters through the HTTP edge with the openai client: ``chat_template_kwargs``
(the template's own variables, Qwen3's ``enable_thinking``), ``add_generation_prompt`` and
``continue_final_message`` render the prompt exactly as transformers' ``apply_chat_template`` with
the same arguments, combinations that cannot mean anything are a 400 naming the parameter, and a
template that refuses the messages (``raise_exception``, as Mistral's and Gemma's do for turns that
do not alternate) is a 400 saying why, not a server error."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from http_engine import serve_with_tokenizer

from loraplex.inference_server.engine.config import EngineConfig

pytestmark = pytest.mark.slow

# ChatML with a thinking switch (Qwen3's variable) and turns that must alternate (Mistral's rule)
TEMPLATE = (
    "{%- if enable_thinking is defined and not enable_thinking %}<|im_start|>system\nno thinking<|im_end|>\n"
    "{%- endif %}"
    "{%- for m in messages %}{%- if loop.index0 > 0 and m['role'] == messages[loop.index0 - 1]['role'] %}"
    "{{ raise_exception('Conversation roles must alternate') }}{%- endif %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{%- if not (loop.last and continue_final_message is defined and continue_final_message) %}<|im_end|>\n"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}")
ASK = [{"role": "user", "content": "Name a colour."}]
STARTED = [*ASK, {"role": "assistant", "content": "My favourite colour is"}]


@pytest.fixture(scope="module")
def served(smollm2_tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(smollm2_tokenizer_dir)
    tok.chat_template = TEMPLATE
    srv, engine, url = serve_with_tokenizer(
        tok, tmp_path_factory, 5, 8, EngineConfig(num_kv_blocks=64, max_num_seqs=4, max_num_batched_tokens=256))
    client = openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=120)
    yield client, engine.info.model_name, tok
    client.close()
    srv.close()


def _prompt_tokens(client: openai.OpenAI, model: str, messages: list[dict], **extra) -> int:
    answer = client.chat.completions.create(model=model, messages=messages, max_tokens=2, temperature=0,
                                            extra_body=extra or None)
    return answer.usage.prompt_tokens


def _tokens(tok, messages: list[dict], **arguments) -> int:
    return len(tok.encode(tok.apply_chat_template(messages, tokenize=False, **arguments), add_special_tokens=False))


def test_the_options_render_the_prompt_as_transformers_does(served) -> None:
    client, model, tok = served
    plain = _prompt_tokens(client, model, ASK)
    assert plain == _tokens(tok, ASK, add_generation_prompt=True)
    no_thinking = _prompt_tokens(client, model, ASK, chat_template_kwargs={"enable_thinking": False})
    assert no_thinking == _tokens(tok, ASK, add_generation_prompt=True, enable_thinking=False) > plain
    assert _prompt_tokens(client, model, ASK, add_generation_prompt=False) == _tokens(tok, ASK) < plain
    continued = _prompt_tokens(client, model, STARTED, add_generation_prompt=False, continue_final_message=True)
    assert continued == _tokens(tok, STARTED, continue_final_message=True)
    assert continued < _tokens(tok, STARTED, add_generation_prompt=True)  # no turn end, no new header


@pytest.mark.parametrize(("messages", "extra", "param", "said"), [
    (STARTED, {"continue_final_message": True}, "continue_final_message", "add_generation_prompt=false"),
    (ASK, {"continue_final_message": True, "add_generation_prompt": False}, "continue_final_message",
     "the assistant's, got 'user'"),
    (STARTED, {"continue_final_message": True, "add_generation_prompt": False,
               "response_format": {"type": "json_object"}}, "continue_final_message", "response_format"),
    (ASK, {"chat_template_kwargs": {"tokenize": True, "enable_thinking": False}}, "chat_template_kwargs",
     "tokenize cannot be set here"),
    (ASK, {"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs", "an object"),
    ([*ASK, {"role": "user", "content": "Another."}], {}, "messages", "Conversation roles must alternate"),
])
def test_what_cannot_be_rendered_is_a_400_naming_why(served, messages, extra, param, said) -> None:
    client, model, _ = served
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=model, messages=messages, max_tokens=2, extra_body=extra)
    assert refused.value.body["param"] == param and said in refused.value.body["message"], refused.value.body
