"""The limits of a request and the checks both edges make before handing it to the engine.

Each check takes the field name the caller knows (``stopping.max_new_tokens`` on gRPC,
``max_tokens`` over HTTP), so every refusal is an InvalidRequestError naming the caller's own
field. Nothing here knows a wire format.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from loraplex.adapter_store.errors import ContextLengthExceededError, InvalidRequestError
from loraplex.inference_server.engine.api import PromptTokenizer
from loraplex.inference_server.engine.info import EngineInfo
from loraplex.inference_server.engine.request import GenerationRequest, GrammarSpec, SamplingParams, StoppingCriteria
from loraplex.inference_server.model.tokenizer import ChatOptions

SEED_RANGE = 2**63  # seeds are in [0, 2^63) (engine/request.py)
MAX_CHOICES = 16  # n (and best_of): each choice is a request of its own in the engine
CHAT_ROLES = ("system", "user", "assistant")  # ChatMessage.role in inference.proto
ROLE_ALIASES = {"developer": "system"}  # OpenAI's newer name of the system role, read as it (both edges)
INLINE_TOKENIZE_CHARS = 8192  # longer prompts (and every chat) are tokenized off the event loop


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """What the edge checks before handing a request to the engine."""

    vocab_size: int
    max_context_len: int
    max_new_tokens_limit: int
    default_max_new_tokens: int
    max_prompt_chars: int | None = None  # longer text is past the window untokenized (None: no bound)
    max_streams: int | None = None  # engine requests one request may make (EngineInfo.max_streams)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "max_context_len", "max_new_tokens_limit", "default_max_new_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_prompt_chars is not None and self.max_prompt_chars < 0:
            raise ValueError(f"max_prompt_chars must be >= 0, got {self.max_prompt_chars}")

    @classmethod
    def for_engine(cls, info: EngineInfo, default_max_new_tokens: int) -> "RequestLimits":
        """The limits of requests to an engine; the edge's default is capped by the engine's limit."""
        return cls(vocab_size=info.vocab_size, max_context_len=info.max_context_len,
                   max_new_tokens_limit=info.max_new_tokens_limit,
                   default_max_new_tokens=min(default_max_new_tokens, info.max_new_tokens_limit),
                   max_prompt_chars=info.max_prompt_chars, max_streams=info.max_streams)


def check_token_ids(ids: Iterable[int], vocab_size: int, field: str) -> tuple[int, ...]:
    """``ids`` as a tuple; InvalidRequestError naming ``field`` for one outside the vocabulary."""
    out = tuple(ids)
    bad = next((t for t in out if t >= vocab_size), None)
    if bad is not None:
        raise InvalidRequestError(f"token id {bad} is outside the vocabulary (size {vocab_size})", field)
    return out


def check_text_length(text: str, limits: RequestLimits, field: str) -> None:
    """Refuse a text that cannot fit the context window by its length alone, before tokenizing
    it: megabytes of text cost the tokenizer seconds of CPU and hundreds of MiB. For a chat,
    ``text`` is its messages' contents, all of which its template's text holds."""
    if limits.max_prompt_chars is not None and len(text) > limits.max_prompt_chars:
        raise ContextLengthExceededError(
            f"the prompt has {len(text)} characters; at most {limits.max_prompt_chars} can fit the context "
            f"window of {limits.max_context_len} tokens with this model's tokenizer",
            field,
        )


def check_prompt_ids(ids: tuple[int, ...], limits: RequestLimits, field: str) -> tuple[int, ...]:
    """``ids`` if the prompt has tokens and leaves room in the context window for one more."""
    if not ids:
        raise InvalidRequestError("the prompt has no tokens", field)
    if len(ids) >= limits.max_context_len:
        raise ContextLengthExceededError(
            f"the prompt has {len(ids)} tokens; the context window is {limits.max_context_len} "
            "(prompt + generated tokens)",
            field,
        )
    return ids


def text_of_parts(parts: Iterable[tuple[str, str | None]], field: str) -> str:
    """The text of a message's content parts, each (type, text), joined in order by line breaks (as
    vLLM joins them: "Translate to French:" and "Good morning" are two lines, not one glued word).
    The model takes text: a part of another type (image_url, input_audio, file, ...) is refused
    naming the part and its type (``<field>[j].type``), as is a text part without its text."""
    texts = []
    for j, (kind, text) in enumerate(parts):
        if kind != "text":
            raise InvalidRequestError(f"{kind!r} is not supported: the model takes text", f"{field}[{j}].type")
        if text is None:
            raise InvalidRequestError("is required", f"{field}[{j}].text")
        texts.append(text)
    return "\n".join(texts)


def chat_prompt_ids(messages: list[dict[str, Any]], tokenizer: PromptTokenizer, field: str,
                    template_field: str, tools: list[dict[str, Any]] | None = None,
                    roles: tuple[str, ...] = CHAT_ROLES, options: ChatOptions | None = None) -> list[int]:
    """The chat template applied to ``messages`` ({role, content}, and for a template that renders
    tools, ``tools`` and the ``roles`` of tool turns; ``options``: the generation prompt and the
    template's variables); errors name ``field`` (a message) or ``template_field`` (no template,
    or the template refused them)."""
    if not messages:
        raise InvalidRequestError("at least one message is required", field)
    for i, m in enumerate(messages):
        if not m["role"]:
            raise InvalidRequestError(f"message {i} has no role", f"{field}[{i}].role")
        if m["role"] not in roles:
            raise InvalidRequestError(f"message {i} has role {m['role']!r}; roles are {', '.join(roles)}",
                                      f"{field}[{i}].role")
    try:
        if options is not None:
            return tokenizer.apply_chat_template(messages, tools, options)
        return tokenizer.apply_chat_template(messages, tools) if tools else tokenizer.apply_chat_template(messages)
    except ValueError as exc:  # no chat template, or the template refused the messages
        raise InvalidRequestError(str(exc), template_field) from None


def max_new_tokens_checked(requested: int | None, limits: RequestLimits, field: str) -> int:
    """The request's max_new_tokens (None: the server's default), refused above the limit."""
    max_new = limits.default_max_new_tokens if requested is None else requested
    if max_new > limits.max_new_tokens_limit:
        raise InvalidRequestError(f"{max_new} is above this server's limit of {limits.max_new_tokens_limit}", field)
    return max_new


def fitted_max_new_tokens(requested: int | None, prompt_len: int, limits: RequestLimits, field: str,
                          window_field: str) -> int:
    """max_new_tokens for a prompt of ``prompt_len`` tokens: the server's default cut to the room
    the prompt leaves when none was asked for; one asked for that does not fit the context
    window is refused (ContextLengthExceededError naming ``window_field``), as OpenAI and vLLM
    refuse it, never cut silently."""
    max_new = max_new_tokens_checked(requested, limits, field)
    room = limits.max_context_len - prompt_len
    if requested is None:
        return max(1, min(max_new, room))
    if max_new > room:
        raise ContextLengthExceededError(
            f"this model's maximum context length is {limits.max_context_len} tokens; you requested "
            f"{prompt_len + max_new} tokens ({prompt_len} in the prompt, {max_new} to generate): reduce the prompt "
            f"or {field}", window_field)
    return max_new


def tenant_of(adapter_id: str | None) -> str | None:
    """The tenant part of ``tenant/name`` (None for the base model or a shared adapter)."""
    return adapter_id.split("/", 1)[0] if adapter_id and "/" in adapter_id else None


def check_streams(count: int, prompts: int, limits: RequestLimits, field: str) -> None:
    """Refuse ``count`` choices of each of ``prompts`` prompts (``field``: n or best_of) when they
    are more engine requests than the engine holds at once: some could never be admitted, and a
    "queue full" answer would be retried forever."""
    total = count * prompts
    if limits.max_streams is not None and total > limits.max_streams:
        each = f" for each of {prompts} prompts" if prompts > 1 else ""
        raise InvalidRequestError(
            f"{count} choices{each} is {total} generations, more than the {limits.max_streams} this server holds at "
            f"once (--max-num-seqs + --max-waiting)", field)


def choice_requests(prompt: tuple[int, ...], adapter_id: str | None, sampling: SamplingParams,
                    stopping: StoppingCriteria, count: int, *, skip_special_tokens: bool = True,
                    grammar: GrammarSpec | None = None) -> tuple[GenerationRequest, ...]:
    """``count`` engine requests of one prompt (the ``n`` choices): one prompt group (they share
    its KV blocks), each with a server-unique id; a seeded choice ``i`` draws with ``seed + i``,
    as vLLM does (modulo 2^63: every seed the caller may send gives valid ones). The group is
    named after its first choice, which alone accounts for the prompt (``counts_prompt``)."""
    ids = [uuid.uuid4().hex for _ in range(count)]
    group = ids[0] if count > 1 else None
    out = []
    for i, request_id in enumerate(ids):
        params = (sampling if sampling.seed is None or i == 0
                  else dataclasses.replace(sampling, seed=(sampling.seed + i) % SEED_RANGE))
        out.append(GenerationRequest(request_id=request_id, prompt_token_ids=prompt, adapter_id=adapter_id,
                                     sampling=params, stopping=stopping, tenant=tenant_of(adapter_id),
                                     skip_special_tokens=skip_special_tokens, prompt_group=group, grammar=grammar))
    return tuple(out)


def counts_prompt(request: GenerationRequest) -> bool:
    """Whether ``request`` accounts for its prompt's tokens (metrics, tenant usage and quotas):
    a request alone, or the first choice of its prompt group (the choices share the prompt's
    KV blocks, and usage reports the prompt once)."""
    return request.prompt_group is None or request.prompt_group == request.request_id


def check_not_model_name(adapter_id: str, info: EngineInfo, field: str) -> None:
    """Refuse storing an adapter under the served model's name: /v1/models would list that name
    twice, and a request naming it would get the base model over HTTP and the adapter over gRPC."""
    if adapter_id == info.model_name:
        raise InvalidRequestError(f"{adapter_id!r} is the name this server serves its base model as "
                                  f"(--served-model-name): an adapter of that name could not be told from the "
                                  f"base model; choose another id", field)
