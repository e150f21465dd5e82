"""The request bodies of the OpenAI-compatible endpoints, as pydantic models.

Unknown fields are refused (``extra="forbid"``): a misspelt or unsupported parameter is a 400
naming it, never silently ignored. Parameters loraplex accepts but cannot honour yet (``n`` > 1,
penalties other than 0, ``echo``, ``best_of`` > 1, a non-empty ``logit_bias``) are checked in
convert.py, which names them too. Beyond OpenAI's parameters, ``top_k``,
``repetition_penalty`` and ``ignore_eos`` are accepted as vLLM accepts them.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Body):
    include_usage: bool = False


class _Sampling(_Body):
    """The parameters both endpoints share."""

    model: str
    max_tokens: int | None = None
    temperature: float | None = None  # None: OpenAI's default, 1.0
    top_p: float | None = None
    top_k: int | None = None  # vLLM extra; -1 or 0 = off
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(default=None, max_length=256)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float | None = None  # vLLM extra
    ignore_eos: bool = False  # vLLM extra
    logit_bias: dict[str, float] | None = None


class CompletionRequest(_Sampling):
    """POST /v1/completions: one prompt, as text or token ids."""

    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None  # the top-N alternatives per token (the chosen token's is always there)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None


class ChatCompletionRequest(_Sampling):
    """POST /v1/chat/completions: messages through the tokenizer's chat template."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None  # the newer name of max_tokens; wins when both are set
    logprobs: bool = False
    top_logprobs: int | None = None
