"""loraplex's benchmarks, run as modules from the checkout root: ``python -m benchmarks.<subject>.<script>``.

Subjects: ``kernels`` (the CUDA kernels alone), ``engine`` (the engine in one process),
``serving`` (a server process and its clients), ``store`` (the adapter store); ``common`` holds
what several share (the one server launcher, RESULTS.md sections, random adapters). README.md
lists every entry point with its machine and command.

``python -m`` puts the checkout root first on ``sys.path``, where its ``kernels/`` folder (installed
as ``loraplex.kernels``) would shadow Hugging Face's ``kernels`` package, which transformers
imports. Importing this package moves the root to the end instead (``benchmarks`` itself is
already imported by then), as tests/support/checkout_path.py does for the tests: installed packages win,
and ``loraplex`` still imports from the checkout where it is not installed (a GPU machine). This
is the only place a benchmark touches ``sys.path``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def keep_checkout_root_last(path: list[str]) -> None:
    """Move the checkout root (or the current folder standing for it) to the end of ``path``."""
    def is_root(entry: str) -> bool:
        return Path(entry or os.getcwd()).resolve() == ROOT

    path[:] = [entry for entry in path if not is_root(entry)] + [str(ROOT)]


keep_checkout_root_last(sys.path)
