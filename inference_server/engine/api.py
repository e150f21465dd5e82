"""What an edge (the gRPC servicer, the HTTP front) needs of an engine, as Protocols.

The edges are written against ``ServingEngine`` alone: they never probe an engine for what it
can do. ``AsyncEngine`` is the implementation; the edge tests run on a small fake that
implements the same Protocols, so a change here shows in both.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any, Protocol

from loraplex.adapter_store.assembly import DeclaredFile
from loraplex.adapter_store.format.files import AdapterInfo, OpenPut
from loraplex.adapter_store.tenants.principal import Principal
from loraplex.inference_server.engine.info import EngineInfo, EngineStats
from loraplex.inference_server.engine.request import GenerationRequest, TokenEvent
from loraplex.inference_server.lora.pool.pool_stats import PoolStats
from loraplex.inference_server.model.tokenizer import ChatOptions


class PromptTokenizer(Protocol):
    """The part of the engine's tokenizer the edges use."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    @property
    def chat_template(self) -> str:
        """The chat template's Jinja text ("" without one): the edge reads its tool-call format."""
        ...

    def apply_chat_template(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                            options: ChatOptions = ChatOptions()) -> list[int]:
        """transformers' ``apply_chat_template(messages, tools=tools, add_generation_prompt=True)``
        (its other arguments from ``options``); ValueError when the template refuses the messages."""
        ...

    def decode(self, ids: list[int]) -> str:
        """Token ids -> text (the HTTP edge's echo of prompts given as token ids)."""
        ...

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token adds to a text, a part of a multi-byte character included (the HTTP
        edge names each token of a logprobs answer by them)."""
        ...


class EdgeAdapters(Protocol):
    """The adapter management surface: list / get / upload / delete, and where each is held."""

    def get(self, adapter_id: str) -> AdapterInfo: ...

    def list(self) -> list[AdapterInfo]: ...

    def put(self, adapter_id: str, files: Mapping[str, bytes], public: bool = False) -> AdapterInfo: ...

    def delete(self, adapter_id: str) -> None: ...

    def open_put(self, adapter_id: str, declared: Sequence[DeclaredFile], public: bool = False,
                 timeout_s: float | None = None) -> OpenPut | None:
        """An upload streamed into the adapter store as its bytes arrive (the store checks it,
        against this server's base model too, within the uploader's ``timeout_s``); None where
        the adapters take it whole (``put``)."""
        ...

    def import_s3(self, adapter_id: str, source: str, max_bytes: int) -> AdapterInfo:
        """Store the adapter under ``source`` (``s3://bucket/prefix``) as ``adapter_id``, read by
        the adapter store with its own S3 client (blocking); refused without a store."""
        ...

    def for_caller(self, caller: Principal) -> EdgeAdapters:
        """These adapters with every call made on ``caller``'s behalf (a store applies the tenant
        rules to it again); the same object where the source has no notion of a caller."""
        ...

    def residency(self) -> Mapping[str, tuple[bool, bool]]:
        """{adapter id: (in the device pool, in the host tier)} for every held adapter."""
        ...

    def files(self, adapter_id: str) -> Mapping[str, bytes]:
        """A stored adapter's files, as uploaded (what a copy under another id stores)."""
        ...

    def load(self, adapter_id: str) -> None:
        """Bring a stored adapter into the device pool now (blocking: call it in a thread)."""
        ...


class ServingEngine(Protocol):
    """An engine as the edges use it: fixed facts, a tokenizer, adapters, streams, counters."""

    info: EngineInfo
    tokenizer: PromptTokenizer
    adapters: EdgeAdapters

    async def start(self) -> None: ...

    async def shutdown(self) -> None: ...

    def generate(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        """Stream the request's token events; refusals raise before the first event."""
        ...

    def abort(self, request_id: str) -> None: ...

    def stats(self) -> EngineStats: ...

    def pool_stats(self) -> PoolStats | None:
        """The adapter pool's tiers and counters; None for an engine without a pool."""
        ...
