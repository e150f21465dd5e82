"""Token events -> OpenAI response objects (completions and chat, chunks and whole answers).

A formatter is made per request; it numbers nothing and keeps only what a stream needs to
carry over between chunks (the completion API's character offsets). Tokens of a logprobs
answer are named by their text, as OpenAI names them, and carry their own bytes
(Tokenizer.token_bytes): a token that holds part of a multi-byte character (one byte of an
emoji) is named by those bytes escaped (``\\xf0\\x9f``, as DeepSeek names them), so the
parts of one character keep distinct names.
"""

from __future__ import annotations

import codecs
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from loraplex.inference_server.engine.request import FinishReason, TokenEvent, Usage
from loraplex.inference_server.http.tools import ToolUse

TokenBytes = Callable[[int], bytes]  # a token id -> the bytes it adds to a text

# the engine's finish reasons as OpenAI's (an abort is reported as vLLM reports it)
FINISH_REASONS = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length", FinishReason.ABORT: "abort",
                  FinishReason.ERROR: "error"}


def _calls_finish(finish: str | None) -> str:
    """The finish reason of an answer that holds calls: ``tool_calls``, but ``length`` stays
    (max_tokens ended the answer once the calls' JSON was complete, before its end: the closing
    tag, or in it), as vLLM keeps it for a named or required tool choice."""
    return "length" if finish == "length" else "tool_calls"


def usage_json(usage: Usage) -> dict:
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.prompt_tokens + usage.completion_tokens}


def _finish(event: TokenEvent) -> str | None:
    return FINISH_REASONS[event.finish_reason] if event.finish_reason is not None else None


def token_name(data: bytes) -> str:
    """A token's name in a logprobs answer: the text of its bytes, each byte that is not part of a
    whole UTF-8 character written as ``\\xNN`` (a literal backslash-x)."""
    return data.decode("utf-8", "backslashreplace")


def _ranked(alternatives: dict[int, float]) -> list[tuple[int, float]]:
    return sorted(alternatives.items(), key=lambda kv: kv[1], reverse=True)


def total_usage(usages: dict[int, Usage], per_prompt: int = 1) -> Usage:
    """The usage of a request's choices together (``usages`` by choice index; ``per_prompt``
    choices a prompt, prompt after prompt): each prompt once, every choice's tokens, as OpenAI
    sums a batch."""
    prompts: dict[int, int] = {}
    for index, usage in usages.items():
        prompts.setdefault(index // per_prompt, usage.prompt_tokens)
    return Usage(sum(prompts.values()), sum(u.completion_tokens for u in usages.values()))


@dataclass(slots=True)
class _Format:
    """What every response of one request shares, and the running counts of a stream
    (``continuous_usage_stats`` reports them on every chunk)."""

    model: str
    token_bytes: TokenBytes
    logprobs: bool
    prompt_tokens: int = 0  # every prompt's
    continuous_usage: bool = False
    n: int = 1  # choices a prompt: choice i answers prompt i // n
    prefix: str = "cmpl"
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    generated: int = 0  # tokens streamed so far, every choice's

    def __post_init__(self) -> None:
        self.id = f"{self.prefix}-{uuid.uuid4().hex}"

    def _name(self, token_id: int) -> str:
        return token_name(self.token_bytes(token_id))

    def _envelope(self, kind: str, choices: list[dict]) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}

    def _chunk_envelope(self, kind: str, choice: dict, event: TokenEvent) -> dict:
        self.generated += len(event.token_ids)
        out = self._envelope(kind, [choice])
        if self.continuous_usage:
            out["usage"] = usage_json(Usage(self.prompt_tokens, self.generated))
        return out

    def total_usage(self, usages: dict[int, Usage]) -> Usage:
        """The usage of the choices together (``usages`` by choice index)."""
        return total_usage(usages, self.n)

    def _whole(self, kind: str, choices: list[dict], usages: dict[int, Usage]) -> dict:
        out = self._envelope(kind, choices)
        if usages:
            out["usage"] = usage_json(self.total_usage(usages))
        return out


@dataclass(slots=True)
class _TextOffsets:
    """A choice's ``text_offset``s: the characters its tokens' bytes make before each token, a
    token that starts inside a character (an emoji's second byte) at that character's."""

    chars: int = 0
    utf8: codecs.IncrementalDecoder = field(default_factory=lambda: codecs.getincrementaldecoder("utf-8")("replace"))

    def advance(self, data: bytes) -> int:
        """The offset of the next token, whose bytes are ``data``."""
        offset = self.chars
        self.chars += len(self.utf8.decode(data))
        return offset


@dataclass(slots=True)
class CompletionFormat(_Format):
    """/v1/completions: ``text`` per choice, logprobs as tokens / token_logprobs / top_logprobs /
    text_offset; with ``echo`` (each prompt's text) each choice starts with its prompt, and its
    logprobs with the prompt tokens' (the first token's are null, as OpenAI's). Each other
    position's top_logprobs holds its token too, as vLLM's do (``logprobs: 0``: only it)."""

    echo: tuple[str, ...] | None = None
    prompt_ids: tuple[tuple[int, ...], ...] = ()  # with echo and logprobs: each prompt's tokens, named in the logprobs
    offsets: dict[int, _TextOffsets] = field(default_factory=dict)  # per choice: characters before its next token
    echoed: set[int] = field(default_factory=set)  # the choices whose prompt went out

    def _logprobs(self, index: int, event: TokenEvent) -> dict | None:
        if not self.logprobs:
            return None
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        if event.prompt_logprobs is not None and self.echo is not None:
            self._append(out, index, self.prompt_ids[index // self.n], event.prompt_logprobs,
                         event.prompt_top_logprobs)
        self._append(out, index, event.token_ids, event.logprobs or (), event.top_logprobs)
        return out

    def _append(self, out: dict, index: int, ids: tuple[int, ...], logprobs, tops) -> None:
        """Add tokens ``ids`` with their log-probabilities and alternatives (where known)."""
        offsets = self.offsets.setdefault(index, _TextOffsets())
        for i, token in enumerate(ids):
            data = self.token_bytes(token)
            logprob = logprobs[i] if i < len(logprobs) else None
            top = tops[i] if tops is not None and i < len(tops) else None
            out["tokens"].append(token_name(data))
            out["token_logprobs"].append(logprob)
            out["top_logprobs"].append(self._top(token, logprob, top))
            out["text_offset"].append(offsets.advance(data))

    def _top(self, token: int, logprob: float | None, alternatives: dict[int, float] | None) -> dict | None:
        """A position's top_logprobs: its alternatives and the token itself; null where neither is
        known (the first prompt token)."""
        if logprob is None and alternatives is None:
            return None
        out = {self._name(t): v for t, v in _ranked(alternatives or {})}
        if logprob is not None:
            out.setdefault(self._name(token), logprob)
        return out

    def _text(self, index: int, event: TokenEvent) -> str:
        if self.echo is None or index in self.echoed:
            return event.text
        self.echoed.add(index)
        echo = self.echo[index // self.n]
        if not self.logprobs:
            self.offsets[index] = _TextOffsets(len(echo))
        return echo + event.text

    def chunk(self, event: TokenEvent, index: int = 0) -> dict:
        text = self._text(index, event)
        choice = {"index": index, "text": text, "logprobs": self._logprobs(index, event),
                  "finish_reason": _finish(event)}
        return self._chunk_envelope("text_completion", choice, event)

    def usage_chunk(self, usage: Usage) -> dict:
        return {**self._envelope("text_completion", []), "usage": usage_json(usage)}

    def response(self, choices: list[list[TokenEvent]]) -> dict:
        """The whole answer of a non-streaming request: one list of events per choice."""
        out, usages = [], {}
        for index, events in enumerate(choices):
            parts = [self._logprobs(index, e) for e in events]
            logprobs = None
            if self.logprobs:
                logprobs = {key: [x for p in parts for x in p[key]] for key in
                            ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
            text = self._text(index, events[0]) + "".join(e.text for e in events[1:])
            out.append({"index": index, "text": text, "logprobs": logprobs, "finish_reason": _finish(events[-1])})
            if events[-1].usage is not None:
                usages[index] = events[-1].usage
        return self._whole("text_completion", out, usages)


@dataclass(slots=True)
class ChatFormat(_Format):
    """/v1/chat/completions: ``delta`` chunks (a choice's first names the role) or one
    ``message`` per choice; logprobs as ``content`` entries of token, logprob, bytes and
    top_logprobs. With ``tools``, the calls the text holds come back as ``tool_calls`` (finish
    reason ``tool_calls``, or ``length`` where max_tokens cut the answer): a stream holds back the
    text from where a call may start and sends the calls, whole, with the choice's last chunk."""

    prefix: str = "chatcmpl"
    started: set[int] = field(default_factory=set)
    tools: ToolUse | None = None  # the request's tools, in the model's tool-call format
    held: dict[int, str] = field(default_factory=dict)  # per choice: streamed text not sent yet
    spoke: set[int] = field(default_factory=set)  # choices that sent text (a call no longer starts them)

    def _delta(self, event: TokenEvent, index: int) -> tuple[dict, str | None]:
        """A chunk's delta and finish reason (with tools: the text that is safe to send, and the
        calls once the choice ends)."""
        finish = _finish(event)
        if self.tools is None:
            return {"content": event.text}, finish
        text = self.held.pop(index, "") + event.text
        at_start = index not in self.spoke
        if event.finish_reason is None:
            keep = self.tools.format.held_back(text, at_start)
            if keep:
                self.held[index] = text[len(text) - keep:]
            if keep < len(text):
                self.spoke.add(index)
            return {"content": text[: len(text) - keep]}, None
        content, calls = self.tools.parse(text) if at_start or self.tools.format.begin else (text, [])
        if not calls:
            return {"content": text}, finish
        tool_calls = [c.to_json(i) for i, c in enumerate(calls)]
        return {"content": content or "", "tool_calls": tool_calls}, _calls_finish(finish)

    def _entry(self, token_id: int, logprob: float) -> dict:
        data = self.token_bytes(token_id)
        return {"token": token_name(data), "logprob": logprob, "bytes": list(data)}

    def _content(self, event: TokenEvent) -> list[dict]:
        out = []
        tops = event.top_logprobs or ()
        for i, (token_id, logprob) in enumerate(zip(event.token_ids, event.logprobs or ())):
            top = [self._entry(t, lp) for t, lp in _ranked(tops[i])] if i < len(tops) else []
            out.append({**self._entry(token_id, logprob), "top_logprobs": top})
        return out

    def chunk(self, event: TokenEvent, index: int = 0) -> dict:
        delta, finish = self._delta(event, index)
        if index not in self.started:
            delta = {"role": "assistant", **delta}
            self.started.add(index)
        logprobs = {"content": self._content(event)} if self.logprobs else None
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return self._chunk_envelope("chat.completion.chunk", choice, event)

    def usage_chunk(self, usage: Usage) -> dict:
        return {**self._envelope("chat.completion.chunk", []), "usage": usage_json(usage)}

    def response(self, choices: list[list[TokenEvent]]) -> dict:
        """The whole answer of a non-streaming request: one list of events per choice."""
        out, usages = [], {}
        for index, events in enumerate(choices):
            logprobs = {"content": [c for e in events for c in self._content(e)]} if self.logprobs else None
            message = {"role": "assistant", "content": "".join(e.text for e in events)}
            finish = _finish(events[-1])
            content, calls = self.tools.parse(message["content"]) if self.tools else (message["content"], [])
            if calls:
                message = {"role": "assistant", "content": content, "tool_calls": [c.to_json() for c in calls]}
                finish = _calls_finish(finish)
            out.append({"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish})
            if events[-1].usage is not None:
                usages[index] = events[-1].usage
        return self._whole("chat.completion", out, usages)


def best_of(choices: list[list[TokenEvent]], n: int, per_prompt: int) -> list[list[TokenEvent]]:
    """Of each prompt's ``per_prompt`` choices (prompt after prompt), the ``n`` whose tokens are
    likeliest together (the sum of their log-probabilities), in their original order: what
    ``best_of`` keeps."""
    def score(events: list[TokenEvent]) -> float:
        return sum(lp for e in events for lp in (e.logprobs or ()))
    out = []
    for start in range(0, len(choices), per_prompt):
        group = choices[start:start + per_prompt]
        keep = sorted(sorted(range(len(group)), key=lambda i: score(group[i]), reverse=True)[:n])
        out += [group[i] for i in keep]
    return out
