"""The store image holds the project's wheel and only the packages its Dockerfile lists (not torch,
transformers, xgrammar: GBs). A store process that can import nothing from any other installed
distribution serves what the chart runs it for: uploads, reads, listings and deletes over S3 and
Redis, and its metrics port."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import urllib.request
import uuid
from pathlib import Path

import pytest
from dockerfile_helpers import store_image_requirements
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from store_adapters import peft_files
from store_services import StoreProcess, free_port

from loraplex.adapter_store.client import StoreClient
from loraplex.adapter_store.errors import AdapterNotFoundError

pytestmark = pytest.mark.slow

# Put first on a child's sys.path: refuses, as if not installed, every module that an installed
# distribution outside LORAPLEX_ALLOWED_DISTRIBUTIONS provides (the standard library is none).
GUARD = '''
import importlib.abc, importlib.metadata, os, sys
from packaging.utils import canonicalize_name

_ALLOWED = set(os.environ["LORAPLEX_ALLOWED_DISTRIBUTIONS"].split(","))
_OWNERS = importlib.metadata.packages_distributions()


class _OnlyTheImagePackages(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        owners = _OWNERS.get(name.partition(".")[0])
        if owners and not any(canonicalize_name(d) in _ALLOWED for d in owners):
            raise ModuleNotFoundError(f"{name} ({', '.join(owners)}) is not in the store image", name=name)
        return None


sys.meta_path.insert(0, _OnlyTheImagePackages())
'''


def closure(requirements: list[Requirement]) -> set[str]:
    """The distributions ``requirements`` install here, with what each requires (extras left out;
    one not installed here, e.g. hiredis, can be imported by no one)."""
    seen: set[str] = set()
    todo = list(requirements)
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        if name in seen or (req.marker is not None and not req.marker.evaluate({"extra": ""})):
            continue
        seen.add(name)
        try:
            todo.extend(Requirement(spec) for spec in importlib.metadata.requires(req.name) or ())
        except importlib.metadata.PackageNotFoundError:
            continue
    return seen


@pytest.fixture(scope="module")
def guarded_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("image-guard")
    (folder / "sitecustomize.py").write_text(GUARD)
    allowed = closure(store_image_requirements()) | {"loraplex", "packaging"}  # packaging: the guard's own
    return {"PYTHONPATH": os.pathsep.join([str(folder), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
            "LORAPLEX_ALLOWED_DISTRIBUTIONS": ",".join(sorted(allowed))}


def test_the_guard_refuses_what_the_image_lacks(guarded_env: dict[str, str]) -> None:
    """The check below can fail: the guarded interpreter has no torch, but still has boto3."""
    probe = "import boto3, redis, grpc\ntry:\n    import torch\nexcept ImportError as e:\n    print('refused:', e)"
    out = subprocess.run([sys.executable, "-P", "-c", probe], env={**os.environ, **guarded_env},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "refused: torch" in out.stdout and "not in the store image" in out.stdout


def test_a_store_with_only_the_image_packages_serves_s3_and_redis(tmp_path: Path, guarded_env: dict[str, str],
                                                                   shared_redis, shared_moto, adapters) -> None:
    bucket = f"image-{uuid.uuid4().hex[:10]}"
    shared_moto.s3().create_bucket(Bucket=bucket)
    metrics_port = free_port()
    args = ["--s3-bucket", bucket, "--s3-endpoint-url", shared_moto.endpoint, "--s3-region", "us-east-1",
            "--redis-url", shared_redis.url, "--redis-namespace", f"image:{uuid.uuid4().hex[:8]}",
            "--metrics-port", str(metrics_port)]
    store = StoreProcess(args, tmp_path / "store.log", env=guarded_env)
    try:
        with StoreClient(store.target) as client:
            version = client.put("acme/lean", adapters["r16-bf16"]).version
            assert client.resolve("acme/lean").files == peft_files(adapters["r16-bf16"])
            assert [info.adapter_id for info in client.list()] == ["acme/lean"]
            assert client.get("acme/lean").version == version
            client.delete("acme/lean")
            with pytest.raises(AdapterNotFoundError):
                client.get("acme/lean")
        body = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
        assert 'loraplex_store_uploads_total{outcome="stored"} 1.0' in body
    finally:
        assert store.stop() == 0, (tmp_path / "store.log").read_text()[-3000:]
    log = (tmp_path / "store.log").read_text()
    assert "not in the store image" not in log, log[-3000:]
