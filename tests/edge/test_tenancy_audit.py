"""Audit lines and write counters of uploads (inference_server/edge/tenancy.py)."""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry, generate_latest

from loraplex.adapter_store.errors import InvalidRequestError
from loraplex.inference_server.auth.security import Security
from loraplex.inference_server.edge.tenancy import Tenancy
from loraplex.inference_server.edge.tenant_metrics import TenantMetrics


class _Context:
    """A gRPC caller (edge/caller.py's Caller) with authentication off."""

    principal = None

    def __init__(self, cancelled: bool) -> None:
        self._cancelled = cancelled

    def cancelled(self) -> bool:
        return self._cancelled

    def peer(self) -> str:
        return "ipv4:127.0.0.1:5555"


def test_an_upload_its_caller_cancelled_is_not_counted_as_refused(caplog) -> None:
    """A cancelled (or timed-out) upload ends its stream early, which reads as 'upload
    incomplete': it is audited and counted as cancelled, not as a refused upload."""
    registry = CollectorRegistry()
    tenancy = Tenancy(Security(), TenantMetrics(registry))
    incomplete = InvalidRequestError("received 5 of 9 declared bytes (upload incomplete)")
    with caplog.at_level(logging.INFO, logger="loraplex.audit"):
        tenancy.audit(_Context(cancelled=True), "upload", "acme/a", incomplete, False)
        tenancy.audit(_Context(cancelled=False), "upload", "acme/b", incomplete, False)
    lines = [r.getMessage() for r in caplog.records if r.name == "loraplex.audit"]
    assert "adapter=acme/a outcome=cancelled" in lines[0] and "adapter=acme/b outcome=InvalidRequestError" in lines[1]
    scrape = generate_latest(registry).decode()
    assert 'outcome="cancelled"' in scrape and 'outcome="refused"' in scrape
