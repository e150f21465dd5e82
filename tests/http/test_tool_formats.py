"""Tool calls in the model's own format (#41): the chat template decides it (tool_formats.py). Read
from template text: Hermes-style ``<tool_call>`` (Qwen2.5/3), Llama 3.1's JSON with "parameters",
Mistral's ``[TOOL_CALLS]``, SmolLM2's model-card format; a template of no known format refuses
tools. Through the HTTP edge with the openai client on a tiny Llama whose tokenizer carries the
template: the prompt is transformers' ``apply_chat_template(..., tools=...)``, tool_choice
"required" / a named function come back as OpenAI tool calls parsed from that format, earlier
calls and results go back through the template, and an unknown template is a 400 naming tools."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest
from http_engine import serve_with_tokenizer

from loraplex.inference_server.engine.config import EngineConfig
from loraplex.inference_server.http.tool_formats import FORMATS, detect

HERMES = (
    "{%- if tools %}<|im_start|>system\n{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n"
    "{% endif %}# Tools\n\n<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>\n\n"
    "For each function call, return a json object within <tool_call></tool_call> tags:\n<tool_call>\n"
    "{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n{%- endif %}"
    "{%- for message in messages %}{%- if message.role == 'system' and tools %}"
    "{%- elif message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant\n"
    "{% if message.content %}{{ message.content }}{% endif %}{%- for tc in message.tool_calls %}<tool_call>\n"
    "{\"name\": \"{{ tc.function.name }}\", \"arguments\": {{ tc.function.arguments | tojson }}}\n</tool_call>"
    "{%- endfor %}<|im_end|>\n{%- elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n"
    "{{ message.content }}\n</tool_response><|im_end|>\n{%- else %}<|im_start|>{{ message.role }}\n"
    "{{ message.content }}<|im_end|>\n{%- endif %}{%- endfor %}{%- if add_generation_prompt %}"
    "<|im_start|>assistant\n{%- endif %}")
LLAMA31 = (
    "{{ bos_token }}{%- if tools %}<|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\n"
    "Respond with a JSON for a function call in the format {\"name\": function name, \"parameters\": "
    "dictionary of argument name and its value}.{% for t in tools %}\n{{ t | tojson }}{% endfor %}<|eot_id|>"
    "{%- endif %}{%- for message in messages %}{%- if message.role == 'assistant' and message.tool_calls %}"
    "<|start_header_id|>assistant<|end_header_id|>\n\n{%- for tc in message.tool_calls %}<|python_tag|>"
    "{\"name\": \"{{ tc.function.name }}\", \"parameters\": {{ tc.function.arguments | tojson }}}{%- endfor %}"
    "<|eot_id|>{%- elif message.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>\n\n"
    "{{ message.content }}<|eot_id|>{%- else %}<|start_header_id|>{{ message.role }}<|end_header_id|>\n\n"
    "{{ message.content }}<|eot_id|>{%- endif %}{%- endfor %}{%- if add_generation_prompt %}"
    "<|start_header_id|>assistant<|end_header_id|>\n\n{%- endif %}")
MISTRAL = ("{{ bos_token }}{% for m in messages %}{% if m.role == 'user' %}{% if tools and loop.last %}"
           "[AVAILABLE_TOOLS] {{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}[INST] {{ m.content }}[/INST]"
           "{% elif m.tool_calls %}[TOOL_CALLS] {{ m.tool_calls | tojson }}{{ eos_token }}"
           "{% else %}{{ m.content }}{{ eos_token }}{% endif %}{% endfor %}")
SMOLLM2 = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
           "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
           "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
           "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
PLAIN = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
         "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
           "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather", "parameters": WEATHER}}]
ASK = [{"role": "user", "content": "Weather in Oslo?"}]


@pytest.mark.parametrize("template, name", [(HERMES, "hermes"), (LLAMA31, "llama3_json"), (MISTRAL, "mistral"),
                                            (SMOLLM2, "smollm2"), (PLAIN, None), ("", None)])
def test_the_template_names_the_format(template: str, name: str | None) -> None:
    assert detect(template) == (FORMATS[name] if name else None)


@pytest.mark.parametrize("name, text, rest, calls", [
    ("hermes", 'Sure.<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call><tool_call>\n{"name": "g", '
               '"arguments": {}}\n</tool_call>', "Sure.", [("f", {"a": 1}), ("g", {})]),
    ("llama3_json", '<|python_tag|>{"name": "f", "parameters": {"a": 1}}', None, [("f", {"a": 1})]),
    ("llama3_json", ' {"name": "f", "parameters": {}}', None, [("f", {})]),
    ("mistral", '[TOOL_CALLS] [{"name": "f", "arguments": {"a": 1}}]', None, [("f", {"a": 1})]),
    ("mistral", '[{"name": "f", "arguments": {}}, {"name": "g", "arguments": {}}]', None, [("f", {}), ("g", {})]),
    ("hermes", '<tool_call>\n{"name": "f", "argu', '<tool_call>\n{"name": "f", "argu', []),  # cut: text
    # cut by max_tokens after the JSON, before or inside the closing tag: the calls still count
    ("smollm2", '<tool_call>[{"name": "f", "arguments": {"a": 1}}]</tool_', None, [("f", {"a": 1})]),
    ("smollm2", 'Sure. <tool_call>[{"name": "f", "arguments": {}}]', "Sure.", [("f", {})]),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_c', None, [("f", {"a": 1})]),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call><tool_call>\n{"name": "g", '
               '"arguments": {}}\n', None, [("f", {}), ("g", {})]),
    ("smollm2", '<tool_call>[{"name": "f", "arguments": {}}', '<tool_call>[{"name": "f", "arguments": {}}', []),
    ("smollm2", '<tool_call>[{"name": "f", "arguments": {}}]</tool_x', '<tool_call>[{"name": "f", "arguments": {}}]'
                '</tool_x', []),  # not a closing tag's start: text
    ("llama3_json", "The weather is fine.", "The weather is fine.", []),
])
def test_each_format_reads_its_calls(name: str, text: str, rest: str | None, calls: list) -> None:
    assert FORMATS[name].parse(text) == (rest, calls)


def test_a_tagless_format_holds_back_only_what_may_start_a_call() -> None:
    llama, mistral = FORMATS["llama3_json"], FORMATS["mistral"]
    assert llama.held_back(' {"na', at_start=True) == 5 and llama.held_back("Hello", at_start=True) == 0
    assert llama.held_back('{"a"', at_start=False) == 0 and mistral.held_back("[TOOL", at_start=True) == 5


@pytest.fixture(scope="module", params=["hermes", "llama3_json", "plain"])
def served(request, smollm2_tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    import transformers

    template = {"hermes": HERMES, "llama3_json": LLAMA31, "plain": PLAIN}[request.param]
    tok = transformers.AutoTokenizer.from_pretrained(smollm2_tokenizer_dir)
    tok.add_special_tokens({"additional_special_tokens": ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                                                          "<|python_tag|>"]})
    tok.chat_template = template
    srv, engine, url = serve_with_tokenizer(
        tok, tmp_path_factory, 3, 40, EngineConfig(num_kv_blocks=128, max_num_seqs=4, max_num_batched_tokens=512))
    client = openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=120)
    yield request.param, client, engine, tok
    client.close()
    srv.close()


@pytest.mark.slow
def test_calls_in_the_templates_format_through_the_http_edge(served) -> None:
    name, client, engine, tok = served
    base = engine.info.model_name
    if name == "plain":
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model=base, messages=ASK, tools=TOOLS, max_tokens=8)
        assert refused.value.body["param"] == "tools" and "no tool section" in refused.value.body["message"]
        return
    expected = tok.apply_chat_template(ASK, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert engine.tokenizer.render_chat(ASK, TOOLS) == expected
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        answer = client.chat.completions.create(model=base, messages=ASK, tools=TOOLS, tool_choice=choice,
                                                max_tokens=60, temperature=0)
        assert answer.usage.prompt_tokens == len(engine.tokenizer.encode(expected, add_special_tokens=False))
        assert answer.choices[0].finish_reason == "tool_calls", answer
        call = answer.choices[0].message.tool_calls[0]
        assert call.function.name == "get_weather" and set(json.loads(call.function.arguments)) == {"city"}
    follow = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": "get_weather", "arguments": call.function.arguments}}]},
              {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    reference = [*ASK, {**follow[1], "tool_calls": [{**follow[1]["tool_calls"][0], "function": {
        "name": "get_weather", "arguments": json.loads(call.function.arguments)}}]}, follow[2]]
    rendered = tok.apply_chat_template(reference, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    again = client.chat.completions.create(model=base, messages=follow, tools=TOOLS, max_tokens=4, temperature=0)
    assert again.usage.prompt_tokens == len(engine.tokenizer.encode(rendered, add_special_tokens=False))
    assert "sunny" in rendered and call.function.name in rendered
