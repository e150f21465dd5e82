"""The tool-call formats models are trained on, and which one a chat template speaks.

A model calls tools in the format its chat template teaches it; the server follows the template
(``detect``), never another model's format:

    hermes       <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>, one tag a call
                 (Qwen2.5, Qwen3, Hermes 2/3; the template renders the tools and tool turns)
    llama3_json  {"name": ..., "parameters": {...}}, the whole answer, optionally after
                 <|python_tag|> (Llama 3.1 / 3.2; the template renders them)
    mistral      [TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...], the whole answer
                 (Mistral; the template renders them)
    smollm2      <tool_call>[{"name": ..., "arguments": {...}}, ...]</tool_call> (SmolLM2-Instruct's
                 model card: its template has no tool section, tools.py writes them in a system turn)

A template that renders ``tools`` in none of these is not guessed at: tools are refused naming it.
Formats without a text tag (llama3_json, mistral) are constrained, for a forced choice, to the
call's JSON itself (their markers are special tokens a grammar cannot spell), and read back with
or without the marker; with "auto" they answer freely and a whole answer that is a call is one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from loraplex.inference_server.engine.request import GrammarSpec


@dataclass(frozen=True, slots=True)
class ToolFormat:
    """How one model family writes tool calls. ``begin``/``end``: the text tag around calls
    ("" for a format whose calls are the whole answer, after an optional ``marker``);
    ``listed``: the tag (or answer) holds a JSON list of calls, else one call object;
    ``args_key``: the key of the arguments; ``in_template``: the chat template renders the tools
    and tool turns itself (else tools.py's system turn does)."""

    name: str
    begin: str
    end: str
    listed: bool
    args_key: str = "arguments"
    marker: str = ""
    in_template: bool = True

    def grammar(self, calls: list[dict[str, Any]], forced: bool, parallel: bool = True) -> GrammarSpec | None:
        """The output's grammar for these call schemas (``forced``: a call must be made; not
        ``parallel``: a list holds one call); None where the model answers freely ("auto" in a
        format without a text tag)."""
        one = calls[0] if len(calls) == 1 else {"anyOf": calls}
        most = {} if parallel else {"maxItems": 1}
        payload = {"type": "array", "minItems": 1, **most, "items": one} if self.listed else one
        if self.begin:
            return GrammarSpec("tagged_json", json.dumps(payload), self.begin, self.end, free_text=not forced)
        return GrammarSpec("json_schema", json.dumps(payload)) if forced else None

    def call_schema(self, name: str, parameters: dict[str, Any]) -> dict[str, Any]:
        return {"type": "object", "properties": {"name": {"const": name}, self.args_key: parameters},
                "required": ["name", self.args_key], "additionalProperties": False}

    def parse(self, text: str) -> tuple[str | None, list[tuple[str, Any]]]:
        """(the text outside the calls, None if empty; the (name, arguments) calls) of an answer.
        An answer that ends inside a tag (cut by max_tokens before or inside its closing tag, as
        ``<tool_call>[...]</tool_``) still holds the tag's calls where their JSON is complete, as
        vLLM's Hermes parser reads an unclosed tag. A call whose JSON does not parse (cut inside
        it) leaves the whole text as text."""
        if not self.begin:
            body = text.strip().removeprefix(self.marker).strip() if self.marker else text.strip()
            calls = self._entries(body) if body[:1] in "[{" and body else None
            return (text, []) if calls is None else (None, calls)
        rest, calls, pos = [], [], 0
        while (start := text.find(self.begin, pos)) >= 0:
            opened = start + len(self.begin)
            end = text.find(self.end, opened)
            # unclosed: the answer ended in this tag, its body runs to a closing tag's start or the end
            close = end if end >= 0 else len(text) - _partial_tag(text[opened:], self.end)
            entries = self._entries(text[opened:close])
            if entries is None:
                return text, []
            rest.append(text[pos:start])
            calls += entries
            pos = end + len(self.end) if end >= 0 else len(text)
        rest.append(text[pos:])
        joined = "".join(rest).strip()
        return (joined or None) if calls else text, calls

    def _entries(self, body: str) -> list[tuple[str, Any]] | None:
        try:
            parsed = json.loads(body)
        except ValueError:
            return None
        items = parsed if isinstance(parsed, list) else [parsed]
        if not items or not all(isinstance(e, dict) and isinstance(e.get("name"), str) for e in items):
            return None
        return [(e["name"], e.get(self.args_key, e.get("arguments", {}))) for e in items]

    def held_back(self, text: str, at_start: bool) -> int:
        """How many characters at the end of streamed ``text`` must wait (may still be a call);
        ``at_start``: nothing of the answer was sent yet."""
        if not self.begin:
            body = text.lstrip()
            could_be = body[:1] in ("{", "[") or (self.marker and (body.startswith(self.marker)
                                                                   or self.marker.startswith(body)))
            return len(text) if at_start and (not body or could_be) else 0
        start = text.find(self.begin)
        return len(text) - start if start >= 0 else _partial_tag(text, self.begin)


def _partial_tag(text: str, tag: str) -> int:
    """How many characters at the end of ``text`` are the start of ``tag`` (not all of it)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


FORMATS: dict[str, ToolFormat] = {
    "hermes": ToolFormat("hermes", "<tool_call>\n", "\n</tool_call>", listed=False),
    "llama3_json": ToolFormat("llama3_json", "", "", listed=False, args_key="parameters", marker="<|python_tag|>"),
    "mistral": ToolFormat("mistral", "", "", listed=True, marker="[TOOL_CALLS]"),
    "smollm2": ToolFormat("smollm2", "<tool_call>", "</tool_call>", listed=True, in_template=False),
}


def detect(template: str) -> ToolFormat | None:
    """The format ``template`` (a chat template's Jinja text) teaches, or None when it renders
    tools in no format known here (or has no tool section and is not SmolLM2's)."""
    renders_tools = "tools" in template
    if renders_tools and "[TOOL_CALLS]" in template:
        return FORMATS["mistral"]
    if renders_tools and "<tool_call>" in template:
        return FORMATS["hermes"]
    if renders_tools and "<|start_header_id|>" in template and '"parameters"' in template:
        return FORMATS["llama3_json"]
    if not renders_tools and "SmolLM" in template:
        return FORMATS["smollm2"]
    return None


def describe(template: str) -> str:
    """What a refusal says of a template without a known format."""
    if not template:
        return "this model has no chat template"
    if "tools" not in template:
        return "this model's chat template has no tool section"
    return "this model's chat template renders tools in a format this server does not know"
