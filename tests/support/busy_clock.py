"""A busy machine as a thread sees it: descheduled between two readings of the wall clock.

``BusyClock`` stands in for the ``time`` module of the code under test: a second of wall clock
passes between any two readings, while CPU clocks (``thread_time``, ``process_time``) tick as
they do. ``starved=True``: the thread's CPU clock does not move either (it never gets a CPU).
"""

from __future__ import annotations

import time
import types


class BusyClock(types.SimpleNamespace):
    def __init__(self, starved: bool = False) -> None:
        super().__init__(now=time.monotonic(), starved=starved, cpu=time.thread_time())

    def monotonic(self) -> float:
        self.now += 1.0
        return self.now

    def time(self) -> float:
        return time.time() + self.monotonic()

    def perf_counter(self) -> float:
        return self.monotonic()

    def thread_time(self) -> float:
        return self.cpu if self.starved else time.thread_time()

    def __getattr__(self, name: str):
        return getattr(time, name)
