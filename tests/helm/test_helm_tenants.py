"""The chart's tenant settings: tokens Secret, TLS Secrets (probes on the plaintext health
port), the store's shared secret in both containers, per-tenant limits; and what it refuses."""

from __future__ import annotations

import base64

import pytest
from helm_chart_helpers import FULLNAME, env_of, render, render_error

from loraplex.inference_server.settings import ServerSettings

SECURE = {
    "auth": {"mode": "tokens", "tokensSecret": "lp-tokens"},
    "tls": {"secretName": "lp-tls", "clientCaSecret": "lp-client-ca", "healthPort": 50052},
    "tenantLimits": {"maxConcurrentRequests": 8, "maxQueuedRequests": 16, "tokensPerMinute": 100000,
                     "maxAdapterBytes": 1 << 30, "maxAdapters": 50},
}


def _envs(r) -> tuple[dict[str, str], dict[str, str]]:
    cms = {c["metadata"]["name"]: c["data"] for c in r.all("ConfigMap")}
    return env_of(r.container("server"), cms), env_of(r.container("adapter-store"), cms)


def _mounts(container: dict) -> dict[str, str]:
    return {m["name"]: m["mountPath"] for m in container.get("volumeMounts", [])}


def test_default_is_auth_none_with_a_generated_store_secret_in_both_containers() -> None:
    r = render()
    server, store = _envs(r)
    assert server["LORAPLEX_AUTH"] == "none" and "LORAPLEX_TLS_CERT_FILE" not in server
    secret = r.get("Secret", f"{FULLNAME}-store-secret")
    assert len(base64.b64decode(secret["data"]["secret"])) == 48
    server_path, store_path = server["LORAPLEX_ADAPTER_STORE_SECRET_FILE"], store["LORAPLEX_STORE_SECRET_FILE"]
    assert server_path == store_path
    assert server_path.startswith(_mounts(r.container("server"))["store-secret"] + "/")
    assert store_path.startswith(_mounts(r.container("adapter-store"))["store-secret"] + "/")
    volumes = {v["name"]: v for v in r.pod["volumes"]}
    assert volumes["store-secret"]["secret"]["secretName"] == f"{FULLNAME}-store-secret"
    assert r.container("server")["readinessProbe"]["grpc"]["port"] == 50051


def test_tokens_tls_and_limits_reach_the_server_settings() -> None:
    r = render(SECURE)
    server, _ = _envs(r)
    settings = ServerSettings.from_sources([], server)  # every key is a real, valid setting
    assert settings.auth == "tokens" and settings.tenant_max_adapters == 50 and settings.health_port == 50052
    mounts = _mounts(r.container("server"))
    assert settings.tokens_file == f"{mounts['auth-tokens']}/tokens.json"
    assert settings.tls_cert_file == f"{mounts['tls']}/tls.crt" and settings.tls_key_file == f"{mounts['tls']}/tls.key"
    assert settings.tls_client_ca_file == f"{mounts['tls-client-ca']}/ca.crt"
    volumes = {v["name"]: v for v in r.pod["volumes"]}
    assert volumes["auth-tokens"]["secret"]["secretName"] == "lp-tokens"
    assert "subPath" not in str(r.container("server")["volumeMounts"])  # Secret edits reach the pod: hot reload
    assert volumes["tls"]["secret"]["secretName"] == "lp-tls"
    assert volumes["tls-client-ca"]["secret"]["secretName"] == "lp-client-ca"
    server_c = r.container("server")
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):  # kubelet probes cannot speak TLS
        assert server_c[probe]["grpc"]["port"] == 50052
    assert {"name": "health", "containerPort": 50052, "protocol": "TCP"} in server_c["ports"]


@pytest.mark.parametrize(("values", "words"), [
    ({"auth": {"mode": "tokens"}}, "auth.mode=tokens needs auth.tokensSecret"),
    ({"tls": {"clientCaSecret": "ca"}}, "tls.clientCaSecret (client certificates) needs tls.secretName"),
    ({"tls": {"secretName": "t", "healthPort": 50051}}, "server.grpcPort and tls.healthPort are both 50051"),
    ({"auth": {"mode": "mtls"}}, "/auth/mode"),
    ({"tenantLimits": {"tokensPerMinute": -1}}, "/tenantLimits/tokensPerMinute"),
    ({"tenantLimits": {"requestsPerSecond": 5}}, "'requestsPerSecond' not allowed"),
])
def test_bad_tenant_values_are_refused_naming_them(values: dict, words: str) -> None:
    message = render_error(values)
    assert words in message, message


def test_store_secret_can_be_turned_off() -> None:
    r = render({"adapterStore": {"requireSecret": False}})
    server, store = _envs(r)
    assert not r.all("Secret") and "LORAPLEX_STORE_SECRET_FILE" not in store
    assert "LORAPLEX_ADAPTER_STORE_SECRET_FILE" not in server
