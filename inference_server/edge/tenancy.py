"""The servicer's tenant rules in one place: authorization (adapter_store/tenants/policy.py), quotas, audit lines.

Every method takes the handler's context (its ``principal`` was set by AuthInterceptor;
None when authentication is off). Reading another tenant's adapter depends on its ``public``
flag, so that record is looked up on every such call (a visibility change counts at once).
Audit lines go to the ``loraplex.audit`` logger as
``audit: <action> tenant=... adapter=... outcome=...`` and never carry credentials.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator, Iterable, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager

from loraplex.adapter_store.errors import (
    AdapterNotFoundError,
    ClientDisconnectedError,
    LoraplexError,
    ResourceExhaustedError,
    UnavailableError,
)
from loraplex.adapter_store.format.files import AdapterInfo
from loraplex.adapter_store.tenants import policy
from loraplex.inference_server.auth.quotas import RequestTicket
from loraplex.inference_server.auth.security import Security
from loraplex.inference_server.edge.checks import counts_prompt
from loraplex.inference_server.edge.caller import Caller, principal_of
from loraplex.inference_server.edge.tenant_metrics import ANONYMOUS, TenantMetrics
from loraplex.inference_server.engine.api import EdgeAdapters, ServingEngine
from loraplex.inference_server.engine.request import GenerationRequest

audit = logging.getLogger("loraplex.audit")


def _limit_name(exc: ResourceExhaustedError) -> str:
    text = str(exc)
    return text.split("quota ", 1)[1].split(" ", 1)[0] if "quota " in text else "other"


class Tenancy:
    """Authorization, quotas and auditing for the servicer."""

    def __init__(self, security: Security, metrics: TenantMetrics) -> None:
        self.security = security
        self.metrics = metrics
        self._quota_locks: dict[str, asyncio.Lock] = {}  # owner -> held over its uploads' check and store

    def _caller(self, context: Caller) -> str:
        principal = principal_of(context)
        return principal.tenant if principal is not None else ANONYMOUS

    # -- generate ------------------------------------------------------------------------
    def check_call(self, context: Caller, requests: Sequence[GenerationRequest], field: str = "n") -> None:
        """Refuse a call (its generations: n choices of each prompt) that the caller's quotas could
        never admit together, naming ``field`` (INVALID_ARGUMENT), before any of them is admitted."""
        budget = sum((len(r.prompt_token_ids) if counts_prompt(r) else 0) + r.stopping.max_new_tokens
                     for r in requests)
        self.security.quotas.check_call(self._caller(context), len(requests), budget, field)

    @asynccontextmanager
    async def generation(self, context: Caller, engine: ServingEngine, request: GenerationRequest
                         ) -> AsyncIterator[tuple[GenerationRequest, RequestTicket]]:
        """Admit one Generate for its lifetime: (the request tagged with the caller's tenant, its
        quota ticket), released at exit. NOT_FOUND / RESOURCE_EXHAUSTED when refused."""
        if request.adapter_id is not None:
            info = await self.check_read(context, engine, request.adapter_id)
            if info is not None:  # another tenant's, public when read: that version only
                request = dataclasses.replace(request, adapter_version=info.version)
        request, ticket = self._admit(context, request)
        try:
            yield request, ticket
        finally:
            ticket.close()

    def _admit(self, context: Caller, request: GenerationRequest) -> tuple[GenerationRequest, RequestTicket]:
        principal = principal_of(context)
        if principal is not None:
            request = dataclasses.replace(request, tenant=principal.tenant)
        tenant = self._caller(context)
        prompt = len(request.prompt_token_ids) if counts_prompt(request) else 0
        try:
            ticket = self.security.quotas.start_request(tenant, prompt, request.stopping.max_new_tokens)
        except ResourceExhaustedError as exc:
            self.metrics.quota_rejections.labels(tenant, _limit_name(exc)).inc()
            raise
        return request, ticket

    def admitted(self, ticket: RequestTicket, prompt: int) -> None:
        """The engine took ``ticket``'s request (``prompt``: the prompt tokens it accounts for):
        counted in the tenant's requests and tokens. A request the engine refuses is not."""
        self.metrics.requests.labels(ticket.tenant).inc()
        self.metrics.tokens.labels(ticket.tenant, "prompt").inc(prompt)

    def generated(self, ticket: RequestTicket, n: int) -> None:
        """``n`` tokens were streamed for ``ticket``'s request (the first event ends its queueing)."""
        ticket.started()
        if n:
            ticket.add_tokens(n)
            self.metrics.tokens.labels(ticket.tenant, "generated").inc(n)

    # -- adapters ------------------------------------------------------------------------
    async def check_read(self, context: Caller, engine: ServingEngine, adapter_id: str) -> AdapterInfo | None:
        """NOT_FOUND unless the caller may generate with / show ``adapter_id``. For another
        tenant's adapter its record is read now and returned (public or not found); else None."""
        principal = principal_of(context)
        if not policy.reads_record(principal, adapter_id):
            return None
        try:
            info = await asyncio.to_thread(self.adapters_for(context, engine).get, adapter_id)
        except UnavailableError:
            raise
        except LoraplexError:  # corrupt, incomplete, ...: not the caller's to know that it exists
            raise AdapterNotFoundError(adapter_id) from None
        policy.check_read(principal, adapter_id, info.public)
        return info

    def visible(self, context: Caller, infos: Iterable[AdapterInfo]) -> list[str]:
        """The ids of ``infos`` the caller may list: own, shared, and other tenants' public ones."""
        return policy.visible(principal_of(context), ((i.adapter_id, i.public) for i in infos))

    def adapters_for(self, context: Caller, engine: ServingEngine) -> EdgeAdapters:
        """The engine's adapters for a call made on a client's behalf (upload, delete, get, list):
        calls to an adapter store name the caller, so the store applies the tenant rules again (a
        second line of defence behind the checks here). Loading an adapter for a request stays
        the server's own call: the pool is shared by every tenant."""
        principal = principal_of(context)
        return engine.adapters if principal is None else engine.adapters.for_caller(principal)

    def check_write(self, context: Caller, adapter_id: str, action: str) -> None:
        """PERMISSION_DENIED unless the caller may ``action`` (upload/delete) ``adapter_id``."""
        policy.check_write(principal_of(context), adapter_id, action)

    @contextmanager
    def audited_write(self, context: Caller, adapter_id: str, action: str) -> Iterator[None]:
        """The caller's ``action`` (upload/delete) of ``adapter_id``, done in the block: its
        permission checked first, its outcome audited either way (a refusal included)."""
        try:
            self.check_write(context, adapter_id, action)
            yield
        except Exception as exc:
            self.audit(context, action, adapter_id, exc)
            raise
        self.audit(context, action, adapter_id, None)

    @asynccontextmanager
    async def quota_held(self, adapter_id: str) -> AsyncIterator[None]:
        """Held from an upload's quota check to its store, per owning tenant when adapter quotas
        are on: parallel uploads each passed the check before any was stored (7 adapters
        against a limit of 2). Within this process; replicas each check their own."""
        owner = policy.adapter_owner(adapter_id)
        limits = self.security.limits
        if owner is None or not (limits.max_adapters or limits.max_adapter_bytes):
            yield
            return
        async with self._quota_locks.setdefault(owner, asyncio.Lock()):
            yield

    async def check_upload_quota(self, context: Caller, engine: ServingEngine, adapter_id: str, size_bytes: int) -> None:
        """RESOURCE_EXHAUSTED if storing ``size_bytes`` more as ``adapter_id`` takes the owning
        tenant over its adapter quotas."""
        owner = policy.adapter_owner(adapter_id)
        limits = self.security.limits
        if owner is None or not (limits.max_adapters or limits.max_adapter_bytes):
            return
        infos = await asyncio.to_thread(self.adapters_for(context, engine).list)
        stored = [(i.adapter_id, i.size_bytes) for i in infos if policy.adapter_owner(i.adapter_id) == owner]
        try:
            self.security.quotas.check_upload(owner, adapter_id, size_bytes, stored)
        except ResourceExhaustedError as exc:
            self.metrics.quota_rejections.labels(owner, _limit_name(exc)).inc()
            raise

    def audit(self, context: Caller, action: str, adapter_id: str | None, error: BaseException | None,
              public: bool | None = None) -> None:
        """One audit line for an upload or delete: who, which adapter, the outcome (and for an
        upload the visibility it asked for)."""
        # the caller went away (its call cancelled, its connection closed): nothing was refused
        cancelled = isinstance(error, (asyncio.CancelledError, ClientDisconnectedError)) or (
            error is not None and _cancelled(context))
        outcome = "ok" if error is None else "cancelled" if cancelled else type(error).__name__
        tenant = self._caller(context)
        principal = principal_of(context)
        role = principal.role.value if principal is not None else "none"
        result = "ok" if error is None else "cancelled" if cancelled else "refused"
        self.metrics.adapter_writes.labels(tenant, action, result).inc()
        visibility = "" if public is None else f" visibility={_visibility(adapter_id, public)}"
        audit.info("audit: %s tenant=%s role=%s adapter=%s outcome=%s peer=%s%s", action, tenant, role,
                   adapter_id or "-", outcome, context.peer(), visibility)


def _visibility(adapter_id: str | None, public: bool) -> str:
    """Who may use an uploaded adapter, in the CLI's words (clients/types.py, AdapterInfo.visibility):
    public, shared (an id outside every tenant's namespace: every tenant reads it) or private."""
    if public:
        return "public"
    return "shared" if adapter_id and policy.adapter_owner(adapter_id) is None else "private"


def _cancelled(context: Caller) -> bool:
    """Whether the call was cancelled by its caller (a cancelled or timed-out upload ends its
    stream early, which reads like an incomplete upload)."""
    try:
        return context.cancelled()
    except RuntimeError:  # a gRPC context whose call already ended
        return False
