"""What a caller hands the engine, and what the engine streams back."""

from __future__ import annotations

import enum
import json
import math
from dataclasses import dataclass, field
from typing import Literal

from loraplex.adapter_store.errors import InvalidRequestError


MAX_STOP_CHARS = 256  # per stop string: matching runs on the engine's step thread, for every token
GREEDY_BELOW = 1e-5  # temperatures under it choose greedily (SamplingParams.greedy)
# repetition penalties a float32 logit can be divided or multiplied by without overflowing
PENALTY_RANGE = (1e-6, 1e6)
ADDITIVE_PENALTY_RANGE = (-2.0, 2.0)  # presence and frequency penalties, as OpenAI bounds them
LOGIT_BIAS_RANGE = (-100.0, 100.0)  # as OpenAI bounds it
MAX_LOGIT_BIAS = 1024  # entries per request (each is host work per step)
MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How the next token is chosen. temperature 0 means greedy, and so does any temperature
    under GREEDY_BELOW (sampling there is greedy in all but exact ties, and float32 logits
    divided by it would overflow)."""

    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    seed: int | None = None
    repetition_penalty: float = 1.0  # divides (or multiplies) the logits of every token seen, prompt included
    presence_penalty: float = 0.0  # subtracted from the logit of every token generated so far
    frequency_penalty: float = 0.0  # times each token's count in the output so far, subtracted
    min_p: float = 0.0  # drop tokens less likely than min_p times the most likely one; 0 = off
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit), before everything else
    logprobs: bool = False  # return the chosen token's log-probability
    top_logprobs: int = 0  # and this many alternatives
    prompt_logprobs: int | None = None  # the prompt tokens' log-probabilities, with this many alternatives

    def __post_init__(self) -> None:
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidRequestError(f"must be a finite number >= 0, got {self.temperature}", "temperature")
        if self.top_k < 0:
            raise InvalidRequestError(f"must be >= 0 (0 = off), got {self.top_k}", "top_k")
        if not (0.0 < self.top_p <= 1.0):
            raise InvalidRequestError(f"must be in (0, 1], got {self.top_p}", "top_p")
        lo, hi = PENALTY_RANGE
        if not (math.isfinite(self.repetition_penalty) and lo <= self.repetition_penalty <= hi):
            raise InvalidRequestError(f"must be in [{lo:g}, {hi:g}] (1 = off), got {self.repetition_penalty}",
                                      "repetition_penalty")
        lo, hi = ADDITIVE_PENALTY_RANGE
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (math.isfinite(value) and lo <= value <= hi):
                raise InvalidRequestError(f"must be in [{lo:g}, {hi:g}] (0 = off), got {value}", name)
        if not (math.isfinite(self.min_p) and 0.0 <= self.min_p <= 1.0):
            raise InvalidRequestError(f"must be in [0, 1] (0 = off), got {self.min_p}", "min_p")
        self._check_logit_bias()
        if not (0 <= self.top_logprobs <= MAX_TOP_LOGPROBS):
            raise InvalidRequestError(f"must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}", "top_logprobs")
        if self.prompt_logprobs is not None and not (0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS):
            raise InvalidRequestError(f"must be in [0, {MAX_TOP_LOGPROBS}], got {self.prompt_logprobs}",
                                      "prompt_logprobs")
        if self.seed is not None and not (0 <= self.seed < 2**63):
            raise InvalidRequestError(f"must be in [0, 2^63), got {self.seed}", "seed")

    def _check_logit_bias(self) -> None:
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise InvalidRequestError(f"at most {MAX_LOGIT_BIAS} entries, got {len(self.logit_bias)}", "logit_bias")
        lo, hi = LOGIT_BIAS_RANGE
        for token, bias in self.logit_bias:
            if token < 0:
                raise InvalidRequestError(f"token ids must be >= 0, got {token}", "logit_bias")
            if not (math.isfinite(bias) and lo <= bias <= hi):
                raise InvalidRequestError(f"biases must be in [{lo:g}, {hi:g}], got {bias} for token {token}",
                                          "logit_bias")
        if len({t for t, _ in self.logit_bias}) != len(self.logit_bias):
            raise InvalidRequestError("a token id appears twice", "logit_bias")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def counts_output(self) -> bool:
        """Whether the output tokens' counts matter (presence or frequency penalty)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


@dataclass(frozen=True, slots=True)
class StoppingCriteria:
    """When generation ends (besides the context window)."""

    max_new_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0  # before this many tokens, EOS and stop_token_ids are never chosen, stop strings never match

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise InvalidRequestError(f"must be >= 1, got {self.max_new_tokens}", "max_new_tokens")
        if not (0 <= self.min_tokens <= self.max_new_tokens):
            raise InvalidRequestError(f"must be in [0, max_new_tokens={self.max_new_tokens}], got {self.min_tokens}",
                                      "min_tokens")
        if any(not s for s in self.stop_strings):
            raise InvalidRequestError("stop strings must be non-empty", "stop_strings")
        if len(self.stop_strings) > 16:
            raise InvalidRequestError("at most 16 stop strings", "stop_strings")
        if any(len(s) > MAX_STOP_CHARS for s in self.stop_strings):
            raise InvalidRequestError(f"a stop string is at most {MAX_STOP_CHARS} characters", "stop_strings")
        if any(t < 0 for t in self.stop_token_ids):
            raise InvalidRequestError("token ids must be >= 0", "stop_token_ids")


MAX_SCHEMA_CHARS = 64 * 1024  # a JSON schema's text (compiled once per distinct schema, on the host)
GRAMMAR_KINDS = ("json_object", "json_schema", "tagged_json")


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    """What a constrained request's output must be; the sampler masks every token it may not
    choose (engine/grammar.py compiles it, once per distinct spec).

    ``json_object``: one JSON object. ``json_schema``: one JSON document valid against ``schema``
    (JSON text). ``tagged_json``: ``begin``, JSON valid against ``schema``, ``end`` (a tool call):
    the whole output, or with ``free_text`` anywhere in free text, any number of times (the model
    may also answer without it). JSON is written on one line with ", " and ": " separators.
    Errors name ``response_format`` (the edges rename it to their own parameter)."""

    kind: Literal["json_object", "json_schema", "tagged_json"]
    schema: str = ""
    begin: str = ""
    end: str = ""
    free_text: bool = False

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise InvalidRequestError(f"kind must be one of {', '.join(GRAMMAR_KINDS)}, got {self.kind!r}",
                                      "response_format")
        if self.kind == "json_object":
            if self.schema or self.begin or self.end:
                raise InvalidRequestError("json_object takes no schema or tags", "response_format")
            return
        if len(self.schema) > MAX_SCHEMA_CHARS:
            raise InvalidRequestError(f"the schema is {len(self.schema)} characters; at most {MAX_SCHEMA_CHARS}",
                                      "response_format.schema")
        try:
            parsed = json.loads(self.schema)
        except ValueError as exc:
            raise InvalidRequestError(f"the schema is not JSON: {exc}", "response_format.schema") from None
        if not isinstance(parsed, dict):
            raise InvalidRequestError("the schema must be a JSON object", "response_format.schema")
        if (self.kind == "tagged_json") != bool(self.begin and self.end):
            raise InvalidRequestError("begin and end tags are tagged_json's, and it needs both", "response_format")


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """One generation: prompt token ids, the adapter (None = base model), parameters."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    adapter_id: str | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stopping: StoppingCriteria = field(default_factory=StoppingCriteria)
    tenant: str | None = None
    skip_special_tokens: bool = True  # special tokens (EOS, chat markers) add no text
    # requests of one group share a prompt (``n`` choices of one prompt): the engine admits the
    # others once one has computed it, so they take its KV blocks from the prefix cache
    prompt_group: str | None = None
    grammar: GrammarSpec | None = None  # structured output: every token masked to it
    # another tenant's public adapter: the version whose record admitted the request. The engine runs
    # that version or none (NOT_FOUND): a request that waited for pool space never runs a version its
    # owner made private meanwhile. None: whatever version is current (the caller's own or shared).
    adapter_version: str | None = None

    def __post_init__(self) -> None:
        if self.grammar is not None:
            if self.stopping.ignore_eos:
                raise InvalidRequestError("cannot be set with a response format (the grammar ends the output)",
                                          "ignore_eos")
            if self.stopping.min_tokens:
                raise InvalidRequestError("cannot be set with a response format (the grammar ends the output)",
                                          "min_tokens")
        if not self.request_id:
            raise InvalidRequestError("must be non-empty", "request_id")
        if not self.prompt_token_ids:
            raise InvalidRequestError("prompt is empty", "prompt")
        if any(t < 0 for t in self.prompt_token_ids):
            raise InvalidRequestError("token ids must be >= 0", "prompt_token_ids")


class FinishReason(str, enum.Enum):
    LENGTH = "length"  # max_new_tokens or the context window
    STOP = "stop"  # EOS, a stop token or a stop string
    ABORT = "abort"  # cancelled by the caller or the server
    ERROR = "error"


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True, slots=True)
class Timings:
    queue_s: float  # submit -> first scheduled
    ttft_s: float  # submit -> first token
    total_s: float  # submit -> finish


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """New tokens of a request and their text (never a split UTF-8 char): one step's, or
    several steps' merged when the reader fell behind (``engine.token_stream``).

    The last event of a stream has ``finish_reason`` set, with usage and timings.
    """

    request_id: str
    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[float, ...] | None = None
    top_logprobs: tuple[dict[int, float], ...] | None = None
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    timings: Timings | None = None
    # on the first event of a request that asked for them: per prompt token, its log-probability
    # given the tokens before it (None for the first) and its top alternatives
    prompt_logprobs: tuple[float | None, ...] | None = None
    prompt_top_logprobs: tuple[dict[int, float] | None, ...] | None = None
