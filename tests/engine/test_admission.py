"""Room for one more stream in the engine (inference_server/engine/admission.py)."""

from __future__ import annotations

from loraplex.inference_server.engine.admission import Admission


def _fill(admission: Admission, tenant, n: int) -> int:
    admitted = 0
    for _ in range(n):
        if admission.room_for(tenant):
            admission.opened(tenant)
            admitted += 1
    return admitted


def test_without_tenants_the_capacity_is_the_limit() -> None:
    a = Admission(3)
    assert _fill(a, None, 5) == 3 and not a.room_for(None)
    a.closed(None)
    assert a.room_for(None)


def test_one_tenant_filling_the_engine_does_not_lock_the_others_out() -> None:
    """acme's streams filled the engine and beta got 'request queue is full'. A full engine
    still admits a tenant under its share (capacity / tenants holding streams), the tenant over
    it waits until the total is under the capacity again, and the total stays under 2x."""
    a = Admission(4)
    assert _fill(a, "acme", 10) == 4  # alone, acme may fill it
    assert not a.room_for("acme")
    assert _fill(a, "beta", 10) == 2  # its share of 4 between two tenants
    assert _fill(a, "gamma", 10) == 1  # 4 // 3
    assert not a.room_for("acme") and not a.room_for("beta")
    for _ in range(3):
        a.closed("acme")  # 1 acme + 2 beta + 1 gamma = 4: still full
    assert not a.room_for("acme") and a.room_for("delta")  # a newcomer gets its share (4 // 4)
    a.closed("beta")
    assert a.room_for("acme")  # under the capacity: anyone
    b = Admission(2)
    _fill(b, "t0", 2)
    assert sum(_fill(b, f"t{i}", 3) for i in range(1, 50)) <= 2  # never past 2x the capacity
