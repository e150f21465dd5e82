"""Per-tenant Prometheus metrics (in the server's registry): requests, tokens, quota hits, auth failures."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter

ANONYMOUS = "anonymous"  # the tenant label when authentication is off


class TenantMetrics:
    """Counters labelled by tenant; tenant names come from the tokens file, so the label set is bounded."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter("loraplex_tenant_generate_requests", "Admitted Generate requests by tenant",
                                ["tenant"], registry=registry)
        self.tokens = Counter("loraplex_tenant_tokens", "Prompt and generated tokens by tenant", ["tenant", "kind"],
                              registry=registry)
        self.quota_rejections = Counter("loraplex_tenant_quota_rejections", "RESOURCE_EXHAUSTED by tenant and limit",
                                        ["tenant", "limit"], registry=registry)
        self.auth_failures = Counter("loraplex_auth_failures", "Refused credentials by reason", ["reason"],
                                     registry=registry)
        self.adapter_writes = Counter("loraplex_tenant_adapter_writes", "Uploads and deletes by tenant and outcome",
                                      ["tenant", "action", "outcome"], registry=registry)

    def auth_failure(self, reason: str) -> None:
        self.auth_failures.labels(reason).inc()
