"""scripts/run_stack.sh: the single-host production layout (docs/DEPLOY.md) as real processes:
redis-server, moto's S3 server, one adapter store with a shared secret, two inference servers
on the tiny Llama. An adapter uploaded through one server generates the same tokens on the
other (one store, one S3 bucket, one Redis), and `stop` ends every process by its PID."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lora_helpers import make_peft_adapter

from loraplex.clients import LoraplexClient

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "run_stack.sh"
OFFSETS = (0, 1, 2, 3, 10, 11, 12, 20, 21, 22)  # the ports the script takes, from its base


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_base() -> int:
    """A base port whose ten ports are all free now."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + max(OFFSETS) < 65536 and all(_free(base + o) for o in OFFSETS):
            return base
    raise RuntimeError("no free block of ports")


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _pids(folder: Path) -> dict[str, int]:
    path = folder / "pids"
    return {name: int(pid) for name, pid in (line.split() for line in path.read_text().splitlines())} \
        if path.exists() else {}


def _endpoints(folder: Path) -> dict[str, str]:
    return dict(line.split("=", 1) for line in (folder / "endpoints.env").read_text().splitlines())


def test_upload_on_one_server_generate_on_the_other_then_stop_by_pid(tiny_llama_dir: Path, tmp_path: Path) -> None:
    if shutil.which("redis-server") is None:
        if os.environ.get("CI"):
            pytest.fail("redis-server is missing (scripts/ci_services.sh installs it)")
        pytest.skip("redis-server is not installed (scripts/ci_services.sh installs it)")
    from transformers import AutoModelForCausalLM

    hf_model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    adapter = make_peft_adapter(hf_model, tmp_path / "peft", dict(r=8, target_modules=["q_proj", "v_proj"]),
                                seed=3, std=0.1)
    stack = tmp_path / "stack"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LORAPLEX_", "AWS_"))}
    env.update(PYTHON=sys.executable, STACK_BASE_PORT=str(free_base()), STACK_WAIT_S="300",
               LORAPLEX_MODEL=str(tiny_llama_dir), LORAPLEX_DEVICE="cpu", LORAPLEX_NUM_KV_BLOCKS="256",
               LORAPLEX_MAX_NUM_SEQS="8")
    try:
        started = subprocess.run(["bash", str(SCRIPT), "start", str(stack)], cwd=REPO, env=env, capture_output=True,
                                 text=True, timeout=600)
        assert started.returncode == 0, started.stdout + started.stderr
        assert "loraplex stack is up" in started.stdout and "server2  gRPC" in started.stdout, started.stdout
        pids = _pids(stack)
        assert sorted(pids) == ["redis", "s3", "server1", "server2", "store"] and all(map(_alive, pids.values()))
        urls = _endpoints(stack)
        with LoraplexClient(urls["SERVER1_ADDRESS"], timeout=30) as one, \
                LoraplexClient(urls["SERVER2_ADDRESS"], timeout=30) as two:
            one.upload_adapter("acme/pirate", adapter)
            assert [a.adapter_id for a in two.list_adapters()] == ["acme/pirate"]
            ask = dict(max_new_tokens=8, ignore_eos=True)
            tuned = two.generate_text("Tell me about the sea", adapter="acme/pirate", **ask).token_ids
            assert tuned == one.generate_text("Tell me about the sea", adapter="acme/pirate", **ask).token_ids
            assert tuned != two.generate_text("Tell me about the sea", **ask).token_ids
        secret = (stack / "store.secret").read_text().strip()
        assert oct((stack / "store.secret").stat().st_mode & 0o777) == "0o600"
        assert all(secret not in p.read_text() for p in (stack / "logs").iterdir()), "the secret must not be logged"
        stopped = subprocess.run(["bash", str(SCRIPT), "stop", str(stack)], cwd=REPO, env=env, capture_output=True,
                                 text=True, timeout=300)
        assert stopped.returncode == 0, stopped.stderr
        assert not [name for name, pid in pids.items() if _alive(pid)], stopped.stderr
        assert not (stack / "pids").exists()
        assert "draining" in (stack / "logs" / "server1.log").read_text() or \
            "shutting down" in (stack / "logs" / "server1.log").read_text()
    finally:
        for pid in _pids(stack).values():  # whatever a failed run left behind, by its PID
            if _alive(pid):
                os.kill(pid, 9)
