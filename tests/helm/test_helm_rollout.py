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
