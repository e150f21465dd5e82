"""A real loraplex-server process on a free port (tests that need the process, not a thread)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from server_helpers import free_port


REPO = Path(__file__).resolve().parents[2]


def start_server(model_dir: Path, tmp_path: Path, *extra: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    log = open(tmp_path / "server.log", "w")
    env = {**os.environ, "LORAPLEX_ADAPTER_DIR": str(tmp_path / "adapters"), "LORAPLEX_METRICS_PORT": "0",
           "LORAPLEX_HTTP_PORT": "0"}
    proc = subprocess.Popen(
        [sys.executable, "-P", "-m", "loraplex.inference_server.main", "--model", str(model_dir), "--port", str(port),
         "--num-kv-blocks", "256", *extra],
        cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
    )
    return proc, f"127.0.0.1:{port}"


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait(10)
