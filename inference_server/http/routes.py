"""The OpenAI-compatible endpoints: thin handlers that convert, call the engine, convert back.

Conversion is convert.py's and responses.py's, statuses errors.py's, streaming
streaming.py's; admission, tenants, metrics and aborts are the edge core's (edge/generation.py,
tenancy.py, state.py), which the gRPC edge uses too, so a request behaves the same on either port.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from loraplex.adapter_store.errors import AdapterNotFoundError, ClientDisconnectedError, InvalidRequestError
from loraplex.adapter_store.format.files import AdapterInfo
from loraplex.adapter_store.format.naming import validate_adapter_id
from loraplex.adapter_store.tenants import policy
from loraplex.inference_server.auth.security import Security
from loraplex.inference_server.edge.caller import principal_of
from loraplex.inference_server.edge.checks import INLINE_TOKENIZE_CHARS, RequestLimits, check_not_model_name
from loraplex.inference_server.edge.generation import generation, interleaved
from loraplex.inference_server.edge.metrics import ServerMetrics
from loraplex.inference_server.edge.state import ServingState
from loraplex.inference_server.edge.tenancy import Tenancy
from loraplex.inference_server.engine.api import ServingEngine
from loraplex.inference_server.engine.request import FinishReason
from loraplex.inference_server.http import convert, waiting
from loraplex.inference_server.http.auth import HttpCaller, authenticate
from loraplex.inference_server.http.body import read_body
from loraplex.inference_server.http.errors import error_body, error_response
from loraplex.inference_server.http.lora_loading import S3Path, lora_files
from loraplex.inference_server.http.responses import ChatFormat, CompletionFormat, TokenBytes, best_of
from loraplex.inference_server.http.router_metrics import HttpMetrics
from loraplex.inference_server.http.schemas import (ChatCompletionRequest, CompletionRequest, LoadLoraRequest,
                                                    UnloadLoraRequest)
from loraplex.inference_server.http.streaming import EventStreamResponse, sse_events

log = logging.getLogger(__name__)
IGNORED_FIELDS_HEADER = "X-Loraplex-Ignored-Fields"
Handler = Callable[[Request], Awaitable[Response]]
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class RouteConfig:
    """The HTTP edge's own limits and names (from ServerSettings)."""

    default_max_new_tokens: int = 256
    max_body_bytes: int = 8 * 1024 * 1024
    max_upload_bytes: int = 512 * 1024 * 1024  # an adapter loaded by /v1/load_lora_adapter, all files
    runtime_lora_updating: bool = False  # serve /v1/load_lora_adapter and /v1/unload_lora_adapter
    body_timeout_s: float = 30.0  # a body not whole this long after its head is 408
    max_batch_prompts: int = 64  # /v1/completions: prompts in one request's list

    def __post_init__(self) -> None:
        for name in ("default_max_new_tokens", "max_body_bytes", "max_upload_bytes", "max_batch_prompts"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.body_timeout_s <= 0:
            raise ValueError(f"body_timeout_s must be > 0, got {self.body_timeout_s}")


class OpenAIRoutes:
    """/v1/completions, /v1/chat/completions, /v1/models, /health and /metrics."""

    def __init__(self, config: RouteConfig, state: ServingState, metrics: ServerMetrics, tenancy: Tenancy,
                 security: Security) -> None:
        self._config = config
        self._state = state
        self._metrics = metrics
        self._tenancy = tenancy
        self._security = security
        self.http_metrics = HttpMetrics(metrics)
        self._started = int(time.time())

    def routes(self) -> list[Route]:
        table: list[tuple[str, Handler, str]] = [
            ("/v1/completions", self.completions, "POST"), ("/v1/chat/completions", self.chat, "POST"),
            ("/v1/models", self.models, "GET"), ("/v1/models/", self.models, "GET"),
            ("/v1/models/{model:path}", self.model, "GET"),
            ("/health", self.health, "GET"), ("/metrics", self.prometheus, "GET"),
        ]
        if self._config.runtime_lora_updating:  # off: 404, as vLLM without VLLM_ALLOW_RUNTIME_LORA_UPDATING
            table += [("/v1/load_lora_adapter", self.load_lora, "POST"),
                      ("/v1/unload_lora_adapter", self.unload_lora, "POST")]
        return [Route(path, self._counted(path, handler), methods=[method]) for path, handler, method in table]

    def _counted(self, route: str, handler: Handler) -> Handler:
        """``handler`` with its exceptions as OpenAI error responses, counted by status."""
        async def endpoint(request: Request) -> Response:
            start = time.perf_counter()
            try:
                response = await handler(request)
            except Exception as exc:  # noqa: BLE001  (every refusal becomes its status)
                response = error_response(exc)
            seconds = time.perf_counter() - start
            if isinstance(response, EventStreamResponse):  # counted when it ends: 200, or 499 if its client left
                self.http_metrics.observe_duration(route, seconds)
                response.on_end = lambda status: self._stream_ended(request, route, status)
            else:
                self.http_metrics.observe(route, response.status_code, seconds)
            return response
        return endpoint

    def _stream_ended(self, request: Request, route: str, status: int) -> None:
        """Count a stream that ended with ``status``: 200, or 499 when its client hung up first
        (its requests were aborted as it left), which is logged once, without a traceback."""
        if status == ClientDisconnectedError.status.http:
            log.info("HTTP 499: %s %s: the client disconnected mid-stream; its request was aborted",
                     request.method, request.url.path)
        self.http_metrics.count(route, status)

    def model_names(self, engine: ServingEngine) -> convert.ModelNames:
        """The base model as callers name it: the engine's model name (--served-model-name)."""
        return convert.ModelNames(served=engine.info.model_name)

    def _caller(self, request: Request) -> HttpCaller:
        return authenticate(request, self._security.tokens, self._tenancy.metrics.auth_failure)

    # -- generation ----------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        decode = functools.partial(convert.completion_request, max_prompts=self._config.max_batch_prompts)
        return await self._generate(request, CompletionRequest, decode, CompletionFormat)

    async def chat(self, request: Request) -> Response:
        return await self._generate(request, ChatCompletionRequest, convert.chat_request, ChatFormat)

    async def _generate(self, request: Request, schema: type[BaseModel], decode: Callable[..., convert.DecodedRequest],
                        fmt_type: type[CompletionFormat] | type[ChatFormat]) -> Response:
        caller = self._caller(request)  # authentication first, as on the gRPC port
        body = await read_body(request, schema, self._config.max_body_bytes, self._config.body_timeout_s)
        engine = self._state.engine_or_raise()
        limits = RequestLimits.for_engine(engine.info, self._config.default_max_new_tokens)
        args = (body, engine.tokenizer, limits, self.model_names(engine))
        heavy = isinstance(body, ChatCompletionRequest) or (
            isinstance(body, CompletionRequest) and len(str(body.prompt)) > INLINE_TOKENIZE_CHARS)
        decoded = await asyncio.to_thread(decode, *args) if heavy else decode(*args)
        headers = _ignored_header(request, decoded.ignored)
        fmt = _format(fmt_type, decoded, engine.tokenizer.token_bytes)
        ranked = len(decoded.requests) > decoded.n * decoded.prompt_count  # best_of beyond n
        self._tenancy.check_call(caller, decoded.requests, "best_of" if ranked else "n")
        streams = [generation(self._state, self._metrics, self._tenancy, caller, engine, r) for r in decoded.requests]
        try:
            first = await waiting.unless_disconnected(request, waiting.firsts(streams), streams, "its first token")
        except InvalidRequestError as exc:  # a grammar the library refused: named as the caller sent it
            raise decoded.renamed(exc) from None
        events = interleaved(streams, first)
        if decoded.stream:
            return EventStreamResponse(sse_events(events, fmt, decoded.include_usage), headers)
        answer = await waiting.unless_disconnected(request, waiting.collect(events, len(streams)), streams,
                                                   "its whole answer")
        if any(events[-1].finish_reason is FinishReason.ERROR for events in answer):
            return JSONResponse(error_body("the engine failed this request; see the server log", "server_error",
                                           None, "internal_error"), status_code=500)
        if decoded.per_prompt > decoded.n:
            answer = best_of(answer, decoded.n, decoded.per_prompt)
        return JSONResponse(fmt.response(answer), headers=headers)

    # -- runtime LoRA loading (vLLM's endpoints) --------------------------------------------
    async def load_lora(self, request: Request) -> Response:
        """Store ``lora_path``'s adapter as ``lora_name`` (validated as an upload is) and load it
        into the device pool; ``lora_path`` naming ``lora_name`` itself only loads it."""
        caller = self._caller(request)
        body = await read_body(request, LoadLoraRequest, self._config.max_body_bytes, self._config.body_timeout_s)
        name = validate_adapter_id(body.lora_name, "lora_name")
        async with self._state.work() as engine:
            with self._tenancy.audited_write(caller, name, "upload"):
                check_not_model_name(name, engine.info, "lora_name")
                adapters = self._tenancy.adapters_for(caller, engine)
                principal = principal_of(caller)
                found = await asyncio.to_thread(lora_files, body.lora_path, adapters,
                                                principal is None or principal.is_admin, self._config.max_upload_bytes,
                                                functools.partial(policy.can_read, principal))
                if isinstance(found, S3Path):
                    async with self._tenancy.quota_held(name):
                        await self._tenancy.check_upload_quota(caller, engine, name, 0)  # bytes: see HTTP.md
                        await _as_lora_path(asyncio.to_thread(adapters.import_s3, name, found.url,
                                                              self._config.max_upload_bytes))
                elif found != name:
                    files = await asyncio.to_thread(adapters.files, found) if isinstance(found, str) else found
                    async with self._tenancy.quota_held(name):
                        await self._tenancy.check_upload_quota(caller, engine, name, sum(map(len, files.values())))
                        await asyncio.to_thread(adapters.put, name, files, False)
                await asyncio.to_thread(adapters.load, name)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    async def unload_lora(self, request: Request) -> Response:
        """Stop serving ``lora_name``: deleted from the store and the listing, dropped from the
        pool (its bytes freed once the requests still running on it end)."""
        caller = self._caller(request)
        body = await read_body(request, UnloadLoraRequest, self._config.max_body_bytes, self._config.body_timeout_s)
        name = validate_adapter_id(body.lora_name, "lora_name")
        async with self._state.work() as engine:
            with self._tenancy.audited_write(caller, name, "delete"):
                try:
                    await asyncio.to_thread(self._tenancy.adapters_for(caller, engine).delete, name)
                except AdapterNotFoundError:
                    raise AdapterNotFoundError(name, "lora_name") from None
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    # -- models, health, metrics -----------------------------------------------------------
    async def _cards(self, request: Request) -> list[dict[str, Any]]:
        caller = self._caller(request)
        engine = self._state.engine_or_raise()
        infos = await asyncio.to_thread(self._tenancy.adapters_for(caller, engine).list)
        visible = set(self._tenancy.visible(caller, infos))
        base = self.model_names(engine).served
        cards = [{"id": base, "object": "model", "created": self._started, "owned_by": "loraplex",
                  "root": engine.info.model_name, "parent": None}]
        return cards + [_adapter_card(i, base) for i in sorted(infos, key=lambda i: i.adapter_id)
                        if i.adapter_id in visible]

    async def models(self, request: Request) -> Response:
        """The base model and every adapter the caller may use; uploads show at once (read now)."""
        return JSONResponse({"object": "list", "data": await self._cards(request)})

    async def model(self, request: Request) -> Response:
        """One card, by any name that works as a request's ``model``: the base model, an adapter's
        id, or ``<base>:<adapter>``."""
        wanted = request.path_params["model"]
        cards = await self._cards(request)
        try:
            adapter = self.model_names(self._state.engine_or_raise()).adapter_of(wanted)
        except InvalidRequestError:  # not a name an adapter can have
            raise AdapterNotFoundError(wanted) from None
        named = cards[0]["id"] if adapter is None else adapter
        card = next((c for c in cards if c["id"] == named), None)
        if card is None:
            raise AdapterNotFoundError(wanted)
        return JSONResponse(card)

    async def health(self, request: Request) -> Response:
        """200 only while SERVING: the model is loaded and the server is not draining."""
        serving = self._state.engine is not None and not self._state.draining
        return JSONResponse({"status": "SERVING" if serving else "NOT_SERVING"}, status_code=200 if serving else 503)

    async def prometheus(self, request: Request) -> Response:
        return Response(generate_latest(self._metrics.registry), media_type=CONTENT_TYPE_LATEST)


def _adapter_card(info: AdapterInfo, base: str) -> dict[str, Any]:
    """An adapter as vLLM lists a LoRA: its own id, ``parent`` the base model."""
    return {"id": info.adapter_id, "object": "model", "created": int(info.created_at),
            "owned_by": policy.adapter_owner(info.adapter_id) or "shared", "root": info.adapter_id, "parent": base}


def _format(fmt_type: type[CompletionFormat] | type[ChatFormat], decoded: convert.DecodedRequest,
            token_bytes: TokenBytes) -> CompletionFormat | ChatFormat:
    common = dict(model=decoded.model, token_bytes=token_bytes, logprobs=decoded.logprobs,
                  prompt_tokens=sum(map(len, decoded.prompts)), continuous_usage=decoded.continuous_usage,
                  n=decoded.n)
    if fmt_type is CompletionFormat:
        return CompletionFormat(**common, echo=decoded.echo, prompt_ids=decoded.prompts)
    return fmt_type(**common, tools=decoded.tools)


IGNORED_HEADER_BYTES = 1024  # what the header and the log line name at most (a proxy's header buffer: 4-8 KB)


def _ignored_header(request: Request, ignored: tuple[str, ...]) -> dict[str, str]:
    """Fields the body held that this edge does not know: logged (as vLLM logs them) and named
    in the response's X-Loraplex-Ignored-Fields header, up to IGNORED_HEADER_BYTES of names and
    then ``+N more`` (800 messages with a few extra keys each made a header of 33-270 KB that
    clients and proxies refuse, and the openai client retried the whole generation)."""
    if not ignored:
        return {}
    names = _capped([_header_safe(name) for name in ignored], IGNORED_HEADER_BYTES)
    log.warning("%s: these fields were present in the request but ignored: %s", request.url.path, ", ".join(names))
    return {IGNORED_FIELDS_HEADER: ",".join(names)}


def _capped(names: list[str], budget: int) -> list[str]:
    """``names`` while they fit ``budget`` characters (with commas), then ``+N more``."""
    kept, used = [], 0
    for i, name in enumerate(names):
        if used + len(name) > budget:
            return [*kept, f"+{len(names) - i} more"]
        kept.append(name)
        used += len(name) + 1
    return kept


def _header_safe(name: str) -> str:
    """A field name as header text: printable ASCII as it is, anything else (a line break, letters
    outside Latin-1) escaped the way Python writes it, so the header is always valid."""
    if name.isascii() and name.isprintable() and "," not in name:
        return name
    return name.encode("unicode_escape").decode("ascii").replace(",", "\\x2c")


async def _as_lora_path(work: Awaitable[T]) -> T:
    """``work``, a refusal of the store's Import ``source`` named as the caller sent it (``lora_path``)."""
    try:
        return await work
    except InvalidRequestError as exc:
        if exc.field != "source":
            raise
        raise InvalidRequestError(str(exc).removeprefix("source: "), "lora_path") from None
