"""How the Deployment replaces its pods: a strategy the API server accepts, and one that
cannot deadlock on the adapters' ReadWriteOnce claim."""

from __future__ import annotations

from helm_chart_helpers import render


def strategy(values: dict) -> dict:
    return render(values).get("Deployment")["spec"]["strategy"]


def test_default_rollout_starts_a_new_pod_before_stopping_the_old_one() -> None:
    assert strategy({}) == {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}


def test_recreate_renders_without_rolling_update_limits() -> None:
    # the API server refuses spec.strategy.rollingUpdate with type Recreate
    # ("may not be specified when strategy `type` is 'Recreate'")
    assert strategy({"updateStrategy": {"type": "Recreate"}}) == {"type": "Recreate"}


def test_rolling_update_limits_are_the_users() -> None:
    assert strategy({"updateStrategy": {"rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}}) == {
        "type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}


CLAIM = {"adapterStore": {"local": {"existingClaim": "adapters"}}}


def test_adapters_on_a_claim_are_rolled_out_by_recreate_by_default() -> None:
    # maxSurge 1 / maxUnavailable 0 would start the new pod while the old one still holds the
    # ReadWriteOnce claim: on another node it never attaches, and the rollout hangs
    r = render(CLAIM)
    assert r.get("Deployment")["spec"]["strategy"] == {"type": "Recreate"}
    assert {"name": "store-data", "persistentVolumeClaim": {"claimName": "adapters"}} in r.pod["volumes"]


def test_a_strategy_chosen_for_a_claim_is_kept() -> None:
    # e.g. a ReadWriteMany claim, where a surge pod can mount it too
    chosen = {**CLAIM, "updateStrategy": {"type": "RollingUpdate"}}
    assert strategy(chosen) == {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}


def test_an_s3_store_ignores_a_leftover_claim() -> None:
    # the claim only holds blobs=local adapters: with S3 the pod mounts no claim
    values = {"adapterStore": {"blobs": "s3", "s3": {"bucket": "b"}, "local": {"existingClaim": "adapters"}}}
    assert strategy(values)["type"] == "RollingUpdate"
