"""benchmarks/engine/replay_scheduler.py: the scheduler's steps replayed without a GPU, counting the
steps whose LoRA calls the launcher would put on the prefill kernels for the adapters' rank cap."""

from __future__ import annotations


def test_the_rank_cap_moves_eager_steps_onto_the_prefill_kernels() -> None:
    """The launcher's path rule weighs an eager step's mean segment rows by the rank cap (24 rows at
    rank 16, 6 at 64): the same steps take the prefill kernels more often at a larger cap, never less."""
    from benchmarks.engine.bench_textgen import request_set
    from benchmarks.engine.replay_scheduler import replay

    lengths = request_set(64, 2048, seed=0)
    counts = [replay(lengths, 32, 2048, 20000, 16, 64, rank).prefill_kernel_steps for rank in (16, 64, 128)]
    assert counts == sorted(counts) and counts[-1] > counts[0], counts
