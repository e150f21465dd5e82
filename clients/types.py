"""What the client returns: plain dataclasses built from the API messages (no protobuf leaks)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from loraplex.v1 import inference_pb2 as pb

FINISH_REASONS = {
    pb.FINISH_REASON_UNSPECIFIED: None,
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_ABORT: "abort",
    pb.FINISH_REASON_ERROR: "error",
}


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True, slots=True)
class Timings:
    queue_s: float
    ttft_s: float
    total_s: float


TopCandidates = tuple[tuple[int, float], ...]  # (token_id, logprob) pairs, most likely first


@dataclass(frozen=True, slots=True)
class GenerationEvent:
    """One streamed message. ``finish_reason`` ("length", "stop", "abort", "error") is set on the last
    one of a choice, together with ``usage`` and ``timings``. ``top_logprobs`` has, per token,
    (token_id, logprob) pairs, most likely first. ``index`` is the choice (request ``n``) the tokens
    belong to. With ``prompt_logprobs`` asked for, a choice's first event carries one per prompt
    token (the first token has none: NaN) in ``prompt_logprobs`` and their alternatives in
    ``prompt_top_logprobs``."""

    request_id: str
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...] | None = None
    top_logprobs: tuple[TopCandidates, ...] | None = None
    finish_reason: str | None = None
    usage: Usage | None = None
    timings: Timings | None = None
    index: int = 0
    prompt_logprobs: tuple[float, ...] | None = None
    prompt_top_logprobs: tuple[TopCandidates, ...] | None = None

    @classmethod
    def from_pb(cls, msg: pb.GenerateResponse) -> "GenerationEvent":
        return cls(
            request_id=msg.request_id,
            text=msg.text,
            token_ids=tuple(msg.token_ids),
            logprobs=tuple(msg.logprobs) if msg.logprobs else None,
            top_logprobs=_candidates(msg.top_logprobs),
            finish_reason=FINISH_REASONS[msg.finish_reason],
            usage=Usage(msg.usage.prompt_tokens, msg.usage.completion_tokens) if msg.HasField("usage") else None,
            timings=Timings(msg.timings.queue_s, msg.timings.ttft_s, msg.timings.total_s)
            if msg.HasField("timings") else None,
            index=msg.index,
            prompt_logprobs=tuple(msg.prompt_logprobs) if msg.prompt_logprobs else None,
            prompt_top_logprobs=_candidates(msg.prompt_top_logprobs),
        )


def _candidates(tops: Sequence[pb.TopLogprobs]) -> tuple[TopCandidates, ...] | None:
    return tuple(tuple((c.token_id, c.logprob) for c in t.candidates) for t in tops) if tops else None


@dataclass(frozen=True, slots=True)
class GenerationResult:
    """A whole generation (one choice), gathered from its events."""

    request_id: str
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None
    usage: Usage | None
    timings: Timings | None
    logprobs: tuple[float, ...] | None
    index: int = 0
    top_logprobs: tuple[TopCandidates, ...] | None = None
    prompt_logprobs: tuple[float, ...] | None = None
    prompt_top_logprobs: tuple[TopCandidates, ...] | None = None

    @classmethod
    def gather(cls, events: list[GenerationEvent]) -> "GenerationResult":
        """One choice's events as a result; events of several choices (n > 1) are ValueError
        (``gather_choices`` splits them)."""
        indexes = sorted({e.index for e in events})
        if len(indexes) > 1:
            raise ValueError(f"events of {len(indexes)} choices (n > 1): use generate_choices / gather_choices")
        last = events[-1] if events else None
        first_prompt = next((e for e in events if e.prompt_logprobs is not None), None)
        return cls(
            request_id=last.request_id if last else "",
            text="".join(e.text for e in events),
            token_ids=tuple(t for e in events for t in e.token_ids),
            finish_reason=last.finish_reason if last else None,
            usage=last.usage if last else None,
            timings=last.timings if last else None,
            logprobs=tuple(lp for e in events for lp in (e.logprobs or ())) if any(e.logprobs for e in events)
            else None,
            index=indexes[0] if indexes else 0,
            top_logprobs=tuple(t for e in events for t in (e.top_logprobs or ()))
            if any(e.top_logprobs for e in events) else None,
            prompt_logprobs=first_prompt.prompt_logprobs if first_prompt else None,
            prompt_top_logprobs=first_prompt.prompt_top_logprobs if first_prompt else None,
        )

    @classmethod
    def gather_choices(cls, events: list[GenerationEvent]) -> list["GenerationResult"]:
        """Every choice of a request (``n``), in index order, each gathered from its own events."""
        by_index: dict[int, list[GenerationEvent]] = {}
        for e in events:
            by_index.setdefault(e.index, []).append(e)
        return [cls.gather(by_index[i]) for i in sorted(by_index)]


@dataclass(frozen=True, slots=True)
class AdapterInfo:
    adapter_id: str
    version: str
    sha256: str
    rank: int
    lora_alpha: float
    target_modules: tuple[str, ...]
    dtype: str
    size_bytes: int
    created_at: float  # unix seconds
    resident: bool = False  # in the server's device adapter pool now
    host_cached: bool = False  # in its pinned host tier
    public: bool = False  # uploaded with public=True: every tenant may generate with it and see it

    @classmethod
    def from_pb(cls, msg: pb.Adapter) -> "AdapterInfo":
        return cls(
            adapter_id=msg.adapter_id, version=msg.version, sha256=msg.sha256, rank=msg.rank,
            lora_alpha=msg.lora_alpha, target_modules=tuple(msg.target_modules), dtype=msg.dtype,
            size_bytes=msg.size_bytes, created_at=msg.created_at.ToNanoseconds() / 1e9,
            resident=msg.resident, host_cached=msg.host_cached, public=msg.public,
        )

    @property
    def visibility(self) -> str:
        """Who may use it, in the one vocabulary the CLI prints (upload and list alike): public
        (uploaded with public=True), shared (an id without 'tenant/': every tenant reads it
        whatever its flag) or private (its tenant's only)."""
        if self.public:
            return "public"
        return "private" if "/" in self.adapter_id else "shared"


@dataclass(frozen=True, slots=True)
class ServerInfo:
    model_name: str
    dtype: str
    device: str
    max_context_len: int
    max_batch_size: int
    max_new_tokens_limit: int
    default_max_new_tokens: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    max_upload_bytes: int
    max_message_bytes: int
    server_version: str
    max_lora_rank: int
    resident_adapters: int = 0
    adapter_pool_bytes: int = 0
    adapter_pool_used_bytes: int = 0

    @classmethod
    def from_pb(cls, msg: pb.ServerInfoResponse) -> "ServerInfo":
        return cls(
            model_name=msg.model_name, dtype=msg.dtype, device=msg.device, max_context_len=msg.max_context_len,
            max_batch_size=msg.max_batch_size, max_new_tokens_limit=msg.max_new_tokens_limit,
            default_max_new_tokens=msg.default_max_new_tokens, vocab_size=msg.vocab_size,
            eos_token_ids=tuple(msg.eos_token_ids), max_upload_bytes=msg.max_upload_bytes,
            max_message_bytes=msg.max_message_bytes, server_version=msg.server_version,
            max_lora_rank=msg.max_lora_rank, resident_adapters=msg.resident_adapters,
            adapter_pool_bytes=msg.adapter_pool_bytes, adapter_pool_used_bytes=msg.adapter_pool_used_bytes,
        )
