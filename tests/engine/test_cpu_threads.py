"""The engine keeps the step loop's OpenMP team the only one (engine/cpu_threads.py)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading

from pathlib import Path

import pytest
import torch

from loraplex.inference_server.engine import cpu_threads
from lora_helpers import ADAPTER_CONFIGS, greedy_request, load_engine, make_test_adapters, run_all


def test_release_lets_the_calling_threads_openmp_workers_exit() -> None:
    if cpu_threads._loaded_libgomp() is None:
        pytest.skip("PyTorch here does not run on libgomp")
    code = textwrap.dedent("""
        import os, time, torch
        from loraplex.inference_server.engine import cpu_threads
        torch.set_num_threads(2)
        count = lambda: len(os.listdir("/proc/self/task"))
        before = count()
        torch.randn(1000, 1000) @ torch.randn(1000, 1000)  # builds this thread's team
        with_team = count()
        released = cpu_threads.release_openmp_team()
        time.sleep(0.1)
        print(before, with_team, released, count())
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    before, with_team, released, after = int(out[0]), int(out[1]), out[2], int(out[3])
    assert with_team == before + 1 and released == "True" and after == before


def test_the_libgomp_found_is_torchs_even_with_other_copies_loaded() -> None:
    path = cpu_threads._loaded_libgomp()
    if path is not None:
        assert "torch" in path


def test_helper_threads_get_one_intra_op_thread_and_leave_others_alone() -> None:
    before = torch.get_num_threads()
    seen = []
    thread = threading.Thread(target=lambda: (cpu_threads.one_intra_op_thread(), seen.append(torch.get_num_threads())))
    thread.start()
    thread.join()
    torch.set_num_threads(before)  # the count new threads start with is process-wide: restore it
    assert seen == [1]
    assert torch.get_num_threads() == before


def test_the_step_loop_keeps_the_engines_thread_count_while_loaders_use_one(
    tiny_llama_dir: Path, tmp_path: Path,
) -> None:
    adapters = make_test_adapters(tiny_llama_dir, tmp_path / "adapters")
    engine = load_engine(tiny_llama_dir, adapters, max_num_seqs=4)
    threads = torch.get_num_threads()
    seen: dict[str, int] = {}
    step, acquire = engine._core.step, engine._manager.acquire

    def recording_step():
        seen["step"] = torch.get_num_threads()
        return step()

    def recording_acquire(adapter_id, cancel=None):
        seen["loader"] = torch.get_num_threads()
        return acquire(adapter_id, cancel)

    engine._core.step, engine._manager.acquire = recording_step, recording_acquire
    try:
        prompt = engine.tokenizer.encode("Hello there")
        run_all(engine, [greedy_request(f"r{i}", prompt, name, 4) for i, name in enumerate(ADAPTER_CONFIGS)])
    finally:
        torch.set_num_threads(threads)
    assert seen == {"step": threads, "loader": 1}
