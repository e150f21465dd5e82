"""The model name ServerInfo reports (#29 item 5): the name a user knows the model by
(SmolLM2-135M-Instruct for the default GGUF, not the GGUF's internal title), or the one
``--served-model-name`` gives."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from loraplex.clients import LoraplexClient
from loraplex.clients.errors import LoraplexClientError
from loraplex.inference_server.model.checkpoint import ModelSource
from loraplex.inference_server.model.gguf_file import open_checkpoint
from loraplex.inference_server.settings import ServerSettings
from server_helpers import free_port

REPO = Path(__file__).resolve().parents[2]


def test_the_default_gguf_is_named_as_its_file_not_its_internal_title(smollm2_gguf: str) -> None:
    import torch  # noqa: PLC0415

    config = open_checkpoint(ModelSource(path=smollm2_gguf), torch.float32).config
    assert config.name == "SmolLM2-135M-Instruct"


def test_served_model_name_is_a_flag_and_a_variable() -> None:
    assert ServerSettings.from_sources(["--served-model-name", "acme-chat"], env={}).served_model_name == "acme-chat"
    assert ServerSettings.from_sources([], env={"LORAPLEX_SERVED_MODEL_NAME": "x"}).served_model_name == "x"
    with pytest.raises(ValueError, match="served_model_name"):
        ServerSettings.from_sources(["--served-model-name", " "], env={})


def _server_info_name(tmp_path: Path, *extra: str) -> str:
    port = free_port()
    env = {**os.environ, "LORAPLEX_ADAPTER_DIR": str(tmp_path / "adapters"), "LORAPLEX_METRICS_PORT": "0",
           "LORAPLEX_HTTP_PORT": "0"}
    with open(tmp_path / "server.log", "w") as log:
        proc = subprocess.Popen([sys.executable, "-P", "-m", "loraplex.inference_server.main", "--port", str(port),
                                 "--num-kv-blocks", "64", *extra], cwd=REPO, env=env, stdout=log,
                                stderr=subprocess.STDOUT)
    try:
        with LoraplexClient(f"127.0.0.1:{port}", retry_attempts=1, timeout=2) as client:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                assert proc.poll() is None, (tmp_path / "server.log").read_text()
                try:
                    if client.health() == "SERVING":
                        return client.server_info().model_name
                except LoraplexClientError:
                    pass  # not listening yet
                time.sleep(0.05)
        raise AssertionError("the server did not start: " + (tmp_path / "server.log").read_text())
    finally:
        proc.kill()
        proc.wait(10)


@pytest.mark.slow
def test_server_info_names_the_default_model_and_the_served_name(tmp_path: Path) -> None:
    """loraplex-server with no --model serves SmolLM2-135M-Instruct under that name; with
    --served-model-name, under the given one."""
    assert _server_info_name(tmp_path) == "SmolLM2-135M-Instruct"
    assert _server_info_name(tmp_path, "--served-model-name", "acme-chat") == "acme-chat"
