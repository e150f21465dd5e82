"""Tool calling on the chat endpoint: the tools in the prompt, the output constrained to the
model's tool-call format, and the calls read back out of the text as OpenAI's ``tool_calls``.

The format is the one the model's chat template teaches (tool_formats.py ``detect``): where the
template renders tools itself (Qwen/Hermes, Llama 3.1/3.2, Mistral) the tools and earlier tool
turns go to the template as they are (the prompt is transformers' ``apply_chat_template(...,
tools=...)``); SmolLM2-Instruct's template has no tool section, so its model card's format is
written here in a system turn. A template in no known format refuses tools (400 naming them).
``tool_choice`` decides the grammar (engine/grammar.py): ``"required"`` and a named function make
a call the whole output (the named function's the only call allowed), ``"auto"`` lets the model
answer in text or call, ``"none"`` leaves the tools out.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from loraplex.adapter_store.errors import InvalidRequestError
from loraplex.inference_server.engine.request import GrammarSpec
from loraplex.inference_server.engine.schema_checks import check_schema
from loraplex.inference_server.http.tool_formats import FORMATS, ToolFormat, describe

SMOLLM2 = FORMATS["smollm2"]
BEGIN, END = SMOLLM2.begin, SMOLLM2.end
MAX_TOOLS = 128
_PROMPT = """You are an expert in composing functions. You are given a question and a set of possible functions. \
Based on the question, you call one or more of the functions to achieve the purpose.

You have access to the following tools:
<tools>{tools}</tools>

{rule}
<tool_call>[{{"name": "func_name1", "arguments": {{"argument1": "value1", "argument2": "value2"}}}}]</tool_call>"""
_RULES = {
    "auto": "If a function call is needed, write the calls in this format; otherwise answer in plain text:",
    "required": "Write the calls in this format and nothing else:",
}


@dataclass(frozen=True, slots=True)
class Tool:
    """A function the model may call: its name, description and parameters' JSON schema."""

    name: str
    description: str
    parameters: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "description": self.description, "parameters": self.parameters}


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One call read back out of the model's text: OpenAI's ``tool_calls`` entry."""

    id: str
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    def to_json(self, index: int | None = None) -> dict[str, Any]:
        out = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


@dataclass(frozen=True, slots=True)
class ToolUse:
    """A chat request's tools, what ``tool_choice`` allows (``forced`` None for "auto", else the
    names of the functions one of which must be called; "required": all of them) and the model's
    tool-call format; not ``parallel`` (``parallel_tool_calls: false``): one call at most, as
    OpenAI makes it (a list holds one call, and of a text with more the first is read, as vLLM
    reads it)."""

    tools: tuple[Tool, ...]
    forced: tuple[str, ...] | None
    format: ToolFormat = SMOLLM2
    parallel: bool = True

    def system_prompt(self) -> str:
        tools = json.dumps([t.to_json() for t in self.tools])
        return _PROMPT.format(tools=tools, rule=_RULES["auto" if self.forced is None else "required"])

    def grammar(self) -> GrammarSpec | None:
        """The output's grammar: calls in the model's format, each of an allowed function with
        arguments valid for its parameters (None: "auto" in a format the model opens freely)."""
        allowed = [t for t in self.tools if self.forced is None or t.name in self.forced]
        return self.format.grammar([self.format.call_schema(t.name, t.parameters) for t in allowed],
                                   self.forced is not None, self.parallel)

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template takes them (OpenAI's shape), where it renders them."""
        if not self.format.in_template:
            return None
        return [{"type": "function", "function": t.to_json()} for t in self.tools]

    def messages(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """``messages`` with the tools' system prompt first (before the caller's own system
        message, in one system turn), for a format whose template does not render tools."""
        if self.format.in_template:
            return messages
        prompt = self.system_prompt()
        if messages and messages[0]["role"] == "system":
            return [{"role": "system", "content": prompt + "\n\n" + messages[0]["content"]}, *messages[1:]]
        return [{"role": "system", "content": prompt}, *messages]

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(the text outside the calls, None if empty; the calls) of a model's answer."""
        rest, calls = self.format.parse(text)
        return rest, [ToolCall(f"call_{uuid.uuid4().hex[:24]}", name, json.dumps(arguments))
                      for name, arguments in (calls if self.parallel else calls[:1])]


def tool_use(tools: list[dict[str, Any]] | None, tool_choice: str | dict[str, Any] | None,
             fmt: ToolFormat | None, template: str = "", parallel: bool = True) -> ToolUse | None:
    """The request's ToolUse in ``fmt`` (the format of the model's chat template ``template``),
    or None when no tool may be called (no tools, or "none"); a bad tool or choice, or a
    template in no known format (``fmt`` None), is InvalidRequestError naming it."""
    if tool_choice is not None and not tools and tool_choice != "none":
        raise InvalidRequestError("needs tools", "tool_choice")
    if not tools or tool_choice == "none":
        return None
    if len(tools) > MAX_TOOLS:
        raise InvalidRequestError(f"at most {MAX_TOOLS} tools, got {len(tools)}", "tools")
    parsed = tuple(_tool(i, t) for i, t in enumerate(tools))
    names = [t.name for t in parsed]
    if len(set(names)) != len(names):
        raise InvalidRequestError("two tools have one name", "tools")
    if fmt is None:
        raise InvalidRequestError(f"{describe(template)}, so the format of its tool calls is not known (known: "
                                  f"{', '.join(FORMATS)}); tools are refused rather than written in another "
                                  "model's format", "tools")
    if tool_choice is None or tool_choice == "auto":
        return ToolUse(parsed, None, fmt, parallel)
    if tool_choice == "required":
        return ToolUse(parsed, tuple(names), fmt, parallel)
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(tool_choice, dict) or tool_choice.get("type") != "function" or not isinstance(name, str):
        raise InvalidRequestError('must be "none", "auto", "required" or {"type": "function", "function": '
                                  '{"name": ...}}', "tool_choice")
    if name not in names:
        raise InvalidRequestError(f"names {name!r}, which is not among the tools", "tool_choice")
    return ToolUse(parsed, (name,), fmt, parallel)


_TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")  # OpenAI's rule for a function's name


def _tool(i: int, tool: Any) -> Tool:
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        raise InvalidRequestError('must be {"type": "function", "function": {...}}', f"tools[{i}]")
    function = tool["function"]
    name = function.get("name")
    if not isinstance(name, str) or not _TOOL_NAME.fullmatch(name):
        raise InvalidRequestError("must be 1-64 letters, digits, underscores or dashes (OpenAI's rule), got "
                                  f"{name!r}"[:200], f"tools[{i}].function.name")
    description = function.get("description") or ""
    if not isinstance(description, str):
        raise InvalidRequestError("must be a string", f"tools[{i}].function.description")
    parameters = function.get("parameters")
    if parameters is None or parameters == {}:  # no parameters: the call's arguments are {}
        parameters = {"type": "object", "properties": {}}
    if not isinstance(parameters, dict):
        raise InvalidRequestError("must be a JSON schema object", f"tools[{i}].function.parameters")
    if parameters.get("type") != "object":  # arguments are keyword arguments: '9' or '"abc"' are none
        raise InvalidRequestError(f'must be a schema of "type": "object" (as OpenAI requires: a call\'s arguments '
                                  f'are an object), got "type": {json.dumps(parameters.get("type"))[:40]}',
                                  f"tools[{i}].function.parameters")
    check_schema(parameters, f"tools[{i}].function.parameters")
    return Tool(name, description, parameters)


def call_text(calls: list[dict[str, Any]], field: str) -> str:
    """An assistant message's ``tool_calls`` as the model writes them (its tag)."""
    out = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise InvalidRequestError("must be {\"function\": {\"name\", \"arguments\"}}", f"{field}[{j}]")
        arguments = function.get("arguments") or "{}"
        try:
            parsed = json.loads(arguments) if isinstance(arguments, str) else arguments
        except ValueError:
            raise InvalidRequestError("is not JSON", f"{field}[{j}].function.arguments") from None
        out.append({"name": function["name"], "arguments": parsed})
    return BEGIN + json.dumps(out) + END


def response_text(content: str) -> str:
    """A ``tool`` message's result as the user turn that carries it back."""
    return f"<tool_response>{content}</tool_response>"


def parse_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    """SmolLM2's calls read out of ``text`` (ToolUse.parse in its format)."""
    return ToolUse((), None, SMOLLM2).parse(text)


def held_back(text: str) -> int:
    """How many characters at the end of streamed SmolLM2 ``text`` must wait: all from a tag's
    start on, or a trailing piece that may become the tag's start."""
    return SMOLLM2.held_back(text, at_start=False)
