"""The request bodies of the OpenAI-compatible endpoints, as pydantic models.

Fields the edge does not know are accepted and ignored, as vLLM does (but for those of OpenAI's or
vLLM's API that would change the answer: convert.py refuses them by name): ``ignored_fields`` names
them, and the route logs them and names them in the ``X-Loraplex-Ignored-Fields`` response
header, so a misspelt parameter is visible without failing the request. A known field with a
bad value is a 400 naming it (``strict``: no silent coercion of types). Parameters whose form
is checked further (``response_format``'s schema, ``tools``, ``tool_choice``, ``suffix``) are
checked in convert.py and tools.py, which name them. Beyond OpenAI's parameters, vLLM's sampling extensions are
accepted as vLLM accepts them: ``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``,
``ignore_eos``, ``stop_token_ids``, ``skip_special_tokens``, and
``stream_options.continuous_usage_stats``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


def _null_is_unset(cls: type[BaseModel], value: Any, info: ValidationInfo) -> Any:
    """null for a parameter OpenAI lets be null (its clients send an explicit None so): its default."""
    return cls.model_fields[info.field_name].default if value is None else value


def _nullable(*fields: str) -> Any:
    """A before-validator reading null as the default for ``fields``."""
    return field_validator(*fields, mode="before")(classmethod(_null_is_unset))


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage (so far) on every chunk
    _nulls = _nullable("include_usage", "continuous_usage_stats")


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


class _Sampling(_Body):
    """The parameters both endpoints share."""

    model: str
    max_tokens: int | None = None
    max_completion_tokens: int | None = None  # the newer name of max_tokens; wins when both are set
    temperature: float | None = None  # None: OpenAI's default, 1.0
    top_p: float | None = None
    top_k: int | None = None  # vLLM extra; -1 or 0 = off
    min_p: float | None = None  # vLLM extra; 0 = off
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # vLLM extra
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(default=None, max_length=256)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # vLLM extra
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False  # vLLM extra
    min_tokens: int = 0  # vLLM extra
    skip_special_tokens: bool = True  # vLLM extra
    response_format: ResponseFormat | None = None
    _nulls = _nullable("n", "stream", "ignore_eos", "min_tokens", "skip_special_tokens")


class CompletionRequest(_Sampling):
    """POST /v1/completions: one prompt, as text or token ids."""

    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None  # the top-N alternatives per token (the chosen token's is always there)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None
    _completion_nulls = _nullable("echo")


class ContentPart(_Body):
    """A part of a message's content. The model takes text: a part of another type (image_url,
    input_audio, file, ...) is refused naming the part and its type (convert.py)."""

    type: str
    text: str | None = None


class ChatMessage(_Body):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant turn's calls (tools.py renders them)
    tool_call_id: str | None = None  # a tool turn's: which call it answers


class ChatCompletionRequest(_Sampling):
    """POST /v1/chat/completions: messages through the tokenizer's chat template."""

    messages: list[ChatMessage]
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True  # false: one call at most
    # vLLM's chat-template parameters: the assistant header at the end, or the last (assistant)
    # message continued; the template's own variables (Qwen3's enable_thinking)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    _chat_nulls = _nullable("logprobs", "parallel_tool_calls", "add_generation_prompt", "continue_final_message")


def ignored_fields(body: BaseModel, prefix: str = "") -> list[str]:
    """The fields of ``body`` (and of the bodies it holds) that no model declares, as parameter
    paths (``stream_options.foo``, ``messages[0].bar``), sorted."""
    out = [f"{prefix}{name}" for name in (body.model_extra or {})]
    for name in type(body).model_fields:
        value = getattr(body, name)
        if isinstance(value, BaseModel):
            out += ignored_fields(value, f"{prefix}{name}.")
        elif isinstance(value, list):
            for i, item in enumerate(value):
                if isinstance(item, BaseModel):
                    out += ignored_fields(item, f"{prefix}{name}[{i}].")
    return sorted(out)


class LoadLoraRequest(_Body):
    """POST /v1/load_lora_adapter (vLLM's): serve ``lora_path``'s adapter as ``lora_name``."""

    lora_name: str
    lora_path: str


class UnloadLoraRequest(_Body):
    """POST /v1/unload_lora_adapter (vLLM's): stop serving ``lora_name`` (``lora_int_id`` is vLLM's
    own numbering, accepted and ignored)."""

    lora_name: str
    lora_int_id: int | None = None
