"""The tool-call format of the chat endpoint (inference_server/http/tools.py) without a model: tools and
tool_choice checked naming the field, the grammar each choice asks for, the system turn, earlier
calls and results rendered back, calls read out of a text (and a cut one left as text), and the
chat formatter streaming text while holding back a call until the choice ends."""

from __future__ import annotations

import json

import pytest

from loraplex.adapter_store.errors import InvalidRequestError
from loraplex.inference_server.engine.request import FinishReason, TokenEvent, Usage
from loraplex.inference_server.http.responses import ChatFormat
from loraplex.inference_server.http.tool_formats import FORMATS
from loraplex.inference_server.http.tools import (BEGIN, END, call_text, held_back, parse_calls, response_text,
                                                  tool_use as _tool_use)


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


def _event(text: str, last: bool = False) -> TokenEvent:
    return TokenEvent("r", (5,), text, finish_reason=FinishReason.STOP if last else None,
                      usage=Usage(3, 4) if last else None)


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
