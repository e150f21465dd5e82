"""An adapter's rank_pattern / alpha_pattern / target_modules patterns are judged once, at
upload, and by CPU time: a stored adapter is never refused later because the machine was busy.

A busy machine is a thread that is descheduled between two readings of the wall clock
(tests/support/busy_clock.py).
"""

from __future__ import annotations

import re
import time

import pytest
from busy_clock import BusyClock
from store_adapters import with_config

from loraplex.adapter_store.errors import AdapterValidationError
from loraplex.adapter_store.format import patterns

pytestmark = pytest.mark.slow  # starts gRPC servers (and Redis / moto)


def _scales(spec) -> dict[tuple[int, str], tuple[int, float]]:
    return {(m.layer, m.module): (m.rank, m.scale) for m in spec.modules}


def _plain_patterns(adapters) -> dict[str, bytes]:
    """r16-bf16 (lora_alpha 32) with q_proj's rank and alpha set by plain pattern keys: the
    patterns of an ordinary PEFT adapter."""
    return with_config(adapters["r16-bf16"], rank_pattern={"q_proj": 16}, alpha_pattern={"q_proj": 64})


def test_a_stored_adapter_with_plain_patterns_resolves_on_a_busy_machine(env, adapters, monkeypatch):
    env.client.put("acme/busy", _plain_patterns(adapters))  # the upload succeeds on a quiet machine
    monkeypatch.setattr(patterns, "time", BusyClock())
    spec = env.client.resolve("acme/busy").spec  # what the inference server does at generate time
    scales = _scales(spec)
    assert scales[(0, "q_proj")] == (16, pytest.approx(64 / 16))
    assert scales[(1, "k_proj")] == (16, pytest.approx(32 / 16))


def test_an_upload_on_a_busy_machine_is_judged_by_cpu_time(make_env, adapters, monkeypatch):
    env = make_env("local-memory")
    monkeypatch.setattr(patterns, "time", BusyClock())
    info = env.client.put("acme/busy", _plain_patterns(adapters))
    assert info.rank == 16
    assert _scales(env.client.resolve("acme/busy").spec)[(1, "q_proj")][1] == pytest.approx(4.0)


def test_a_pattern_that_backtracks_is_refused_at_upload_saying_what_was_measured(make_env, adapters):
    env = make_env("local-memory")
    key = r"(.|\w|\.)*$q"
    files = with_config(adapters["r16-bf16"], rank_pattern={key: 8})
    started = time.monotonic()
    with pytest.raises(AdapterValidationError, match=f"rank_pattern key {re.escape(repr(key))}: .* s of CPU time"):
        env.client.put("acme/slow", files)
    assert time.monotonic() - started < 10 * patterns.MATCH_BUDGET_S
    assert env.client.list() == []
