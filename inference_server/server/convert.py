"""Protobuf <-> domain conversion for the gRPC edge: small from_pb / to_pb functions.

The checks that do not depend on protobuf (prompt length, chat messages, max_new_tokens,
token ids) are the edge core's (edge/checks.py), called here with the proto field paths.

Every caller mistake becomes an InvalidRequestError whose ``field`` is the proto field path
(``sampling.top_p``, ``stopping.max_new_tokens``, ``chat.messages``), so the interceptor can
name it in the INVALID_ARGUMENT status.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from google.protobuf.timestamp_pb2 import Timestamp

from loraplex.adapter_store.errors import InvalidRequestError
from loraplex.adapter_store.format.files import AdapterInfo
from loraplex.adapter_store.format.naming import validate_adapter_id
from loraplex.inference_server.edge.checks import (
    MAX_CHOICES,
    ROLE_ALIASES,
    RequestLimits,
    chat_prompt_ids,
    check_prompt_ids,
    check_streams,
    check_text_length,
    check_token_ids,
    choice_requests,
    fitted_max_new_tokens,
    text_of_parts,
)
from loraplex.inference_server.engine.api import PromptTokenizer
from loraplex.inference_server.engine.request import (
    FinishReason,
    GenerationRequest,
    SamplingParams,
    StoppingCriteria,
    TokenEvent,
)
from loraplex.inference_server.server.response_format import response_format_from_pb
from loraplex.v1 import inference_pb2 as pb

MAX_REQUEST_ID_LEN = 128
T = TypeVar("T")

FINISH_REASON_TO_PB = {
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.ABORT: pb.FINISH_REASON_ABORT,
    FinishReason.ERROR: pb.FINISH_REASON_ERROR,
}


@dataclass(frozen=True, slots=True)
class EdgeRequest:
    """A decoded Generate call: the engine requests (one per choice, ``n``) and the id echoed
    to the client."""

    requests: tuple[GenerationRequest, ...]
    client_request_id: str

    @property
    def request(self) -> GenerationRequest:
        """The first choice's request."""
        return self.requests[0]


def _refield(prefix: str, build: Callable[[], T]) -> T:
    """Run ``build``; re-raise its InvalidRequestError with the field under ``prefix``."""
    try:
        return build()
    except InvalidRequestError as exc:
        if exc.field is None:
            raise InvalidRequestError(str(exc), prefix) from None
        message = str(exc).removeprefix(f"{exc.field}: ")
        raise InvalidRequestError(message, f"{prefix}.{exc.field}") from None


def client_request_id_from_pb(request_id: str) -> str:
    """The caller's request id (validated) or a fresh one."""
    if not request_id:
        return uuid.uuid4().hex
    if len(request_id) > MAX_REQUEST_ID_LEN or not all(" " < c <= "~" for c in request_id):
        raise InvalidRequestError(
            f"must be 1-{MAX_REQUEST_ID_LEN} printable ASCII characters without spaces", "request_id"
        )
    return request_id


def adapter_id_from_pb(adapter_id: str, field: str = "adapter_id") -> str | None:
    """Empty string = the base model; anything else must be a valid adapter id."""
    return validate_adapter_id(adapter_id, field) if adapter_id else None


def prompt_from_pb(msg: pb.GenerateRequest, tokenizer: PromptTokenizer, limits: RequestLimits) -> tuple[int, ...]:
    """The prompt's token ids from whichever of text / token_ids / chat is set."""
    kind = msg.WhichOneof("prompt")
    if kind is None:
        raise InvalidRequestError("set one of text, token_ids or chat", "prompt")
    if kind == "text":
        if not msg.text:
            raise InvalidRequestError("must be non-empty", "text")
        check_text_length(msg.text, limits, "text")
        ids = tuple(tokenizer.encode(msg.text))
    elif kind == "token_ids":
        ids = check_token_ids(msg.token_ids.ids, limits.vocab_size, "token_ids.ids")
    else:
        messages = chat_messages_from_pb(msg.chat)
        check_text_length("".join(m["content"] for m in messages), limits, "chat.messages")
        ids = tuple(chat_prompt_ids(messages, tokenizer, "chat.messages", "chat"))
    return check_prompt_ids(ids, limits, kind)


def chat_messages_from_pb(chat: pb.ChatMessages) -> list[dict[str, str]]:
    """{role, content} turns; a message's ``parts`` are its content's text (text parts only);
    the role ``developer`` is read as ``system``."""
    out = []
    for i, m in enumerate(chat.messages):
        content = m.content
        if m.parts:
            if m.content:
                raise InvalidRequestError("set content or parts, not both", f"chat.messages[{i}].parts")
            content = text_of_parts(((p.type, p.text) for p in m.parts), f"chat.messages[{i}].parts")
        out.append({"role": ROLE_ALIASES.get(m.role, m.role), "content": content})
    return out


def sampling_from_pb(msg: pb.SamplingParams, vocab_size: int | None = None) -> SamplingParams:
    """SamplingParams; unset optional fields keep the domain defaults. ``vocab_size``: the
    bound of logit_bias's token ids (None: unchecked here, the engine's check)."""
    defaults = SamplingParams()
    bias = tuple(sorted(msg.logit_bias.items()))
    if vocab_size is not None:
        check_token_ids([t for t, _ in bias], vocab_size, "sampling.logit_bias")
    return _refield("sampling", lambda: SamplingParams(
        temperature=msg.temperature,
        top_k=msg.top_k,
        top_p=msg.top_p if msg.HasField("top_p") else defaults.top_p,
        seed=msg.seed if msg.HasField("seed") else None,
        repetition_penalty=msg.repetition_penalty if msg.HasField("repetition_penalty") else defaults.repetition_penalty,
        presence_penalty=msg.presence_penalty,
        frequency_penalty=msg.frequency_penalty,
        min_p=msg.min_p,
        logit_bias=bias,
        logprobs=msg.logprobs or msg.top_logprobs > 0,
        top_logprobs=msg.top_logprobs,
        prompt_logprobs=msg.prompt_logprobs if msg.HasField("prompt_logprobs") else None,
    ))


def stopping_from_pb(msg: pb.StoppingCriteria, limits: RequestLimits, prompt_len: int) -> StoppingCriteria:
    """StoppingCriteria; max_new_tokens defaults to the server's default (cut to the room the
    prompt leaves) and is refused above its limit or past the context window."""
    max_new = fitted_max_new_tokens(msg.max_new_tokens if msg.HasField("max_new_tokens") else None, prompt_len,
                                    limits, "stopping.max_new_tokens", "stopping.max_new_tokens")
    stop_ids = check_token_ids(msg.stop_token_ids, limits.vocab_size, "stopping.stop_token_ids")
    return _refield("stopping", lambda: StoppingCriteria(
        max_new_tokens=max_new,
        stop_token_ids=stop_ids,
        stop_strings=tuple(msg.stop_strings),
        ignore_eos=msg.ignore_eos,
        min_tokens=msg.min_tokens,
    ))


def _stopping_fields(build: Callable[[], T]) -> T:
    """Run ``build``; a refusal naming a stopping field (a response format with ignore_eos or
    min_tokens) re-raised under its path here, ``stopping.<field>``."""
    try:
        return build()
    except InvalidRequestError as exc:
        if exc.field not in ("ignore_eos", "min_tokens"):
            raise
        raise InvalidRequestError(str(exc).removeprefix(f"{exc.field}: "), f"stopping.{exc.field}") from None


def generate_request_from_pb(
    msg: pb.GenerateRequest, tokenizer: PromptTokenizer, limits: RequestLimits
) -> EdgeRequest:
    """Validate and tokenize a GenerateRequest. The engine gets a server-unique request id."""
    client_id = client_request_id_from_pb(msg.request_id)
    adapter_id = adapter_id_from_pb(msg.adapter_id)
    sampling = sampling_from_pb(msg.sampling, limits.vocab_size)
    n = msg.n or 1
    if n > MAX_CHOICES:
        raise InvalidRequestError(f"must be in [1, {MAX_CHOICES}], got {n}", "n")
    check_streams(n, 1, limits, "n")
    prompt = prompt_from_pb(msg, tokenizer, limits)
    stopping = stopping_from_pb(msg.stopping, limits, len(prompt))
    grammar = response_format_from_pb(msg)  # structured output (server/response_format.py)
    skip_special = msg.skip_special_tokens if msg.HasField("skip_special_tokens") else True
    requests = _stopping_fields(lambda: choice_requests(prompt, adapter_id, sampling, stopping, n,
                                                        skip_special_tokens=skip_special, grammar=grammar))
    return EdgeRequest(requests=requests, client_request_id=client_id)


def _add_tops(field: Any, tops: tuple[dict[int, float] | None, ...]) -> None:
    for alternatives in tops:
        ranked = sorted((alternatives or {}).items(), key=lambda kv: kv[1], reverse=True)
        field.add().candidates.extend(pb.TokenLogprob(token_id=t, logprob=lp) for t, lp in ranked)


def token_event_to_pb(event: TokenEvent, client_request_id: str, index: int = 0) -> pb.GenerateResponse:
    """One streamed step of choice ``index``; the last one carries finish reason, usage and timings."""
    out = pb.GenerateResponse(request_id=client_request_id, text=event.text, token_ids=event.token_ids, index=index)
    if event.logprobs is not None:
        out.logprobs.extend(event.logprobs)
    if event.top_logprobs is not None:
        _add_tops(out.top_logprobs, event.top_logprobs)
    if event.prompt_logprobs is not None:
        out.prompt_logprobs.extend(math.nan if lp is None else lp for lp in event.prompt_logprobs)
        _add_tops(out.prompt_top_logprobs, event.prompt_top_logprobs or ())
    if event.finish_reason is not None:
        out.finish_reason = FINISH_REASON_TO_PB[event.finish_reason]
    if event.usage is not None:
        out.usage.prompt_tokens = event.usage.prompt_tokens
        out.usage.completion_tokens = event.usage.completion_tokens
    if event.timings is not None:
        t = event.timings
        out.timings.CopyFrom(pb.Timings(queue_s=t.queue_s, ttft_s=t.ttft_s, total_s=t.total_s))
    return out


def adapter_to_pb(info: AdapterInfo, residency: tuple[bool, bool] = (False, False)) -> pb.Adapter:
    """An AdapterInfo (loraplex.adapter_store.format.files) as the public Adapter message;
    ``residency``: (in the device pool, in the host tier)."""
    created = Timestamp()
    created.FromNanoseconds(int(info.created_at * 1e9))
    return pb.Adapter(
        adapter_id=info.adapter_id,
        version=info.version,
        sha256=info.sha256,
        rank=info.rank,
        lora_alpha=info.lora_alpha,
        target_modules=list(info.target_modules),
        dtype=info.dtype,
        size_bytes=info.size_bytes,
        created_at=created,
        resident=residency[0],
        host_cached=residency[1],
        public=info.public,
    )


PAGE_OVERHEAD = 1024  # a ListAdaptersResponse's bytes besides its adapters (the token, framing), at most


def fitting_page(adapters: list[pb.Adapter], next_token: str, max_message_bytes: int) -> tuple[list[pb.Adapter], str]:
    """The first of a page's ``adapters`` that fit one message of ``max_message_bytes`` (at least one),
    and the token after them: a page of ids whose infos would not fit ends early, and the caller
    follows the token as for any page."""
    size = PAGE_OVERHEAD
    for n, adapter in enumerate(adapters):
        size += adapter.ByteSize() + 8  # its tag and length
        if n and size > max_message_bytes:
            return adapters[:n], adapters[n - 1].adapter_id
    return adapters, next_token


def list_page(ids_sorted: list[str], prefix: str, page_size: int, page_token: str, max_page: int) -> tuple[list[str], str]:
    """One page of adapter ids (sorted) after ``page_token``; returns (ids, next_page_token)."""
    if page_token:
        adapter_id_from_pb(page_token, "page_token")
    size = min(page_size or max_page, max_page)
    matching = [i for i in ids_sorted if i.startswith(prefix) and (not page_token or i > page_token)]
    page = matching[:size]
    return page, (page[-1] if len(matching) > size else "")
