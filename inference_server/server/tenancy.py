"""The servicer's tenant rules in one place: authorization (auth/policy.py), quotas, audit lines.

Every method takes the handler's context (its ``principal`` was set by AuthInterceptor;
None when authentication is off). Audit lines go to the ``loraplex.audit`` logger as
``audit: <action> tenant=... adapter=... outcome=...`` and never carry credentials.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from typing import Any

from inference_server.auth import policy
from inference_server.auth.quotas import RequestTicket
from inference_server.auth.security import Security
from inference_server.engine.request import GenerationRequest
from inference_server.errors import ResourceExhaustedError
from inference_server.server.auth_interceptor import principal_of
from inference_server.server.tenant_metrics import ANONYMOUS, TenantMetrics

audit = logging.getLogger("loraplex.audit")


def _limit_name(exc: ResourceExhaustedError) -> str:
    text = str(exc)
    return text.split("quota ", 1)[1].split(" ", 1)[0] if "quota " in text else "other"


class Tenancy:
    """Authorization, quotas and auditing for the servicer."""

    def __init__(self, security: Security, metrics: TenantMetrics) -> None:
        self.security = security
        self.metrics = metrics

    def _caller(self, context: Any) -> str:
        principal = principal_of(context)
        return principal.tenant if principal is not None else ANONYMOUS

    # -- generate ------------------------------------------------------------------------
    @asynccontextmanager
    async def generation(self, context: Any, request: GenerationRequest
                         ) -> AsyncIterator[tuple[GenerationRequest, RequestTicket]]:
        """Admit one Generate for its lifetime: (the request tagged with the caller's tenant, its
        quota ticket), released at exit. NOT_FOUND / RESOURCE_EXHAUSTED when refused."""
        request, ticket = self._admit(context, request)
        try:
            yield request, ticket
        finally:
            ticket.close()

    def _admit(self, context: Any, request: GenerationRequest) -> tuple[GenerationRequest, RequestTicket]:
        principal = principal_of(context)
        if request.adapter_id is not None:
            policy.check_read(principal, request.adapter_id)
        if principal is not None:
            request = dataclasses.replace(request, tenant=principal.tenant)
        tenant = self._caller(context)
        try:
            ticket = self.security.quotas.start_request(tenant, len(request.prompt_token_ids))
        except ResourceExhaustedError as exc:
            self.metrics.quota_rejections.labels(tenant, _limit_name(exc)).inc()
            raise
        self.metrics.requests.labels(tenant).inc()
        self.metrics.tokens.labels(tenant, "prompt").inc(len(request.prompt_token_ids))
        return request, ticket

    def generated(self, ticket: RequestTicket, n: int) -> None:
        """``n`` tokens were streamed for ``ticket``'s request (the first event ends its queueing)."""
        ticket.started()
        if n:
            ticket.add_tokens(n)
            self.metrics.tokens.labels(ticket.tenant, "generated").inc(n)

    # -- adapters ------------------------------------------------------------------------
    def check_read(self, context: Any, adapter_id: str) -> None:
        policy.check_read(principal_of(context), adapter_id)

    def visible(self, context: Any, adapter_ids: Iterable[str]) -> list[str]:
        return policy.visible(principal_of(context), adapter_ids)

    def check_write(self, context: Any, adapter_id: str, action: str) -> None:
        """PERMISSION_DENIED unless the caller may ``action`` (upload/delete) ``adapter_id``."""
        policy.check_write(principal_of(context), adapter_id, action)

    async def check_upload_quota(self, context: Any, engine: Any, adapter_id: str, files: dict[str, bytes]) -> None:
        """RESOURCE_EXHAUSTED if storing ``files`` takes the owning tenant over its adapter quotas."""
        owner = policy.adapter_owner(adapter_id)
        limits = self.security.limits
        if owner is None or not (limits.max_adapters or limits.max_adapter_bytes):
            return
        infos = await asyncio.to_thread(engine.adapters.list)
        stored = [(i.adapter_id, i.size_bytes) for i in infos if policy.adapter_owner(i.adapter_id) == owner]
        try:
            self.security.quotas.check_upload(owner, adapter_id, sum(len(b) for b in files.values()), stored)
        except ResourceExhaustedError as exc:
            self.metrics.quota_rejections.labels(owner, _limit_name(exc)).inc()
            raise

    def audit(self, context: Any, action: str, adapter_id: str | None, error: BaseException | None) -> None:
        """One audit line for an upload or delete: who, which adapter, and the outcome."""
        outcome = "ok" if error is None else type(error).__name__
        tenant = self._caller(context)
        principal = principal_of(context)
        role = principal.role.value if principal is not None else "none"
        self.metrics.adapter_writes.labels(tenant, action, "ok" if error is None else "refused").inc()
        audit.info("audit: %s tenant=%s role=%s adapter=%s outcome=%s peer=%s", action, tenant, role,
                   adapter_id or "-", outcome, context.peer())
