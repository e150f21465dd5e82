"""A request's life inside the engine (plain Python, no torch tensors)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from loraplex.inference_server.engine.detokenizer import IncrementalDetokenizer, StopStringMatcher
from loraplex.inference_server.engine.request import FinishReason, GenerationRequest
from loraplex.inference_server.lora.resident import ResidentAdapter


# A token id not known on the host yet: the step that samples it is still running on the
# device (the engine launches the next step first; see LLMEngine.step). Only ever last in
# token_ids (at most two: the running step's and the one launched after it).
PLACEHOLDER = -1


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False, slots=True)
class Sequence:
    request: GenerationRequest
    adapter: ResidentAdapter | None  # its place in the pool; the engine releases it when the sequence ends
    detokenizer: IncrementalDetokenizer
    stops: StopStringMatcher
    generator: Any = None  # torch.Generator for seeded sampling, else None
    token_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose keys/values are in the cache
    block_table: list[int] = field(default_factory=list)
    prefix_digests: list[bytes] | None = None  # the prompt's full blocks, named (engine/prefix_cache.py)
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    arrival: float = field(default_factory=time.monotonic)
    first_scheduled: float | None = None
    first_token: float | None = None
    stop_ids: tuple[int, ...] = ()  # the tokens that end it (EOS unless ignored, stop ids): banned before min_tokens
    # per prompt token, (its log-probability, its alternatives) once computed (prompt_logprobs asked)
    prompt_logprobs: list[tuple[float, dict[int, float] | None] | None] | None = None
    prompt_logprobs_sent: bool = False
    grammar: Any = None  # GrammarState of a constrained request (engine/grammar.py), told each token

    @classmethod
    def create(cls, request: GenerationRequest, adapter: ResidentAdapter | None, detok: IncrementalDetokenizer,
               generator: Any) -> "Sequence":
        seq = cls(request, adapter, detok, StopStringMatcher(request.stopping.stop_strings), generator)
        seq.token_ids = list(request.prompt_token_ids)
        if request.sampling.prompt_logprobs is not None:
            seq.prompt_logprobs = [None] * len(request.prompt_token_ids)
        return seq

    @property
    def reuses_prefix(self) -> bool:
        """Whether its prompt may start from cached KV blocks (not when the prompt's own
        log-probabilities were asked for: every prompt row must be computed)."""
        return self.request.sampling.prompt_logprobs is None

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def num_prompt(self) -> int:
        return len(self.request.prompt_token_ids)

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.num_prompt

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt :]

    @property
    def num_pending(self) -> int:
        """Tokens not yet in the cache (the prompt, or after a preemption, everything)."""
        return len(self.token_ids) - self.num_computed

    def drop_placeholders(self) -> None:
        while self.token_ids and self.token_ids[-1] == PLACEHOLDER:
            self.token_ids.pop()

    @property
    def adapter_key(self) -> str:
        return self.request.adapter_id or ""

    @property
    def kv_key(self) -> str:
        """What the KV of this sequence's tokens depends on besides the tokens: the adapter's id
        and content version (its q/k/v deltas), or nothing for the base model; and who may reuse
        it: the request's tenant, where there is one, so a prompt's cached blocks never serve
        another tenant (how fast a prompt starts would tell that tenant it was sent)."""
        key = "" if self.adapter is None else f"{self.adapter.adapter_id}@{self.adapter.version}"
        return key if self.request.tenant is None else f"{key}#{self.request.tenant}"
