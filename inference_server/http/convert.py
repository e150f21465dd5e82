"""OpenAI request bodies -> the engine's GenerationRequest, with the gRPC edge's checks.

The prompt, chat, max_new_tokens and token-id checks are server/convert.py's, called with
OpenAI's parameter names; SamplingParams and StoppingCriteria validate the rest, and their
field names are renamed to the parameter the caller sent (``stop_strings`` -> ``stop``,
``max_new_tokens`` -> ``max_tokens``), so every 400 names a parameter of this API.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TypeVar

from loraplex.adapter_store.errors import AdapterNotFoundError, InvalidRequestError
from loraplex.adapter_store.format.naming import validate_adapter_id
from loraplex.inference_server.engine.api import PromptTokenizer
from loraplex.inference_server.engine.request import GenerationRequest, SamplingParams, StoppingCriteria
from loraplex.inference_server.http.schemas import ChatCompletionRequest, CompletionRequest, _Sampling
from loraplex.inference_server.server import convert as edge
from loraplex.inference_server.server.convert import RequestLimits

T = TypeVar("T")
OPENAI_DEFAULT_TEMPERATURE = 1.0
_ROLE_ALIASES = {"developer": "system"}  # OpenAI's newer name of the system role


@dataclass(frozen=True, slots=True)
class ModelNames:
    """The names of the base model: ``served`` is its id in /v1/models; ``aliases`` are
    accepted for it too."""

    served: str
    aliases: frozenset[str] = frozenset()

    def adapter_of(self, model: str) -> str | None:
        """The adapter a ``model`` parameter names: None for the base model, ``a`` for ``a`` or
        ``<base>:a`` (SGLang's form). A base other than this server's is a 404, never a
        fallback."""
        if model == self.served or model in self.aliases:
            return None
        base, sep, adapter = model.rpartition(":")
        if sep:
            if base != self.served and base not in self.aliases:
                raise AdapterNotFoundError(model)
            model = adapter
        return validate_adapter_id(model, "model")


@dataclass(frozen=True, slots=True)
class DecodedRequest:
    """A validated HTTP generation request: the engine request and how to answer it."""

    request: GenerationRequest
    model: str  # echoed in every response, as the caller named it
    stream: bool
    include_usage: bool
    logprobs: bool
    top_logprobs: int


def _renamed(build: Callable[[], T], names: Mapping[str, str]) -> T:
    """Run ``build``; re-raise its InvalidRequestError under this API's parameter name."""
    try:
        return build()
    except InvalidRequestError as exc:
        if exc.field not in names:
            raise
        message = str(exc).removeprefix(f"{exc.field}: ")
        raise InvalidRequestError(message, names[exc.field]) from None


def _check_supported(body: _Sampling) -> None:
    """400 for parameters accepted by the API but not honoured here, rather than ignoring them."""
    if body.n != 1:
        raise InvalidRequestError(f"only n=1 is supported, got {body.n}", "n")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(body, name) != 0:
            raise InvalidRequestError("is not supported (use repetition_penalty)", name)
    if body.logit_bias:
        raise InvalidRequestError("is not supported", "logit_bias")
    if body.stream_options is not None and not body.stream:
        raise InvalidRequestError("is only allowed with stream=true", "stream_options")


def _sampling(body: _Sampling, logprobs: bool, top_logprobs: int, top_logprobs_param: str) -> SamplingParams:
    defaults = SamplingParams()
    top_k = body.top_k if body.top_k is not None and body.top_k != -1 else 0  # vLLM's -1 = off
    temperature = body.temperature if body.temperature is not None else OPENAI_DEFAULT_TEMPERATURE
    return _renamed(lambda: SamplingParams(
        temperature=temperature, top_k=top_k, top_p=body.top_p if body.top_p is not None else defaults.top_p,
        seed=body.seed,
        repetition_penalty=body.repetition_penalty if body.repetition_penalty is not None
        else defaults.repetition_penalty,
        logprobs=logprobs, top_logprobs=top_logprobs,
    ), {"top_logprobs": top_logprobs_param})


def _stopping(body: _Sampling, requested: int | None, max_param: str, limits: RequestLimits) -> StoppingCriteria:
    max_new = edge.max_new_tokens_checked(requested, limits, max_param)
    stops = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    return _renamed(lambda: StoppingCriteria(max_new_tokens=max_new, stop_strings=stops, ignore_eos=body.ignore_eos),
                    {"max_new_tokens": max_param, "stop_strings": "stop"})


def _completion_prompt(prompt: str | list, tokenizer: PromptTokenizer, limits: RequestLimits) -> tuple[int, ...]:
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise InvalidRequestError(f"one prompt per request (got {len(prompt)}); send one request each",
                                      "prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        edge.check_text_length(prompt, limits, "prompt")
        ids = tuple(tokenizer.encode(prompt)) if prompt else ()
    else:
        if any(t < 0 for t in prompt):
            raise InvalidRequestError("token ids must be >= 0", "prompt")
        ids = edge.check_token_ids(prompt, limits.vocab_size, "prompt")
    return edge.check_prompt_ids(ids, limits, "prompt")


def _chat_messages(body: ChatCompletionRequest) -> list[dict[str, str]]:
    out = []
    for i, m in enumerate(body.messages):
        if m.content is None:
            raise InvalidRequestError(f"message {i} has no content (tool calls are not supported)",
                                      f"messages[{i}].content")
        content = m.content if isinstance(m.content, str) else "".join(part.text for part in m.content)
        out.append({"role": _ROLE_ALIASES.get(m.role, m.role), "content": content})
    return out


def _request(body: _Sampling, prompt: tuple[int, ...], adapter: str | None, sampling: SamplingParams,
             stopping: StoppingCriteria, logprobs: bool, top_logprobs: int) -> DecodedRequest:
    request = GenerationRequest(request_id=uuid.uuid4().hex, prompt_token_ids=prompt, adapter_id=adapter,
                                sampling=sampling, stopping=stopping, tenant=edge.tenant_of(adapter))
    include_usage = body.stream_options is not None and body.stream_options.include_usage
    return DecodedRequest(request=request, model=body.model, stream=body.stream, include_usage=include_usage,
                          logprobs=logprobs, top_logprobs=top_logprobs)


def completion_request(body: CompletionRequest, tokenizer: PromptTokenizer, limits: RequestLimits,
                       names: ModelNames) -> DecodedRequest:
    """Validate and tokenize a /v1/completions body (``logprobs`` = the alternatives per token)."""
    _check_supported(body)
    if body.echo:
        raise InvalidRequestError("is not supported", "echo")
    if body.best_of not in (None, 1):
        raise InvalidRequestError(f"only best_of=1 is supported, got {body.best_of}", "best_of")
    if body.suffix is not None:
        raise InvalidRequestError("is not supported", "suffix")
    adapter = names.adapter_of(body.model)
    want_logprobs = body.logprobs is not None
    sampling = _sampling(body, want_logprobs, body.logprobs or 0, "logprobs")
    stopping = _stopping(body, body.max_tokens, "max_tokens", limits)
    prompt = _completion_prompt(body.prompt, tokenizer, limits)
    return _request(body, prompt, adapter, sampling, stopping, want_logprobs, body.logprobs or 0)


def chat_request(body: ChatCompletionRequest, tokenizer: PromptTokenizer, limits: RequestLimits,
                 names: ModelNames) -> DecodedRequest:
    """Validate a /v1/chat/completions body and apply the tokenizer's chat template."""
    _check_supported(body)
    if body.top_logprobs is not None and not body.logprobs:
        raise InvalidRequestError("needs logprobs=true", "top_logprobs")
    adapter = names.adapter_of(body.model)
    top = body.top_logprobs or 0
    sampling = _sampling(body, body.logprobs, top, "top_logprobs")
    requested, param = ((body.max_completion_tokens, "max_completion_tokens") if body.max_completion_tokens
                        is not None else (body.max_tokens, "max_tokens"))
    stopping = _stopping(body, requested, param, limits)
    messages = _chat_messages(body)
    edge.check_text_length("".join(m["content"] for m in messages), limits, "messages")
    ids = edge.chat_prompt_ids(messages, tokenizer, "messages", "messages")
    prompt = edge.check_prompt_ids(tuple(ids), limits, "messages")
    return _request(body, prompt, adapter, sampling, stopping, body.logprobs, top)
