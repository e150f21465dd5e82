"""Tokens (hashed, reloaded), the authorization policy and per-tenant quotas, as plain Python."""

from __future__ import annotations

import json
import logging
import os

import pytest

from loraplex.adapter_store.errors import AdapterNotFoundError, PermissionDeniedError, ResourceExhaustedError
from loraplex.adapter_store.tenants import policy
from loraplex.adapter_store.tenants.principal import Principal, Role
from loraplex.inference_server.auth.quotas import QuotaTracker, TenantLimits
from loraplex.inference_server.auth.tokens import AuthError, TokenFile, hash_token, parse_tokens_file

TOKEN_A = "tok-a-0123456789abcdef"
TOKEN_ADMIN = "tok-admin-0123456789abcdef"


def write_tokens(path, entries: list[tuple[str, str, str]]) -> None:
    body = {"tokens": [{"sha256": hash_token(t), "tenant": ten, "role": role} for t, ten, role in entries]}
    path.write_text(json.dumps(body))


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_file_holds_hashes_only_and_tokens_map_to_principals(tmp_path) -> None:
    path = tmp_path / "tokens.json"
    write_tokens(path, [(TOKEN_A, "a", "tenant"), (TOKEN_ADMIN, "ops", "admin")])
    assert TOKEN_A not in path.read_text()
    tokens = TokenFile(str(path))
    assert tokens.authenticate(f"Bearer {TOKEN_A}") == Principal("a", Role.TENANT)
    assert tokens.authenticate(f"bearer {TOKEN_ADMIN}").is_admin


@pytest.mark.parametrize("value", [
    None, "", "Bearer", "Bearer ", "Basic " + TOKEN_A, TOKEN_A, f"Bearer {TOKEN_A} ", f"Bearer  {TOKEN_A}",
    f"Bearer {TOKEN_A}\n", f"Bearer {TOKEN_A[:-1]}é", "Bearer " + "x" * 100_000, "Bearer short",
    f"Bearer {TOKEN_A}x", f"Bearer {hash_token(TOKEN_A)}",
])
def test_bad_credentials_of_every_shape_are_refused_without_echoing_them(tmp_path, value) -> None:
    path = tmp_path / "tokens.json"
    write_tokens(path, [(TOKEN_A, "a", "tenant")])
    with pytest.raises(AuthError) as info:
        TokenFile(str(path)).authenticate(value)
    assert TOKEN_A not in str(info.value) and "x" * 50 not in str(info.value)


def test_reload_on_change_without_restart_and_bad_file_keeps_old_tokens(tmp_path) -> None:
    path, clock = tmp_path / "tokens.json", Clock()
    write_tokens(path, [(TOKEN_A, "a", "tenant")])
    tokens = TokenFile(str(path), check_interval_s=1.0, clock=clock)
    new = "tok-new-0123456789abcdef"
    write_tokens(path, [(new, "b", "tenant")])
    os.utime(path, ns=(1, 1))  # a change the stat signature sees even within one mtime tick
    clock.t += 2
    assert tokens.authenticate(f"Bearer {new}").tenant == "b"
    with pytest.raises(AuthError):
        tokens.authenticate(f"Bearer {TOKEN_A}")  # revoked
    path.write_text("{not json")
    clock.t += 2
    assert tokens.authenticate(f"Bearer {new}").tenant == "b" and tokens.reloads == 1


@pytest.mark.parametrize("text, problem", [
    ("[]", "expected an object"),
    ('{"tokens": [{"sha256": "abc", "tenant": "a"}]}', "64 hex"),
    ('{"tokens": [{"sha256": "' + "0" * 64 + '", "tenant": "a", "role": "root"}]}', "role"),
    ('{"tokens": [{"sha256": "' + "0" * 64 + '", "tenant": "a/b"}]}', "tenant"),
    # one token listed for two tenants acted as the last of them (acme's token read beta's adapters)
    ('{"tokens": [{"sha256": "' + "a" * 64 + '", "tenant": "acme"}, {"sha256": "' + "A" * 64 + '", "tenant": "beta"}]}',
     r"tokens\[1\]: the same sha256 as tokens\[0\]"),
])
def test_bad_tokens_file_names_the_problem(text, problem) -> None:
    with pytest.raises(ValueError, match=problem):
        parse_tokens_file(text)


def test_policy_namespaces() -> None:
    a, b, admin = Principal("a", Role.TENANT), Principal("b", Role.TENANT), Principal("ops", Role.ADMIN)
    policy.check_read(a, "a/x")
    policy.check_read(a, "shared")  # the shared namespace is public
    with pytest.raises(AdapterNotFoundError, match="'b/x' not found"):
        policy.check_read(a, "b/x")
    policy.check_write(a, "a/x", "upload")
    for target in ("b/x", "shared"):
        with pytest.raises(PermissionDeniedError, match="may not delete"):
            policy.check_write(a, target, "delete")
    policy.check_read(admin, "b/x")
    policy.check_write(admin, "b/x", "delete")
    policy.check_write(None, "b/x", "delete")  # auth off
    assert policy.visible(a, [("a/x", False), ("b/x", False), ("shared", False)]) == ["a/x", "shared"]
    assert policy.visible(admin, [("a/x", False), ("b/x", False)]) == ["a/x", "b/x"]
    assert policy.quota_tenant(admin, "b/x") == "b" and policy.quota_tenant(b, None) == "b"


def test_policy_public_adapters_are_readable_by_every_tenant_and_written_by_their_owner() -> None:
    a, b, admin = Principal("a", Role.TENANT), Principal("b", Role.TENANT), Principal("ops", Role.ADMIN)
    policy.check_read(b, "a/x", public=True)
    with pytest.raises(AdapterNotFoundError, match="'a/x' not found"):
        policy.check_read(b, "a/x", public=False)
    for action in ("upload", "delete"):  # public is read-only for everyone but the owner and admins
        with pytest.raises(PermissionDeniedError, match=f"may not {action} adapter 'a/x'.*read-only"):
            policy.check_write(b, "a/x", action)
        policy.check_write(a, "a/x", action)
        policy.check_write(admin, "a/x", action)
    # the record is looked up only where its flag decides: another tenant's adapter, read by a tenant
    assert policy.reads_record(b, "a/x")
    assert not any(policy.reads_record(p, i) for p, i in ((a, "a/x"), (b, "shared"), (admin, "a/x"), (None, "a/x")))
    listed = [("a/pub", True), ("a/priv", False), ("b/own", False), ("shared", False)]
    assert policy.visible(b, listed) == ["a/pub", "b/own", "shared"]
    assert policy.visible(a, listed) == ["a/pub", "a/priv", "shared"]


def test_request_quotas_name_the_limit() -> None:
    clock = Clock()
    q = QuotaTracker(TenantLimits(max_concurrent_requests=2, max_queued_requests=1, tokens_per_minute=100), clock)
    t1 = q.start_request("a", 10)
    with pytest.raises(ResourceExhaustedError, match="max_queued_requests"):
        q.start_request("a", 10)
    t1.started()
    t2 = q.start_request("a", 10)
    t2.started()
    with pytest.raises(ResourceExhaustedError, match="max_concurrent_requests"):
        q.start_request("a", 10)
    q.start_request("b", 10).close()  # other tenants are not affected
    t1.add_tokens(75)
    t1.close(), t2.close()
    with pytest.raises(ResourceExhaustedError, match="tokens_per_minute"):
        q.start_request("a", 10)
    clock.t += 61
    q.start_request("a", 10).close()
    assert q.usage("a") == (0, 0)


def test_tokens_per_minute_reserves_each_request_budget_at_admission() -> None:
    """Requests started together cannot overrun the limit (five admitted at once used 755
    tokens against 100/min, as only the prompt was checked): each reserves prompt +
    max_new_tokens, and gives back what it did not generate when it ends. A request whose budget
    alone is over the limit is told so, not to retry."""
    clock = Clock()
    q = QuotaTracker(TenantLimits(tokens_per_minute=100), clock)
    first = q.start_request("a", 2, 40)
    second = q.start_request("a", 2, 40)  # 84 reserved
    with pytest.raises(ResourceExhaustedError, match=r"tokens_per_minute reached .*; retry later"):
        q.start_request("a", 2, 40)
    first.add_tokens(10)  # stops early: 30 of its reservation come back at the end
    first.close()
    assert q.tokens_last_minute("a") == 54
    q.start_request("a", 2, 40).close()  # fits now; its unused 40 come back at once
    second.add_tokens(40)
    second.close()
    assert q.tokens_last_minute("a") == 56
    with pytest.raises(ResourceExhaustedError, match=r"this request alone may use 150 tokens \(50 prompt \+ 100"):
        q.start_request("b", 50, 100)
    clock.t += 61
    assert q.tokens_last_minute("a") == 0 and q.usage("a") == (0, 0)


def test_adapter_quotas_count_bytes_and_adapters_and_reupload_replaces() -> None:
    q = QuotaTracker(TenantLimits(max_adapter_bytes=1000, max_adapters=2))
    q.check_upload("a", "a/x", 500, [("a/y", 400)])
    q.check_upload("a", "a/y", 900, [("a/y", 400)])  # re-upload replaces its old bytes
    with pytest.raises(ResourceExhaustedError, match="max_adapter_bytes"):
        q.check_upload("a", "a/x", 700, [("a/y", 400)])
    with pytest.raises(ResourceExhaustedError, match="max_adapters.*delete one of the tenant's adapters first"):
        q.check_upload("a", "a/z", 1, [("a/x", 1), ("a/y", 1)])
    with pytest.raises(ValueError, match="tokens_per_minute"):
        TenantLimits(tokens_per_minute=-1)


def test_startup_says_when_authentication_is_off(tmp_path, caplog) -> None:
    from loraplex.inference_server.auth.security import Security  # noqa: PLC0415
    from loraplex.inference_server.settings import ServerSettings  # noqa: PLC0415

    caplog.set_level(logging.INFO, logger="loraplex.inference_server.auth.security")
    Security.from_settings(ServerSettings.from_sources([], {})).log_startup()
    assert any(r.levelno == logging.WARNING and "AUTHENTICATION IS OFF (--auth none)" in r.getMessage()
               for r in caplog.records)
    caplog.clear()
    path = tmp_path / "tokens.json"
    write_tokens(path, [(TOKEN_A, "a", "tenant")])
    settings = ServerSettings.from_sources(["--auth", "tokens", "--tokens-file", str(path),
                                            "--tenant-max-adapters", "3"], {})
    security = Security.from_settings(settings)
    security.log_startup()
    assert security.limits.max_adapters == 3 and security.tokens.authenticate(f"Bearer {TOKEN_A}").tenant == "a"
    assert not any("AUTHENTICATION IS OFF" in r.getMessage() for r in caplog.records)
    assert any("bearer tokens cross the network in plaintext" in r.getMessage() for r in caplog.records)
