"""A chat body's messages as the chat template takes them: {role, content} turns, and earlier
tool calls and results in the model's own tool-call format (tool_formats.py).

Where the template renders tool turns (``ToolFormat.in_template``), an assistant turn keeps its
``tool_calls`` (arguments as a JSON object, as templates render them) and a ``tool`` turn stays
one, so the prompt is transformers' rendering; for SmolLM2 (no tool section) they become its
model card's text (tools.py). A template in no known format cannot render them: refused, naming
the message.
"""

from __future__ import annotations

import json
from typing import Any

from loraplex.adapter_store.errors import InvalidRequestError
from loraplex.inference_server.edge import checks as edge
from loraplex.inference_server.http import tools as tool_calls
from loraplex.inference_server.http.schemas import ChatCompletionRequest
from loraplex.inference_server.http.tool_formats import ToolFormat, describe

_ROLES = ("system", "developer", "user", "assistant", "tool")  # every role a message may have


def chat_turns(body: ChatCompletionRequest, fmt: ToolFormat | None, template: str) -> list[dict[str, Any]]:
    """The body's turns for the template whose tool format is ``fmt`` (None: none known)."""
    out = []
    for i, m in enumerate(body.messages):
        content = m.content if isinstance(m.content, str) or m.content is None else edge.text_of_parts(
            ((part.type, part.text) for part in m.content), f"messages[{i}].content")
        role = _role(i, m.role)
        turn: dict[str, Any] = {"role": role, "content": content}
        if m.tool_calls and role != "assistant":  # the model made them: dropping them would change the chat
            raise InvalidRequestError(f"only an assistant message makes tool calls; message {i} is {m.role!r}",
                                      f"messages[{i}].tool_calls")
        if (m.tool_calls and role == "assistant") or role == "tool":
            if fmt is None:
                field = f"messages[{i}].tool_calls" if role == "assistant" else f"messages[{i}].role"
                raise InvalidRequestError(f"{describe(template)}, so tool turns cannot be rendered", field)
            if role == "tool" and content is None:
                raise InvalidRequestError(f"message {i} has no content", f"messages[{i}].content")
            turn = _tool_turn(turn, m.tool_calls or [], m.tool_call_id, fmt, f"messages[{i}].tool_calls")
        if turn["content"] is None and not turn.get("tool_calls"):
            raise InvalidRequestError(f"message {i} has no content", f"messages[{i}].content")
        out.append(turn)
    return out


def _role(i: int, role: str) -> str:
    """Message ``i``'s role as the template takes it; one not in _ROLES is refused naming it."""
    if role not in _ROLES:
        raise InvalidRequestError(f"message {i} has role {role!r}; roles are {', '.join(_ROLES)}",
                                  f"messages[{i}].role")
    return edge.ROLE_ALIASES.get(role, role)


def _tool_turn(turn: dict[str, Any], calls: list[dict[str, Any]], call_id: str | None, fmt: ToolFormat,
               field: str) -> dict[str, Any]:
    role, content = turn["role"], turn["content"]
    if not fmt.in_template:  # SmolLM2: the call as its tag in the text, a result as a user turn
        if role == "tool":
            return {"role": "user", "content": tool_calls.response_text(content)}
        text = tool_calls.call_text(calls, field)
        return {"role": role, "content": f"{content}\n{text}" if content else text}
    if role == "tool":
        return {**turn, **({"tool_call_id": call_id} if call_id else {})}
    return {**turn, "tool_calls": [_call(j, c, field) for j, c in enumerate(calls)]}


def _call(j: int, call: Any, field: str) -> dict[str, Any]:
    """An OpenAI tool call with its arguments parsed (templates render them with ``tojson``)."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise InvalidRequestError('must be {"function": {"name", "arguments"}}', f"{field}[{j}]")
    arguments = function.get("arguments") or "{}"
    try:
        parsed = json.loads(arguments) if isinstance(arguments, str) else arguments
    except ValueError:
        raise InvalidRequestError("is not JSON", f"{field}[{j}].function.arguments") from None
    out = {"type": "function", "function": {"name": function["name"], "arguments": parsed}}
    return {"id": call["id"], **out} if isinstance(call.get("id"), str) else out
