"""The tool-call format of the chat endpoint (inference_server/http/tools.py) without a model: tools and
tool_choice checked naming the field, the grammar each choice asks for, the system turn, earlier
calls and results rendered back, calls read out of a text (and a cut one left as text), and the
chat formatter streaming text while holding back a call until the choice ends. An answer max_tokens
cuts after a call's JSON, in or before its closing tag, still carries the call (finish "length"),
through the formatter and through the HTTP edge with the openai client on a scripted fake engine."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import openai
import pytest
from server_helpers import FakeEngine, ServerThread

from loraplex.adapter_store.errors import InvalidRequestError
from loraplex.inference_server.engine.request import FinishReason, TokenEvent, Usage
from loraplex.inference_server.http.responses import ChatFormat
from loraplex.inference_server.http.tool_formats import FORMATS
from loraplex.inference_server.http.tools import (BEGIN, END, call_text, held_back, parse_calls, response_text,
                                                  tool_use as _tool_use)
from loraplex.inference_server.server.app import ServerOptions


def tool_use(tools, choice):  # SmolLM2's format: the one these tests check
    return _tool_use(tools, choice, FORMATS["smollm2"])

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time"}}]


def test_no_tools_or_none_means_no_tool_use() -> None:
    assert tool_use(None, None) is None and tool_use(TOOLS, "none") is None and tool_use([], "none") is None


@pytest.mark.parametrize("tools, choice, field", [
    (None, "required", "tool_choice"),
    ([{"type": "function"}], None, "tools[0]"),
    ([{"type": "retrieval", "function": {}}], None, "tools[0]"),
    ([{"type": "function", "function": {"name": ""}}], None, "tools[0].function.name"),
    ([{"type": "function", "function": {"name": "f", "parameters": [1]}}], None, "tools[0].function.parameters"),
    # arguments are an object (keyword arguments): a string or number schema made arguments '9' (a 200)
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "integer"}}}], None,
     "tools[0].function.parameters"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"anyOf": [{"type": "object"}]}}}], None,
     "tools[0].function.parameters"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "allOf": []}}}], None,
     "tools[0].function.parameters"),
    ([*TOOLS, TOOLS[0]], None, "tools"),
    (TOOLS, "sometimes", "tool_choice"),
    (TOOLS, {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
])
def test_bad_tools_and_choices_name_their_field(tools, choice, field) -> None:
    with pytest.raises(InvalidRequestError) as refused:
        tool_use(tools, choice)
    assert refused.value.field == field


def test_no_parameters_or_empty_ones_are_an_object_of_no_arguments() -> None:
    for function in ({"name": "f"}, {"name": "f", "parameters": None}, {"name": "f", "parameters": {}}):
        use = tool_use([{"type": "function", "function": function}], "required")
        assert json.loads(use.grammar().schema)["items"]["properties"]["arguments"] == {"type": "object",
                                                                                          "properties": {}}


def test_each_choice_asks_for_its_grammar() -> None:
    auto, required = tool_use(TOOLS, "auto"), tool_use(TOOLS, "required")
    named = tool_use(TOOLS, {"type": "function", "function": {"name": "get_time"}})
    assert tool_use(TOOLS, None) == auto and auto.forced is None and required.forced == ("get_weather", "get_time")
    assert auto.grammar().free_text and not required.grammar().free_text and not named.grammar().free_text
    for use in (auto, required, named):
        spec = use.grammar()
        assert (spec.kind, spec.begin, spec.end) == ("tagged_json", BEGIN, END)
    schema = json.loads(named.grammar().schema)
    assert schema["minItems"] == 1 and schema["items"]["properties"]["name"] == {"const": "get_time"}
    assert schema["items"]["properties"]["arguments"] == {"type": "object", "properties": {}}  # no parameters given
    both = json.loads(required.grammar().schema)["items"]["anyOf"]
    assert [c["properties"]["name"]["const"] for c in both] == ["get_weather", "get_time"]
    assert both[0]["properties"]["arguments"] == WEATHER


def test_the_tools_go_in_one_system_turn_before_the_callers() -> None:
    use = tool_use(TOOLS, "required")
    alone = use.messages([{"role": "user", "content": "hi"}])
    assert [m["role"] for m in alone] == ["system", "user"] and '"get_weather"' in alone[0]["content"]
    assert "and nothing else" in alone[0]["content"] and "plain text" in tool_use(TOOLS, "auto").system_prompt()
    merged = use.messages([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}])
    assert len(merged) == 2 and merged[0]["content"].endswith("\n\nBe brief.")


def test_earlier_calls_and_results_are_rendered_back() -> None:
    calls = [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]
    assert call_text(calls, "messages[1].tool_calls") == BEGIN + '[{"name": "get_weather", "arguments": {"city": ' \
                                                                 '"Oslo"}}]' + END
    with pytest.raises(InvalidRequestError) as refused:
        call_text([{"function": {"name": "f", "arguments": "{bad"}}], "messages[1].tool_calls")
    assert refused.value.field == "messages[1].tool_calls[0].function.arguments"
    assert response_text("21C") == "<tool_response>21C</tool_response>"


def test_calls_are_read_out_of_the_text() -> None:
    content, calls = parse_calls('Sure. <tool_call>[{"name": "get_weather", "arguments": {"city": "Oslo"}}, '
                                 '{"name": "get_time", "arguments": {}}]</tool_call>')
    assert content == "Sure." and [c.name for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0].arguments) == {"city": "Oslo"} and calls[0].id.startswith("call_")
    assert calls[0].to_json(0) == {"index": 0, "id": calls[0].id, "type": "function",
                                   "function": {"name": "get_weather", "arguments": calls[0].arguments}}
    assert parse_calls(BEGIN + '[{"name": "f", "arguments": {}}]' + END)[0] is None
    for text in ("no call here", BEGIN + '[{"name": "f", "argu', BEGIN + "[1, 2]" + END):  # cut or not calls
        assert parse_calls(text) == (text, [])


def test_held_back_is_what_may_still_become_a_call() -> None:
    assert held_back("hello") == 0 and held_back("hello <tool") == len("<tool") and held_back("a <") == 1
    assert held_back("a " + BEGIN + "[{") == len(BEGIN) + 2 and held_back("a <b") == 0


def _event(text: str, last: bool = False, reason: FinishReason = FinishReason.STOP) -> TokenEvent:
    return TokenEvent("r", (5,), text, finish_reason=reason if last else None, usage=Usage(3, 4) if last else None)


def test_a_stream_sends_text_and_holds_a_call_until_the_choice_ends() -> None:
    fmt = ChatFormat(model="m", token_bytes=lambda token: b"x", logprobs=False, tools=tool_use(TOOLS, "auto"))
    pieces = ["It is ", "<tool", '_call>[{"name": "get_time", ', '"arguments": {}}]</tool_call>']
    deltas = [fmt.chunk(_event(p))["choices"][0] for p in pieces]
    assert [d["delta"]["content"] for d in deltas] == ["It is ", "", "", ""]
    assert deltas[0]["delta"]["role"] == "assistant" and all(d["finish_reason"] is None for d in deltas)
    last = fmt.chunk(_event("", last=True))["choices"][0]
    assert last["finish_reason"] == "tool_calls" and last["delta"]["content"] == ""
    assert [c["function"]["name"] for c in last["delta"]["tool_calls"]] == ["get_time"]
    plain = ChatFormat(model="m", token_bytes=lambda token: b"x", logprobs=False, tools=tool_use(TOOLS, "auto"))
    assert plain.chunk(_event("a <"))["choices"][0]["delta"]["content"] == "a "
    end = plain.chunk(_event("b", last=True))["choices"][0]
    assert end["delta"]["content"] == "<b" and end["finish_reason"] == "stop"


def test_a_whole_answer_carries_its_calls() -> None:
    fmt = ChatFormat(model="m", token_bytes=lambda token: b"x", logprobs=False, tools=tool_use(TOOLS, "auto"))
    answer = fmt.response([[_event(BEGIN + '[{"name": "get_time", "arguments": {}}]'), _event(END, last=True)]])
    choice = answer["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert choice["message"]["tool_calls"][0]["function"] == {"name": "get_time", "arguments": "{}"}
    assert "index" not in choice["message"]["tool_calls"][0]


TIME_CALL = '[{"name": "get_time", "arguments": {}}]'


@pytest.mark.parametrize("name, cut", [
    ("smollm2", BEGIN + TIME_CALL + "</tool_"),  # max_tokens ended the answer inside the closing tag
    ("smollm2", BEGIN + TIME_CALL),  # or before it
    ("hermes", '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool'),
])
def test_a_call_cut_in_its_closing_tag_is_a_call_with_finish_length(name: str, cut: str) -> None:
    def formatter() -> ChatFormat:
        return ChatFormat(model="m", token_bytes=lambda token: b"x", logprobs=False,
                          tools=_tool_use(TOOLS, "required", FORMATS[name]))
    pieces = [cut[i:i + 7] for i in range(0, len(cut), 7)]
    whole = formatter().response([[*map(_event, pieces[:-1]), _event(pieces[-1], True, FinishReason.LENGTH)]])
    choice = whole["choices"][0]
    assert choice["finish_reason"] == "length" and choice["message"]["content"] is None
    assert [c["function"] for c in choice["message"]["tool_calls"]] == [{"name": "get_time", "arguments": "{}"}]
    streamed = formatter()
    deltas = [streamed.chunk(_event(p))["choices"][0]["delta"] for p in pieces[:-1]]
    last = streamed.chunk(_event(pieces[-1], True, FinishReason.LENGTH))["choices"][0]
    assert "".join(d["content"] for d in [*deltas, last["delta"]]) == ""  # no markup as text
    assert last["finish_reason"] == "length" and last["delta"]["tool_calls"][0]["function"]["name"] == "get_time"


def test_a_call_cut_in_its_json_stays_text() -> None:
    cut = BEGIN + '[{"name": "get_time", "argu'
    fmt = ChatFormat(model="m", token_bytes=lambda token: b"x", logprobs=False, tools=tool_use(TOOLS, "required"))
    choice = fmt.response([[_event(cut, True, FinishReason.LENGTH)]])["choices"][0]
    assert choice == {**choice, "finish_reason": "length", "message": {"role": "assistant", "content": cut}}
    streamed = ChatFormat(model="m", token_bytes=lambda token: b"x", logprobs=False, tools=tool_use(TOOLS, "required"))
    assert streamed.chunk(_event(cut[:12]))["choices"][0]["delta"]["content"] == ""
    last = streamed.chunk(_event(cut[12:], True, FinishReason.LENGTH))["choices"][0]
    assert last["delta"] == {"content": cut} and last["finish_reason"] == "length"


class _ScriptedEngine(FakeEngine):
    """Answers every request with ``script``, a character a token (ByteTokenizer), until
    max_tokens (finish "length") or the script's end (finish "stop"); its chat template is
    SmolLM2's, so tools come in SmolLM2's format."""

    def __init__(self, adapter_dir: Path, script: str) -> None:
        super().__init__(adapter_dir, step_s=0.0)
        self.info = dataclasses.replace(self.info, max_context_len=4096)  # the tools' system turn is ~600 bytes
        self.tokenizer.chat_template = "SmolLM2"
        self.script = script

    async def generate(self, request):
        ids = self.tokenizer.encode(self.script)
        cut = ids[: request.stopping.max_new_tokens]
        reason = FinishReason.LENGTH if len(cut) < len(ids) else FinishReason.STOP
        for i, token in enumerate(cut):
            if i == len(cut) - 1:
                yield self._last(request, (token,), reason, i + 1)
            else:
                yield TokenEvent(request.request_id, (token,), self.tokenizer.decode([token]))


def test_a_call_cut_in_its_closing_tag_through_the_http_edge(tmp_path: Path) -> None:
    person = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"]}
    tools = [{"type": "function", "function": {"name": "Person", "parameters": person}}]
    script = BEGIN + '[{"name": "Person", "arguments": {"name": "Alice", "age": 30}}]' + END
    srv = ServerThread(ServerOptions(port=0, default_max_new_tokens=8))
    url = srv.start_http(default_max_new_tokens=8)
    srv.attach(_ScriptedEngine(tmp_path / "adapters", script))
    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=10)
    try:
        ask = dict(model="fake-llama", messages=[{"role": "user", "content": "Alice is 30."}], tools=tools,
                   max_tokens=len(script) - 5)  # the answer ends in "</tool_"
        for choice in ("required", {"type": "function", "function": {"name": "Person"}}):
            answer = client.chat.completions.create(**ask, tool_choice=choice).choices[0]
            assert answer.finish_reason == "length" and answer.message.content is None
            assert answer.message.tool_calls[0].function.name == "Person"
            assert json.loads(answer.message.tool_calls[0].function.arguments) == {"name": "Alice", "age": 30}
            chunks = list(client.chat.completions.create(**ask, tool_choice=choice, stream=True))
            assert "".join(c.choices[0].delta.content or "" for c in chunks) == ""  # no markup as text
            assert chunks[-1].choices[0].finish_reason == "length"
            assert [c.function.name for c in chunks[-1].choices[0].delta.tool_calls] == ["Person"]
        whole = client.chat.completions.create(**{**ask, "max_tokens": len(script)}, tool_choice="required")
        assert whole.choices[0].finish_reason == "tool_calls"
        cut = client.chat.completions.create(**{**ask, "max_tokens": 30}, tool_choice="required").choices[0]
        assert cut.finish_reason == "length" and cut.message.content == script[:30] and not cut.message.tool_calls
    finally:
        client.close()
        srv.close()


def test_parallel_tool_calls_false_makes_one_call_at_most(tmp_path: Path) -> None:
    """LangChain's with_structured_output sends parallel_tool_calls=false with a named choice: the
    list of calls holds one, and of an answer with more the first is read (it was ignored: two calls
    came back)."""
    single = _tool_use(TOOLS, "required", FORMATS["smollm2"], parallel=False)
    assert json.loads(single.grammar().schema)["maxItems"] == 1
    assert "maxItems" not in json.loads(tool_use(TOOLS, "required").grammar().schema)
    hermes = _tool_use(TOOLS, "auto", FORMATS["hermes"], parallel=False)
    two = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call><tool_call>\n{"name": "get_weather", ' \
          '"arguments": {"city": "Oslo"}}\n</tool_call>'
    assert [c.name for c in hermes.parse(two)[1]] == ["get_time"]
    script = BEGIN + '[{"name": "get_time", "arguments": {}}, {"name": "get_weather", "arguments": {}}]' + END
    srv = ServerThread(ServerOptions(port=0))
    url = srv.start_http()
    srv.attach(_ScriptedEngine(tmp_path / "adapters", script))
    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=10)
    try:
        ask = dict(model="fake-llama", messages=[{"role": "user", "content": "Time?"}], tools=TOOLS,
                   tool_choice="required", max_tokens=len(script))
        assert len(client.chat.completions.create(**ask).choices[0].message.tool_calls) == 2
        for parallel in (False, None):  # null reads as unset: parallel
            answer = client.chat.completions.create(**ask, parallel_tool_calls=parallel).choices[0]
            assert [c.function.name for c in answer.message.tool_calls] == (
                ["get_time"] if parallel is False else ["get_time", "get_weather"])
        chunks = list(client.chat.completions.create(**ask, parallel_tool_calls=False, stream=True))
        assert [c.function.name for c in chunks[-1].choices[0].delta.tool_calls] == ["get_time"]
    finally:
        client.close()
        srv.close()
