"""OpenAI request bodies -> the engine's GenerationRequest, with the edge core's checks.

The prompt, chat, max_new_tokens and token-id checks are edge/checks.py's, called with
OpenAI's parameter names; SamplingParams and StoppingCriteria validate the rest, and their
field names are renamed to the parameter the caller sent (``stop_strings`` -> ``stop``,
``max_new_tokens`` -> ``max_tokens``), so every 400 names a parameter of this API. A request
for ``n`` choices (or ``best_of``) is that many engine requests of one prompt group, which share
the prompt's KV blocks. ``response_format`` (json_object, json_schema) and ``tools`` become the
requests' GrammarSpec (structured output; tools.py for the tool-call format).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TypeVar

from loraplex.adapter_store.errors import AdapterNotFoundError, InvalidRequestError
from loraplex.adapter_store.format.naming import validate_adapter_id
from loraplex.inference_server.edge import checks as edge
from loraplex.inference_server.edge.checks import MAX_CHOICES, RequestLimits
from loraplex.inference_server.engine.api import PromptTokenizer
from loraplex.inference_server.engine.request import GenerationRequest, GrammarSpec, SamplingParams, StoppingCriteria
from loraplex.inference_server.engine.schema_checks import check_schema
from loraplex.inference_server.http import tool_formats, tools as tool_calls
from loraplex.inference_server.http.chat_turns import chat_turns
from loraplex.inference_server.http.prompts import completion_prompts
from loraplex.inference_server.http.schemas import ChatCompletionRequest, CompletionRequest, _Sampling, ignored_fields
from loraplex.inference_server.model.tokenizer import ChatOptions

T = TypeVar("T")
OPENAI_DEFAULT_TEMPERATURE = 1.0


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
        try:
            return validate_adapter_id(model, "model")
        except InvalidRequestError:  # no adapter can have this name: unknown, as GET /v1/models/{model} says
            raise AdapterNotFoundError(model) from None


@dataclass(frozen=True, slots=True)
class DecodedRequest:
    """A validated HTTP generation request: the engine requests (one per choice; ``best_of`` of
    them when it is larger than ``n``; for a batch of prompts, that many a prompt, prompt after
    prompt) and how to answer them."""

    requests: tuple[GenerationRequest, ...]
    model: str  # echoed in every response, as the caller named it
    stream: bool
    include_usage: bool
    logprobs: bool
    top_logprobs: int
    n: int = 1
    continuous_usage: bool = False  # stream_options.continuous_usage_stats
    echo: tuple[str, ...] | None = None  # completions with echo: each prompt's text, put before its choices
    ignored: tuple[str, ...] = ()  # body fields this edge does not know (accepted, ignored)
    tools: tool_calls.ToolUse | None = None  # chat with tools: the answers' calls are read back out
    grammar_param: str = "response_format"  # the parameter the requests' grammar came from
    prompt_count: int = 1  # completions: the prompts of a batch

    def renamed(self, exc: InvalidRequestError) -> InvalidRequestError:
        """An engine refusal of the requests' grammar (``response_format...``) under the parameter
        the caller sent it as; any other refusal as it is."""
        if exc.field is None or not exc.field.startswith("response_format") or self.request.grammar is None:
            return exc
        field = "response_format.json_schema.schema" if self.grammar_param == "response_format" else "tools"
        if self.request.grammar.kind == "json_object":
            field = "response_format"
        return type(exc)(str(exc).removeprefix(f"{exc.field}: "), field)

    @property
    def request(self) -> GenerationRequest:
        """The first choice's request (every choice has the same adapter, sampling and grammar)."""
        return self.requests[0]

    @property
    def per_prompt(self) -> int:
        """The engine requests of each prompt (n, or best_of)."""
        return len(self.requests) // self.prompt_count

    @property
    def prompts(self) -> tuple[tuple[int, ...], ...]:
        """Each prompt's token ids, in order."""
        return tuple(self.requests[p * self.per_prompt].prompt_token_ids for p in range(self.prompt_count))


def _renamed(build: Callable[[], T], names: Mapping[str, str]) -> T:
    """Run ``build``; re-raise its InvalidRequestError under this API's parameter names (its field,
    and the names its message mentions)."""
    try:
        return build()
    except InvalidRequestError as exc:
        message = str(exc).removeprefix(f"{exc.field}: ")
        said = message
        for internal, sent in names.items():  # "must be in [0, max_new_tokens=2]": what the caller sent
            said = said.replace(f"{internal}=", f"{sent}=")
        if exc.field not in names and said == message:
            raise
        raise type(exc)(said, names.get(exc.field, exc.field)) from None


# Parameters of OpenAI's or vLLM's API that change the answer and that this edge does not honour, with
# the values that ask for nothing (null always does): anything else is refused by name, since an answer
# that ignored them would look right and be wrong (guided_json answered in free text). Other unknown
# fields are still accepted and ignored, as vLLM does (schemas.py).
UNHONOURED: dict[str, tuple[object, ...]] = {
    "functions": ([],), "function_call": ("none", "auto"), "modalities": (["text"],),
    "audio": (), "web_search_options": (), "echo": (False,), "chat_template": (), "documents": (),
    "guided_json": (), "guided_regex": (), "guided_choice": (), "guided_grammar": (), "structural_tag": (),
    "structured_outputs": (), "use_beam_search": (False,), "length_penalty": (1, 1.0),
    "include_stop_str_in_output": (False,), "prompt_logprobs": (), "bad_words": ([],), "allowed_token_ids": (),
    "truncate_prompt_tokens": (), "logits_processors": (), "return_tokens_as_token_ids": (False,),
    "spaces_between_special_tokens": (True,), "best_of": (1,),
}


def _check_supported(body: _Sampling) -> None:
    """400 for parameters accepted by the API but not honoured here, rather than ignoring them."""
    for name, value in (body.model_extra or {}).items():
        if name in UNHONOURED and value is not None and value not in UNHONOURED[name]:
            raise InvalidRequestError(f"is not supported by this server, got {json.dumps(value)[:80]}", name)
    if not 1 <= body.n <= MAX_CHOICES:
        raise InvalidRequestError(f"must be in [1, {MAX_CHOICES}], got {body.n}", "n")
    if body.stream_options is not None and not body.stream:
        raise InvalidRequestError("is only allowed with stream=true", "stream_options")


def _response_format(body: _Sampling) -> GrammarSpec | None:
    """``response_format``'s grammar: None for text, any JSON object, or a JSON schema's
    documents (``json_schema.schema``; its keywords checked against what is enforced)."""
    fmt = body.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return GrammarSpec("json_object")
    if not isinstance(fmt.json_schema, dict) or not isinstance(fmt.json_schema.get("schema"), dict):
        raise InvalidRequestError('needs {"name": ..., "schema": {...}}', "response_format.json_schema")
    for key, kind, name in (("name", str, "a string"), ("strict", bool, "true or false")):  # OpenAI's types
        if fmt.json_schema.get(key) is not None and not isinstance(fmt.json_schema[key], kind):
            raise InvalidRequestError(f"must be {name}, got {json.dumps(fmt.json_schema[key])[:40]}",
                                      f"response_format.json_schema.{key}")
    schema = fmt.json_schema["schema"]
    check_schema(schema, "response_format.json_schema.schema")
    return _renamed(lambda: GrammarSpec("json_schema", json.dumps(schema)),
                    {"response_format.schema": "response_format.json_schema.schema"})


def _logit_bias(body: _Sampling, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id": bias} as (id, bias) pairs, ids checked against the vocabulary."""
    out = []
    for key, bias in (body.logit_bias or {}).items():
        # ASCII digits only (str.isdigit takes "²" and other scripts' digits), and no longer than an id can be
        if not (key.isascii() and key.isdigit() and len(key) <= 12):
            raise InvalidRequestError(f"keys must be token ids, got {key[:40]!r}", "logit_bias")
        out.append((int(key), bias))
    edge.check_token_ids([t for t, _ in out], vocab_size, "logit_bias")
    return tuple(out)


def _sampling(body: _Sampling, limits: RequestLimits, logprobs: bool, top_logprobs: int, top_logprobs_param: str,
              prompt_logprobs: int | None = None) -> SamplingParams:
    defaults = SamplingParams()
    top_k = body.top_k if body.top_k is not None and body.top_k != -1 else 0  # vLLM's -1 = off
    if top_k < 0:  # the engine's words (>= 0, 0 = off) would hide the -1 this API takes
        raise InvalidRequestError(f"must be -1 or 0 (off) or a positive count, got {top_k}", "top_k")
    temperature = body.temperature if body.temperature is not None else OPENAI_DEFAULT_TEMPERATURE
    logit_bias = _logit_bias(body, limits.vocab_size)
    return _renamed(lambda: SamplingParams(
        temperature=temperature, top_k=top_k, top_p=body.top_p if body.top_p is not None else defaults.top_p,
        min_p=body.min_p or 0.0, seed=body.seed,
        repetition_penalty=body.repetition_penalty if body.repetition_penalty is not None
        else defaults.repetition_penalty,
        presence_penalty=body.presence_penalty or 0.0, frequency_penalty=body.frequency_penalty or 0.0,
        logit_bias=logit_bias, logprobs=logprobs, top_logprobs=top_logprobs, prompt_logprobs=prompt_logprobs,
    ), {"top_logprobs": top_logprobs_param, "prompt_logprobs": top_logprobs_param})


def _stopping(body: _Sampling, limits: RequestLimits, prompt: tuple[int, ...], prompt_param: str) -> StoppingCriteria:
    # max_completion_tokens, the newer name, wins (on completions too, where it was ignored for the default length)
    requested, max_param = ((body.max_completion_tokens, "max_completion_tokens") if body.max_completion_tokens
                            is not None else (body.max_tokens, "max_tokens"))
    max_new = edge.fitted_max_new_tokens(requested, len(prompt), limits, max_param, prompt_param)
    stops = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    stop_ids = edge.check_token_ids(body.stop_token_ids or (), limits.vocab_size, "stop_token_ids")
    return _renamed(lambda: StoppingCriteria(max_new_tokens=max_new, stop_strings=stops, stop_token_ids=stop_ids,
                                             ignore_eos=body.ignore_eos, min_tokens=body.min_tokens),
                    {"max_new_tokens": max_param, "stop_strings": "stop"})


def _choices(body: _Sampling, best_of: int | None) -> int:
    """How many engine requests answer ``body``: n, or best_of when it is larger."""
    if best_of is None:
        return body.n
    if not body.n <= best_of <= MAX_CHOICES:
        raise InvalidRequestError(f"must be in [n={body.n}, {MAX_CHOICES}], got {best_of}", "best_of")
    if best_of > body.n and body.stream:
        raise InvalidRequestError("cannot be larger than n when streaming", "best_of")
    return best_of


def _decoded(body: _Sampling, requests: tuple[GenerationRequest, ...], logprobs: bool, top_logprobs: int,
             echo: tuple[str, ...] | None = None, tools: tool_calls.ToolUse | None = None,
             prompt_count: int = 1) -> DecodedRequest:
    options = body.stream_options
    return DecodedRequest(requests=requests, prompt_count=prompt_count, model=body.model, stream=body.stream,
                          include_usage=options is not None and options.include_usage,
                          logprobs=logprobs, top_logprobs=top_logprobs, n=body.n,
                          continuous_usage=options is not None and options.continuous_usage_stats,
                          echo=echo, ignored=tuple(ignored_fields(body)), tools=tools,
                          grammar_param="tools" if tools is not None else "response_format")


def completion_request(body: CompletionRequest, tokenizer: PromptTokenizer, limits: RequestLimits,
                       names: ModelNames, max_prompts: int = 1) -> DecodedRequest:
    """Validate and tokenize a /v1/completions body (``logprobs`` = the alternatives per token).
    A batch of prompts (at most ``max_prompts``) is ``count`` engine requests a prompt, prompt
    after prompt: choice ``p * n + i`` is prompt p's choice i, as OpenAI and vLLM number them."""
    _check_supported(body)
    if body.suffix is not None:
        raise InvalidRequestError("is not supported", "suffix")
    grammar = _response_format(body)
    count = _choices(body, body.best_of)
    adapter = names.adapter_of(body.model)
    want_logprobs = body.logprobs is not None
    ranked = count > body.n  # best_of: the choices are ranked by their tokens' log-probabilities
    prompt_logprobs = body.logprobs if body.echo and want_logprobs else None
    sampling = _sampling(body, limits, want_logprobs or ranked, body.logprobs or 0, "logprobs", prompt_logprobs)
    prompts = completion_prompts(body.prompt, tokenizer, limits, max_prompts)
    edge.check_streams(count, len(prompts), limits, "best_of" if ranked else "n")
    requests: list[GenerationRequest] = []
    for p in prompts:  # each prompt its own choices, all in the engine's batches at once
        stopping = _stopping(body, limits, p.ids, p.field)
        requests += edge.choice_requests(p.ids, adapter, sampling, stopping, count,
                                         skip_special_tokens=body.skip_special_tokens, grammar=grammar)
    echo = tuple(p.text if p.text is not None else tokenizer.decode(list(p.ids)) for p in prompts) if body.echo \
        else None
    return _decoded(body, tuple(requests), want_logprobs, body.logprobs or 0, echo, prompt_count=len(prompts))


# apply_chat_template's own arguments: a template variable of these names would set them instead
_TEMPLATE_ARGUMENTS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs"})


def _chat_options(body: ChatCompletionRequest, messages: list[dict], constrained: bool) -> ChatOptions | None:
    """The template's options of a chat request (None: the defaults), checked: the last message
    is continued only when it is the assistant's, without the generation prompt, and not under a
    grammar (tools or response_format would constrain the continuation alone)."""
    kwargs = body.chat_template_kwargs or {}
    reserved = sorted(_TEMPLATE_ARGUMENTS.intersection(kwargs))
    if reserved:
        raise InvalidRequestError(f"{', '.join(reserved)} cannot be set here (a parameter of the request or the "
                                  "server)", "chat_template_kwargs")
    if body.continue_final_message:
        if body.add_generation_prompt:
            raise InvalidRequestError("needs add_generation_prompt=false (the answer continues the last message "
                                      "instead of opening a new one)", "continue_final_message")
        if messages[-1:] and messages[-1]["role"] != "assistant":
            raise InvalidRequestError(f"needs the last message to be the assistant's, got {messages[-1]['role']!r}",
                                      "continue_final_message")
        if constrained:
            raise InvalidRequestError("cannot be combined with tools or response_format", "continue_final_message")
    if body.add_generation_prompt and not body.continue_final_message and not kwargs:
        return None
    return ChatOptions(body.add_generation_prompt, body.continue_final_message, kwargs)


def chat_request(body: ChatCompletionRequest, tokenizer: PromptTokenizer, limits: RequestLimits,
                 names: ModelNames) -> DecodedRequest:
    """Validate a /v1/chat/completions body and apply the tokenizer's chat template."""
    _check_supported(body)
    grammar = _response_format(body)
    template = tokenizer.chat_template
    fmt = tool_formats.detect(template)
    tools = tool_calls.tool_use(body.tools, body.tool_choice, fmt, template, body.parallel_tool_calls)
    if tools is not None:
        if grammar is not None:
            raise InvalidRequestError("cannot be combined with tools (their calls have their own format)",
                                      "response_format")
        grammar = tools.grammar()
    if body.top_logprobs is not None and not body.logprobs:
        raise InvalidRequestError("needs logprobs=true", "top_logprobs")
    adapter = names.adapter_of(body.model)
    edge.check_streams(body.n, 1, limits, "n")
    top = body.top_logprobs or 0
    sampling = _sampling(body, limits, body.logprobs, top, "top_logprobs")
    messages = chat_turns(body, fmt, template)
    if tools is not None:
        messages = tools.messages(messages)
    edge.check_text_length("".join(m["content"] or "" for m in messages), limits, "messages")
    roles = (*edge.CHAT_ROLES, "tool") if fmt is not None and fmt.in_template else edge.CHAT_ROLES
    ids = edge.chat_prompt_ids(messages, tokenizer, "messages", "messages",
                               tools.template_tools() if tools is not None else None, roles,
                               _chat_options(body, messages, tools is not None or grammar is not None))
    prompt = edge.check_prompt_ids(tuple(ids), limits, "messages")
    stopping = _stopping(body, limits, prompt, "messages")
    requests = edge.choice_requests(prompt, adapter, sampling, stopping, body.n,
                                    skip_special_tokens=body.skip_special_tokens, grammar=grammar)
    return _decoded(body, requests, body.logprobs, top, tools=tools)
