"""CPU threads of the engine: keep the step loop's OpenMP team the only one in the process.

PyTorch's Linux wheels run intra-op parallelism (and MKL's GEMMs) on libgomp. Every thread
that runs a parallel op keeps its own team of worker threads for as long as it lives. While
the process holds no more of those threads than CPUs, idle workers spin between parallel
regions; past that libgomp cuts their spinning short (its throttled spin count), so after
each region they sleep on a futex and every GEMM pays a wake-up. A model loaded (or
adapters staged) on one thread and stepped on another is already past that on a small
machine: measured on 2 cores (SmolLM2-135M, batch 8), a decode step took 85 ms on a worker
thread against 64 ms with the same work on the loading thread (~270 futex sleeps per step
against none), 124 vs 79 ms with 8 adapters.

So the engine (a) releases the idle team of the thread that starts it (the event loop
thread, which runs no model work afterwards), (b) gives its adapter loader threads one
intra-op thread, so they never build teams of their own (and leave the cores to the step
loop), and (c) sets the step loop's thread count explicitly (a thread's count is read
lazily from the last ``torch.set_num_threads`` of any thread).

Spinning workers are what a PyTorch program gets by default; they are fastest on cores of
its own, and slow a step many times over when other busy processes share the cores (seen
here: 10x while a test suite ran). There, ``OMP_WAIT_POLICY=passive`` in the server's
environment makes them sleep at once instead (here 1.3-1.9x slower when idle).
"""

from __future__ import annotations

import ctypes
import logging
import os

import torch

log = logging.getLogger(__name__)

_OMP_PAUSE_HARD = 2  # omp_pause_resource_t (OpenMP 5.0)


def release_openmp_team() -> bool:
    """Let the calling thread's idle OpenMP workers exit (``omp_pause_resource_all``) so they
    no longer count against the CPUs; a later parallel op on this thread builds a new team.
    Only for libgomp (the runtime whose throttling this avoids). True when released."""
    path = _loaded_libgomp()
    if path is None:
        return False
    try:
        lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        return lib.omp_pause_resource_all(_OMP_PAUSE_HARD) == 0
    except (OSError, AttributeError) as e:  # an older libgomp, or the library vanished
        log.debug("could not release the OpenMP team of this thread: %s", e)
        return False


def set_intra_op_threads(count: int) -> None:
    """The calling thread's intra-op thread count, kept for its lifetime.

    PyTorch reads a thread's count lazily, on its first parallel op, from the last
    ``set_num_threads`` of any thread; reading it first makes that happen now, so a later
    call in another thread (a loader's 1, the step loop's count) cannot override this one."""
    torch.get_num_threads()
    torch.set_num_threads(count)


def one_intra_op_thread() -> None:
    """Thread initializer for helper threads (adapter loading): no OpenMP team of their own."""
    set_intra_op_threads(1)


def _loaded_libgomp() -> str | None:
    """Path of the libgomp PyTorch runs on, from /proc/self/maps: the one inside torch's
    install (other wheels bundle their own copies, e.g. sentencepiece), else the only one."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split(maxsplit=5)[-1].strip() for line in maps}
    except OSError:  # not Linux
        return None
    found = sorted(p for p in paths if os.path.basename(p).startswith("libgomp"))
    torch_dir = os.path.dirname(os.path.realpath(torch.__file__))
    ours = [p for p in found if os.path.realpath(p).startswith((torch_dir + os.sep, torch_dir + ".libs" + os.sep))]
    if ours:
        return ours[0]
    return found[0] if len(found) == 1 else None
