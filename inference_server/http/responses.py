"""Token events -> OpenAI response objects (completions and chat, chunks and whole answers).

A formatter is made per request; it numbers nothing and keeps only what a stream needs to
carry over between chunks (the completion API's character offsets). Tokens of a logprobs
answer are named by their decoded text, as OpenAI names them.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from loraplex.inference_server.engine.request import FinishReason, TokenEvent, Usage

Decode = Callable[[list[int]], str]

# the engine's finish reasons as OpenAI's (an abort is reported as vLLM reports it)
FINISH_REASONS = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length", FinishReason.ABORT: "abort",
                  FinishReason.ERROR: "error"}


def usage_json(usage: Usage) -> dict:
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.prompt_tokens + usage.completion_tokens}


def _finish(event: TokenEvent) -> str | None:
    return FINISH_REASONS[event.finish_reason] if event.finish_reason is not None else None


def _ranked(alternatives: dict[int, float]) -> list[tuple[int, float]]:
    return sorted(alternatives.items(), key=lambda kv: kv[1], reverse=True)


@dataclass(slots=True)
class _Format:
    """What every response of one request shares."""

    model: str
    decode: Decode
    logprobs: bool
    prefix: str = "cmpl"
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        self.id = f"{self.prefix}-{uuid.uuid4().hex}"

    def _envelope(self, kind: str, choices: list[dict]) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}


@dataclass(slots=True)
class CompletionFormat(_Format):
    """/v1/completions: ``text`` per choice, logprobs as tokens / token_logprobs / top_logprobs /
    text_offset."""

    offset: int = 0  # characters of completion text before the next chunk

    def _logprobs(self, event: TokenEvent) -> dict | None:
        if not self.logprobs:
            return None
        tokens = [self.decode([t]) for t in event.token_ids]
        offsets = []
        for text in tokens:
            offsets.append(self.offset)
            self.offset += len(text)
        top = None
        if event.top_logprobs is not None:
            top = [{self.decode([t]): lp for t, lp in _ranked(alts)} for alts in event.top_logprobs]
        return {"tokens": tokens, "token_logprobs": list(event.logprobs or ()), "top_logprobs": top,
                "text_offset": offsets}

    def chunk(self, event: TokenEvent) -> dict:
        choice = {"index": 0, "text": event.text, "logprobs": self._logprobs(event), "finish_reason": _finish(event)}
        return self._envelope("text_completion", [choice])

    def usage_chunk(self, usage: Usage) -> dict:
        return {**self._envelope("text_completion", []), "usage": usage_json(usage)}

    def response(self, events: list[TokenEvent]) -> dict:
        """The whole answer of a non-streaming request."""
        parts = [self._logprobs(e) for e in events]
        logprobs = None
        if self.logprobs:
            logprobs = {key: [x for p in parts for x in (p[key] or ())] for key in
                        ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
        choice = {"index": 0, "text": "".join(e.text for e in events), "logprobs": logprobs,
                  "finish_reason": _finish(events[-1])}
        out = self._envelope("text_completion", [choice])
        if events[-1].usage is not None:
            out["usage"] = usage_json(events[-1].usage)
        return out


@dataclass(slots=True)
class ChatFormat(_Format):
    """/v1/chat/completions: ``delta`` chunks (the first names the role) or one ``message``;
    logprobs as ``content`` entries of token, logprob, bytes and top_logprobs."""

    prefix: str = "chatcmpl"
    started: bool = False

    def _entry(self, token_id: int, logprob: float) -> dict:
        text = self.decode([token_id])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    def _content(self, event: TokenEvent) -> list[dict]:
        out = []
        tops = event.top_logprobs or ()
        for i, (token_id, logprob) in enumerate(zip(event.token_ids, event.logprobs or ())):
            top = [self._entry(t, lp) for t, lp in _ranked(tops[i])] if i < len(tops) else []
            out.append({**self._entry(token_id, logprob), "top_logprobs": top})
        return out

    def chunk(self, event: TokenEvent) -> dict:
        delta = {"content": event.text}
        if not self.started:
            delta = {"role": "assistant", **delta}
            self.started = True
        logprobs = {"content": self._content(event)} if self.logprobs else None
        choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": _finish(event)}
        return self._envelope("chat.completion.chunk", [choice])

    def usage_chunk(self, usage: Usage) -> dict:
        return {**self._envelope("chat.completion.chunk", []), "usage": usage_json(usage)}

    def response(self, events: list[TokenEvent]) -> dict:
        """The whole answer of a non-streaming request."""
        logprobs = {"content": [c for e in events for c in self._content(e)]} if self.logprobs else None
        message = {"role": "assistant", "content": "".join(e.text for e in events)}
        choice = {"index": 0, "message": message, "logprobs": logprobs, "finish_reason": _finish(events[-1])}
        out = self._envelope("chat.completion", [choice])
        if events[-1].usage is not None:
            out["usage"] = usage_json(events[-1].usage)
        return out
