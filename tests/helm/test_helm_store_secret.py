"""The adapter store's shared secret under GitOps. The chart generates it with randAlphaNum and
keeps it across `helm upgrade` through lookup, but `helm template` (how Argo CD renders) has no
cluster to look up, so every render is a new secret: every sync rewrote the Secret, and a
container restarted after that read a secret its neighbour did not hold, so the sidecar refused
the server. adapterStore.existingSecret names a Secret of yours instead, and the render is stable."""

from __future__ import annotations

from helm_chart_helpers import FULLNAME, env_of, render, render_error

EXISTING = {"adapterStore": {"existingSecret": "lp-store-secret", "existingSecretKey": "shared"}}


def secret_files(r) -> tuple[str, str]:
    cms = {c["metadata"]["name"]: c["data"] for c in r.all("ConfigMap")}
    return (env_of(r.container("server"), cms)["LORAPLEX_ADAPTER_STORE_SECRET_FILE"],
            env_of(r.container("adapter-store"), cms)["LORAPLEX_STORE_SECRET_FILE"])


def test_the_generated_secret_is_new_at_every_render_without_a_cluster() -> None:
    """Why GitOps needs existingSecret: lookup finds nothing under `helm template`."""
    first, second = (render().get("Secret", f"{FULLNAME}-store-secret")["data"]["secret"] for _ in range(2))
    assert first != second


def test_an_existing_secret_is_mounted_in_both_containers_and_none_is_made() -> None:
    r = render(EXISTING)
    assert not r.all("Secret"), "the chart must not make a Secret beside the user's"
    volume = {v["name"]: v for v in r.pod["volumes"]}["store-secret"]["secret"]
    assert volume["secretName"] == "lp-store-secret"
    assert volume["items"] == [{"key": "shared", "path": "secret"}]
    server_file, store_file = secret_files(r)
    assert server_file == store_file
    for name in ("server", "adapter-store"):
        mount = {m["name"]: m for m in r.container(name)["volumeMounts"]}["store-secret"]
        assert server_file == f"{mount['mountPath']}/{volume['items'][0]['path']}" and mount["readOnly"], name


def test_with_an_existing_secret_every_render_is_the_same() -> None:
    assert render(EXISTING) == render(EXISTING)


def test_the_key_defaults_to_the_generated_secrets_key() -> None:
    volume = {v["name"]: v for v in render({"adapterStore": {"existingSecret": "s"}}).pod["volumes"]}["store-secret"]
    assert volume["secret"]["items"] == [{"key": "secret", "path": "secret"}]


def test_an_existing_secret_without_require_secret_is_refused() -> None:
    message = render_error({"adapterStore": {"requireSecret": False, "existingSecret": "lp-store-secret"}})
    assert "adapterStore.existingSecret" in message and "adapterStore.requireSecret" in message, message
