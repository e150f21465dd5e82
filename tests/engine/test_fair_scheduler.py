"""Fair admission across tenants (plain Python scheduler, no model)."""

from __future__ import annotations

from loraplex.inference_server.engine.block_manager import BlockManager
from loraplex.inference_server.engine.detokenizer import IncrementalDetokenizer
from loraplex.inference_server.engine.fair_queue import FairQueue
from loraplex.inference_server.engine.request import GenerationRequest, StoppingCriteria
from loraplex.inference_server.engine.scheduler import Scheduler, SchedulerConfig
from loraplex.inference_server.engine.sequence import Sequence


class _NoText:
    def decode(self, ids, skip_special_tokens=True):
        return ""


def _seq(rid: str, tenant: str | None, prompt_len: int = 2, max_new: int = 3) -> Sequence:
    request = GenerationRequest(rid, tuple(range(1, prompt_len + 1)), tenant=tenant,
                                stopping=StoppingCriteria(max_new_tokens=max_new))
    return Sequence.create(request, None, IncrementalDetokenizer(_NoText(), []), None)


def _run_step(sched: Scheduler) -> list[str]:
    """One step; sequences finish after 3 generated tokens. Returns the newly admitted ids."""
    before = {s.request_id for s in sched.running}
    batch = sched.schedule()
    for seq, n in zip(batch.seqs, batch.num_tokens):
        seq.num_computed += n
        if seq.num_computed == len(seq.token_ids):
            seq.token_ids.append(7)
    for seq in list(sched.running):
        if seq.num_output >= 3:
            sched.remove(seq)
    return [s.request_id for s in batch.seqs if s.request_id not in before]


def test_round_robin_across_tenants_fcfs_within() -> None:
    q = FairQueue()
    for i in range(3):
        q.append(_seq(f"a{i}", "a"))
    q.append(_seq("b0", "b"))
    q.append(_seq("c0", "c"))
    q.append(_seq("b1", "b"))
    order = [q.popleft().request_id for _ in range(len(q))]
    assert order == ["a0", "b0", "c0", "a1", "b1", "a2"]
    assert not q and len(q) == 0


def test_preempted_sequence_goes_first_and_remove_keeps_rotation() -> None:
    q = FairQueue()
    a0, a1, b0 = _seq("a0", "a"), _seq("a1", "a"), _seq("b0", "b")
    for s in (a0, a1, b0):
        q.append(s)
    victim = _seq("b-preempted", "b")
    q.appendleft(victim)
    assert q[0] is victim and victim in q and len(q) == 4
    q.remove(a0)
    assert a0 not in q
    assert [q.popleft().request_id for _ in range(3)] == ["b-preempted", "a1", "b0"]


def test_flooding_tenant_does_not_starve_another() -> None:
    """Tenant A queues 300 requests, then B sends one: B is admitted within two admission
    rounds (bounded by the number of tenants), not after A's 300."""
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), BlockManager(256, 4))
    for i in range(300):
        sched.add(_seq(f"a{i}", "a"))
    _run_step(sched)  # A fills the batch
    sched.add(_seq("b0", "b"))
    admitted: list[str] = []
    steps = 0
    while "b0" not in admitted:
        admitted += _run_step(sched)
        steps += 1
        assert steps <= 5, f"B still waiting after {steps} steps; admitted {admitted}"
    assert admitted.index("b0") <= 1  # at most one of A's went before it
    assert sched.waiting.tenants() == {"a": 300 - 4 - (len(admitted) - 1)}  # A's keep their order


def test_single_tenant_stays_fcfs() -> None:
    sched = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64), BlockManager(256, 4))
    for i in range(6):
        sched.add(_seq(f"s{i}", None))
    admitted: list[str] = []
    for _ in range(20):
        admitted += _run_step(sched)
    assert admitted == [f"s{i}" for i in range(6)]
