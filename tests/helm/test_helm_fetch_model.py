"""The chart's S3 model fetch (helm/loraplex/files/fetch_model.py, run by the fetch-model
init container) against a real HTTP S3 endpoint (moto in server mode on loopback), run
the way the init container runs it: a separate Python process with AWS_* variables."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "helm" / "loraplex" / "files" / "fetch_model.py"
AWS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
MODEL = {
    "config.json": b'{"model_type": "llama"}',
    "model-00001-of-00002.safetensors": os.urandom(3 * 1024 * 1024 + 17),
    "model-00002-of-00002.safetensors": os.urandom(1024),
    "tokenizer/tokenizer.json": b"{}",
}

pytestmark = pytest.mark.slow  # starts an S3 server


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str]:
    from moto.server import ThreadedMotoServer  # noqa: PLC0415

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    import boto3  # noqa: PLC0415

    s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="testing",
                      aws_secret_access_key="testing")
    s3.create_bucket(Bucket="models")
    for name, data in MODEL.items():
        s3.put_object(Bucket="models", Key=f"llama/{name}", Body=data)
    s3.put_object(Bucket="models", Key="llama/", Body=b"")  # a console-made "folder" marker
    s3.put_object(Bucket="models", Key="llama-other/config.json", Body=b"not this one")
    s3.put_object(Bucket="models", Key="gguf/smol.Q8_0.gguf", Body=b"GGUF" + os.urandom(4096))
    s3.put_object(Bucket="models", Key="evil/../../escape.txt", Body=b"x")
    yield endpoint
    server.stop()


def fetch(endpoint: str, dest: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")} | AWS
    return subprocess.run([sys.executable, str(SCRIPT), f"--endpoint-url={endpoint}", f"--dest={dest}", *args],
                          env=env, capture_output=True, text=True, timeout=120)


def tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_copies_the_model_folder_and_nothing_else(s3_endpoint: str, tmp_path: Path) -> None:
    proc = fetch(s3_endpoint, tmp_path, "--bucket=models", "--prefix=llama")  # no trailing slash
    assert proc.returncode == 0, proc.stderr
    assert tree(tmp_path) == MODEL  # llama-other/ is not under llama/; no partial files left
    assert "4 file(s)" in proc.stdout


def test_a_second_run_keeps_complete_files_and_replaces_broken_ones(s3_endpoint: str, tmp_path: Path) -> None:
    assert fetch(s3_endpoint, tmp_path, "--bucket=models", "--prefix=llama/").returncode == 0
    (tmp_path / "config.json").write_bytes(b"{}")  # wrong size: an interrupted earlier copy
    proc = fetch(s3_endpoint, tmp_path, "--bucket=models", "--prefix=llama/")
    assert proc.returncode == 0, proc.stderr
    assert "copied config.json" in proc.stdout and "kept   model-00001-of-00002.safetensors" in proc.stdout
    assert tree(tmp_path) == MODEL


def test_a_prefix_naming_one_file_copies_that_file(s3_endpoint: str, tmp_path: Path) -> None:
    proc = fetch(s3_endpoint, tmp_path, "--bucket=models", "--prefix=gguf/smol.Q8_0.gguf")
    assert proc.returncode == 0, proc.stderr
    assert list(tree(tmp_path)) == ["smol.Q8_0.gguf"]


@pytest.mark.parametrize(("args", "words"), [
    (("--bucket=models", "--prefix=nothing-here/"), "no objects under s3://models/nothing-here/"),
    (("--bucket=no-such-bucket", "--prefix=llama/"), "NoSuchBucket"),
    (("--bucket=models", "--prefix=evil/"), "refusing object key"),
])
def test_failures_exit_1_with_a_reason_and_write_nothing_outside(s3_endpoint: str, tmp_path: Path, args: tuple,
                                                                 words: str) -> None:
    dest = tmp_path / "models"
    proc = fetch(s3_endpoint, dest, *args)
    assert proc.returncode == 1 and words in proc.stderr, proc.stderr
    assert not (tmp_path / "escape.txt").exists() and not tree(tmp_path)


def test_usage_errors_exit_2(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT), "--dest", str(tmp_path)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and "--bucket" in proc.stderr
