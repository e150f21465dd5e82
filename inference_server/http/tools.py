"""Tool calling on the chat endpoint: the tools in the prompt, the output constrained to the
tool-call format, and the calls read back out of the text as OpenAI's ``tool_calls``.

The format is the one SmolLM2-Instruct was trained on (its model card; its chat template has no
tool section, so the tools go in a system message): the model writes
``<tool_call>[{"name": ..., "arguments": {...}}, ...]</tool_call>``, one list of calls in one tag.
``tool_choice`` decides the grammar (engine/grammar.py): ``"required"`` and a named function make
that tag the whole output (the named function's the only call allowed), ``"auto"`` lets the model
answer in text or write the tag (whose JSON is then constrained), ``"none"`` leaves the tools out.
Earlier turns go back into the prompt in the same format: an assistant message's ``tool_calls``
as its tag, a ``tool`` message's result as a user turn in ``<tool_response>`` tags.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from loraplex.adapter_store.errors import InvalidRequestError
from loraplex.inference_server.engine.grammar import check_schema
from loraplex.inference_server.engine.request import GrammarSpec

BEGIN, END = "<tool_call>", "</tool_call>"
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
    """A chat request's tools and what ``tool_choice`` allows: ``forced`` is None for "auto",
    else the names of the functions one of which must be called ("required": all of them)."""

    tools: tuple[Tool, ...]
    forced: tuple[str, ...] | None

    def system_prompt(self) -> str:
        tools = json.dumps([t.to_json() for t in self.tools])
        return _PROMPT.format(tools=tools, rule=_RULES["auto" if self.forced is None else "required"])

    def grammar(self) -> GrammarSpec:
        """The output's grammar: the tag of a list of calls, each of an allowed function with
        arguments valid for its parameters."""
        allowed = [t for t in self.tools if self.forced is None or t.name in self.forced]
        calls = [{"type": "object", "properties": {"name": {"const": t.name}, "arguments": t.parameters},
                  "required": ["name", "arguments"], "additionalProperties": False} for t in allowed]
        schema = {"type": "array", "minItems": 1,
                  "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
        return GrammarSpec("tagged_json", json.dumps(schema), BEGIN, END, free_text=self.forced is None)

    def messages(self, messages: list[dict[str, str]]) -> list[dict[str, str]]:
        """``messages`` with the tools' system prompt first (before the caller's own system
        message, in one system turn)."""
        prompt = self.system_prompt()
        if messages and messages[0]["role"] == "system":
            return [{"role": "system", "content": prompt + "\n\n" + messages[0]["content"]}, *messages[1:]]
        return [{"role": "system", "content": prompt}, *messages]


def tool_use(tools: list[dict[str, Any]] | None, tool_choice: str | dict[str, Any] | None) -> ToolUse | None:
    """The request's ToolUse, or None when no tool may be called (no tools, or "none"); a bad
    tool or choice is InvalidRequestError naming it."""
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
    if tool_choice is None or tool_choice == "auto":
        return ToolUse(parsed, None)
    if tool_choice == "required":
        return ToolUse(parsed, tuple(names))
    name = tool_choice.get("function", {}).get("name") if isinstance(tool_choice, dict) else None
    if not isinstance(tool_choice, dict) or tool_choice.get("type") != "function" or not isinstance(name, str):
        raise InvalidRequestError('must be "none", "auto", "required" or {"type": "function", "function": '
                                  '{"name": ...}}', "tool_choice")
    if name not in names:
        raise InvalidRequestError(f"names {name!r}, which is not among the tools", "tool_choice")
    return ToolUse(parsed, (name,))


def _tool(i: int, tool: Any) -> Tool:
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        raise InvalidRequestError('must be {"type": "function", "function": {...}}', f"tools[{i}]")
    function = tool["function"]
    name = function.get("name")
    if not isinstance(name, str) or not name or len(name) > 64:
        raise InvalidRequestError("must be a name of 1-64 characters", f"tools[{i}].function.name")
    description = function.get("description") or ""
    if not isinstance(description, str):
        raise InvalidRequestError("must be a string", f"tools[{i}].function.description")
    parameters = function.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(parameters, dict):
        raise InvalidRequestError("must be a JSON schema object", f"tools[{i}].function.parameters")
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
    """(the text outside the tag, None if empty; the calls in it) of a model's answer. A tag
    whose JSON does not parse (an answer cut by max_tokens) stays text, with no calls."""
    start = text.find(BEGIN)
    end = text.find(END, start + len(BEGIN)) if start >= 0 else -1
    if start < 0 or end < 0:
        return text, []
    try:
        entries = json.loads(text[start + len(BEGIN) : end])
    except ValueError:
        return text, []
    if isinstance(entries, dict):
        entries = [entries]
    if not isinstance(entries, list) or not all(isinstance(e, dict) and isinstance(e.get("name"), str)
                                                for e in entries):
        return text, []
    calls = [ToolCall(f"call_{uuid.uuid4().hex[:24]}", e["name"], json.dumps(e.get("arguments", {})))
             for e in entries]
    rest = (text[:start] + text[end + len(END):]).strip()
    return rest or None, calls


def held_back(text: str) -> int:
    """How many characters at the end of streamed ``text`` must wait: all from a tag's start
    on, or a trailing piece that may become the tag's start."""
    start = text.find(BEGIN)
    if start >= 0:
        return len(text) - start
    for k in range(min(len(BEGIN) - 1, len(text)), 0, -1):
        if BEGIN.startswith(text[-k:]):
            return k
    return 0
