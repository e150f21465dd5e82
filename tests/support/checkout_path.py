"""The checkout's root goes last on ``sys.path`` in the test process (tests import ``benchmarks``).

The root holds the design's folders (kernels/, clients/, ...) that loraplex installs as
``loraplex.kernels`` and so on. On ``sys.path`` in front of site-packages, the root's
``kernels/`` would shadow Hugging Face's ``kernels`` (which transformers imports): ``python -m
pytest`` from the root puts it there. Last, it still lets ``loraplex`` import from the checkout
where the project is not installed (the GPU machine), while installed packages win. Processes
the tests start run ``python -P`` for the same reason.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def keep_checkout_root_last() -> None:
    """Put the checkout root at the end of sys.path, removing it (or the current folder standing
    for it) from every earlier place."""
    def is_root(entry: str) -> bool:
        return Path(entry or os.getcwd()).resolve() == ROOT

    sys.path[:] = [entry for entry in sys.path if not is_root(entry)] + [str(ROOT)]
