"""Per-tenant quotas (plain Python): open requests, queued requests, tokens per minute,
stored adapter bytes and count. A hit raises ResourceExhaustedError naming the limit.

"Concurrent" counts a tenant's open Generate streams; "queued" counts those of them that
have not produced their first token yet; tokens per minute counts prompt and generated
tokens over a sliding 60-second window: a request is admitted with its whole budget (prompt +
max_new_tokens) reserved, and what it did not generate is given back when it ends, so requests
started together cannot overrun the limit. 0 means unlimited.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from loraplex.adapter_store.errors import InvalidRequestError, ResourceExhaustedError

WINDOW_S = 60.0


@dataclass(frozen=True, slots=True)
class TenantLimits:
    """Limits applied to every tenant separately (0 = unlimited)."""

    max_concurrent_requests: int = 0
    max_queued_requests: int = 0
    tokens_per_minute: int = 0
    max_adapter_bytes: int = 0
    max_adapters: int = 0

    def __post_init__(self) -> None:
        for name in self.__slots__:
            if getattr(self, name) < 0:
                raise ValueError(f"tenant limit {name} must be >= 0 (0 = unlimited), got {getattr(self, name)}")


@dataclass(slots=True)
class _Usage:
    open: int = 0
    queued: int = 0
    tokens: deque[list] = field(default_factory=deque)  # [time, tokens]: a reservation shrinks in place
    token_sum: int = 0


def _exhausted(tenant: str, limit: str, value: int, unit: str = "", then: str = "retry later"
               ) -> ResourceExhaustedError:
    return ResourceExhaustedError(f"tenant {tenant!r}: quota {limit} reached (limit {value}{unit}); {then}")


class QuotaTracker:
    """Counts each tenant's usage against one TenantLimits."""

    def __init__(self, limits: TenantLimits, clock: Callable[[], float] = time.monotonic) -> None:
        self.limits = limits
        self._clock = clock
        self._usage: dict[str, _Usage] = {}

    def _get(self, tenant: str) -> _Usage:
        usage = self._usage.get(tenant)
        if usage is None:
            usage = self._usage[tenant] = _Usage()
        return usage

    def tokens_last_minute(self, tenant: str) -> int:
        """Prompt + generated tokens of ``tenant`` in the last 60 seconds."""
        usage = self._get(tenant)
        horizon = self._clock() - WINDOW_S
        while usage.tokens and usage.tokens[0][0] <= horizon:
            usage.token_sum -= usage.tokens.popleft()[1]
        return usage.token_sum

    def start_request(self, tenant: str, prompt_tokens: int, max_new_tokens: int = 0) -> "RequestTicket":
        """Admit one Generate request of ``tenant`` (its prompt and up to ``max_new_tokens``
        reserved against the tokens per minute) or raise ResourceExhaustedError naming the limit."""
        lim, usage = self.limits, self._get(tenant)
        if lim.max_concurrent_requests and usage.open >= lim.max_concurrent_requests:
            raise _exhausted(tenant, "max_concurrent_requests", lim.max_concurrent_requests)
        if lim.max_queued_requests and usage.queued >= lim.max_queued_requests:
            raise _exhausted(tenant, "max_queued_requests", lim.max_queued_requests)
        budget = prompt_tokens + max_new_tokens
        if lim.tokens_per_minute and budget > lim.tokens_per_minute:  # never admitted, whatever the wait
            raise _exhausted(tenant, "tokens_per_minute", lim.tokens_per_minute, " tokens/min",
                             f"this request alone may use {budget} tokens ({prompt_tokens} prompt + "
                             f"{max_new_tokens} max_new_tokens): shorten it or lower max_new_tokens")
        if lim.tokens_per_minute and self.tokens_last_minute(tenant) + budget > lim.tokens_per_minute:
            raise _exhausted(tenant, "tokens_per_minute", lim.tokens_per_minute, " tokens/min")
        usage.open += 1
        usage.queued += 1
        entry = [self._clock(), budget]
        usage.tokens.append(entry)
        usage.token_sum += budget
        return RequestTicket(self, tenant, entry, max_new_tokens)

    def check_call(self, tenant: str, requests: int, budget: int, field: str) -> None:
        """Refuse a call of ``requests`` generations (its n choices, of each prompt) that may use
        ``budget`` tokens in all, when no wait could ever admit them together: INVALID_ARGUMENT
        naming ``field``, not a "retry later" that clients retry for nothing."""
        lim = self.limits
        for limit, value in (("max_concurrent_requests", lim.max_concurrent_requests),
                             ("max_queued_requests", lim.max_queued_requests)):
            if value and requests > value:
                raise InvalidRequestError(
                    f"{requests} generations in one call, more than tenant {tenant!r}'s quota {limit} ({value}) lets "
                    "run at once: ask for fewer", field)
        if lim.tokens_per_minute and budget > lim.tokens_per_minute:
            raise InvalidRequestError(
                f"the call may use {budget} tokens (prompts and max_new_tokens of its {requests} generations), more than "
                f"tenant {tenant!r}'s quota tokens_per_minute ({lim.tokens_per_minute}): lower n or max_new_tokens",
                field if requests > 1 else "max_new_tokens")

    def _give_back(self, tenant: str, entry: list, n: int) -> None:
        """Tokens a request reserved and did not use (its entry shrinks, if still in the window)."""
        usage = self._get(tenant)
        if n > 0 and any(e is entry for e in usage.tokens):  # (not yet out of the window)
            entry[1] -= n
            usage.token_sum -= n

    def usage(self, tenant: str) -> tuple[int, int]:
        """(open, queued) requests of ``tenant`` now."""
        usage = self._get(tenant)
        return usage.open, usage.queued

    def check_upload(self, tenant: str, adapter_id: str, new_bytes: int,
                     stored: Iterable[tuple[str, int]]) -> None:
        """Raise if storing ``adapter_id`` (``new_bytes``) would take ``tenant`` over its adapter
        quotas; ``stored`` is (id, bytes) of the tenant's adapters now (a re-upload replaces one)."""
        others = [(a, b) for a, b in stored if a != adapter_id]
        lim = self.limits
        if lim.max_adapters and len(others) + 1 > lim.max_adapters:
            raise _exhausted(tenant, "max_adapters", lim.max_adapters, " adapters",
                             "delete one of the tenant's adapters first")
        total = sum(b for _, b in others) + new_bytes
        if lim.max_adapter_bytes and total > lim.max_adapter_bytes:
            raise _exhausted(tenant, "max_adapter_bytes", lim.max_adapter_bytes, " bytes",
                             f"this upload would make {total}: delete adapters or upload a smaller one")


class RequestTicket:
    """One admitted request's hold on its tenant's counters; ``close`` exactly once."""

    __slots__ = ("_tracker", "tenant", "_queued", "_open", "_entry", "_unused")

    def __init__(self, tracker: QuotaTracker, tenant: str, entry: list, reserved_new: int) -> None:
        self._tracker = tracker
        self.tenant = tenant
        self._queued = True
        self._open = True
        self._entry = entry  # the reservation in the tenant's window
        self._unused = reserved_new  # reserved generated tokens not streamed yet

    def add_tokens(self, n: int) -> None:
        """``n`` tokens were generated: they were reserved at admission (a stream that outgrew its
        reservation, which the engine's max_new_tokens prevents, counts the excess anew)."""
        if n <= 0:
            return
        over = max(0, n - self._unused)
        self._unused -= n - over
        if over:
            usage = self._tracker._get(self.tenant)
            usage.tokens.append([self._tracker._clock(), over])
            usage.token_sum += over

    def started(self) -> None:
        """The request produced its first token: it no longer counts as queued."""
        if self._queued:
            self._queued = False
            self._tracker._get(self.tenant).queued -= 1

    def close(self) -> None:
        self.started()
        if self._open:
            self._open = False
            self._tracker._get(self.tenant).open -= 1
            self._tracker._give_back(self.tenant, self._entry, self._unused)
            self._unused = 0
