"""Scheduler and KV block manager bookkeeping (plain Python, no model)."""

from __future__ import annotations

import pytest

from loraplex.inference_server.engine.block_manager import BlockManager
from loraplex.inference_server.engine.detokenizer import IncrementalDetokenizer
from loraplex.inference_server.engine.request import GenerationRequest, StoppingCriteria
from loraplex.inference_server.engine.scheduler import Scheduler, SchedulerConfig
from loraplex.inference_server.engine.sequence import Sequence


class _NoText:
    def decode(self, ids, skip_special_tokens=True):
        return ""


def _seq(rid: str, prompt_len: int) -> Sequence:
    request = GenerationRequest(rid, tuple(range(1, prompt_len + 1)), stopping=StoppingCriteria(max_new_tokens=100))
    return Sequence.create(request, None, IncrementalDetokenizer(_NoText(), []), None)


def _step(sched: Scheduler) -> dict[str, int]:
    """Schedule, then pretend the model ran: chunks computed, finished prompts get a token."""
    batch = sched.schedule()
    for seq, n in zip(batch.seqs, batch.num_tokens):
        seq.num_computed += n
        if seq.num_computed == len(seq.token_ids):
            seq.token_ids.append(7)
    return {s.request_id: n for s, n in zip(batch.seqs, batch.num_tokens)}


def test_block_manager_grows_and_frees() -> None:
    blocks = BlockManager(4, 8)
    table: list[int] = []
    assert blocks.can_grow(table, 32) and not blocks.can_grow(table, 33)
    blocks.grow(table, 9)
    assert len(table) == 2 and blocks.num_free == 2
    assert blocks.slot(table, 9) == table[1] * 8 + 1
    blocks.free(table)
    assert table == [] and blocks.num_free == 4


def test_token_budget_chunks_a_long_prompt_and_decodes_keep_running() -> None:
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=10), BlockManager(64, 4))
    sched.add(_seq("short", 3))
    assert _step(sched) == {"short": 3}
    sched.add(_seq("long", 25))
    assert _step(sched) == {"short": 1, "long": 9}
    assert _step(sched) == {"short": 1, "long": 9}
    assert _step(sched) == {"short": 1, "long": 7}
    assert _step(sched) == {"short": 1, "long": 1}


def test_max_num_seqs_limits_admission_fcfs() -> None:
    sched = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=100), BlockManager(64, 4))
    for i in range(4):
        sched.add(_seq(f"s{i}", 2))
    assert set(_step(sched)) == {"s0", "s1"}
    sched.remove(sched.running[0])
    assert set(_step(sched)) == {"s1", "s2"}


def test_out_of_blocks_preempts_the_newest_and_requeues_it_first() -> None:
    blocks = BlockManager(4, 4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=100), blocks)
    old, new = _seq("old", 4), _seq("new", 4)
    sched.add(old)
    sched.add(new)
    _step(sched)  # both prefilled: 1 block each, then each has 5 tokens
    _step(sched)  # decodes need a 2nd block each: 4 blocks used
    for _ in range(3):
        _step(sched)
    scheduled = _step(sched)  # old needs a 3rd block: new is preempted
    assert "old" in scheduled and "new" not in scheduled
    assert sched.waiting[0] is new and new.num_computed == 0 and new.block_table == []
    assert sched.num_preemptions == 1


@pytest.mark.parametrize("headroom,prompt,admitted", [
    (0, 48, True),  # 12 blocks of the 13 free
    (8, 48, False),  # and 2 kept for the running sequence's next 8 tokens: 14 > 13
    (8, 44, True),  # 11 + 2
    (64, 40, False),  # 10 + 4: 64 tokens would be 16 blocks, capped at a quarter of the cache
    (64, 36, True),  # 9 + 4
])
def test_admission_leaves_headroom_for_the_running_sequences(headroom: int, prompt: int, admitted: bool) -> None:
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=100, admission_headroom_tokens=headroom),
                      BlockManager(16, 4))
    sched.add(_seq("a", 8))
    _step(sched)  # "a" alone, nothing running: admitted with no headroom asked (2 blocks)
    sched.add(_seq("b", prompt))
    scheduled = _step(sched)  # "a" decodes into its 3rd block: 13 free when "b" asks
    assert ("b" in scheduled) is admitted and "a" in scheduled
    assert len(sched.waiting) == (0 if admitted else 1)


def test_headroom_stops_a_preempted_sequence_from_thrashing_under_kv_pressure() -> None:
    """Punica's request mix (96 requests of up to 512 tokens, all queued at once, 32 running)
    through a cache of 4800 tokens, less than 32 full contexts: without headroom, a preempted sequence comes back as soon as its own freed
    blocks allow and is the newest again at the next shortage; with the default headroom far
    fewer contexts are thrown away, and every request still finishes."""
    from benchmarks.engine.bench_textgen import request_set
    from benchmarks.engine.replay_scheduler import replay

    lengths = request_set(96, 512, seed=0)
    default = SchedulerConfig(32, 512).admission_headroom_tokens
    without, with_headroom = (replay(lengths, 32, 512, 300, 16, h) for h in (0, default))
    assert without.preemptions >= 50, "the case must put the cache under pressure"
    assert with_headroom.preemptions * 4 <= without.preemptions
    assert with_headroom.recomputed_tokens * 3 <= without.recomputed_tokens


@pytest.mark.parametrize("budget,seqs", [(8, 16)])
def test_config_allows_budget_below_batch_only_through_engine_validation(budget: int, seqs: int) -> None:
    from loraplex.inference_server.engine.config import EngineConfig

    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        EngineConfig(max_num_batched_tokens=budget, max_num_seqs=seqs)


def test_config_refuses_a_negative_admission_headroom() -> None:
    from loraplex.inference_server.engine.config import EngineConfig

    with pytest.raises(ValueError, match="admission_headroom_tokens"):
        EngineConfig(admission_headroom_tokens=-1)
