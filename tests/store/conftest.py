"""Fixtures of the adapter store suite: real PEFT adapters, real Redis and S3 (moto server)
processes, and a store served over gRPC for every backend combination."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest
from store_adapters import make_adapters, tiny_base
from store_services import (  # noqa: F401  (aws_test_credentials: a fixture)
    MotoProcess, RedisProcess, ServerThread, aws_test_credentials, redis_binary,
)

from loraplex.adapter_store.client import StoreClient
from loraplex.adapter_store.factory import build_store
from loraplex.adapter_store.metrics import StoreMetrics
from loraplex.adapter_store.settings import RedisSettings, S3Settings, StoreSettings
from loraplex.adapter_store.store import Store
from loraplex.inference_server.model.config import ModelConfig

COMBOS = ("local-memory", "s3-memory", "s3-redis")


@pytest.fixture(scope="session", autouse=True)
def _aws_credentials(aws_test_credentials: None) -> None:
    """Every test here talks to moto's S3 with test credentials."""


@pytest.fixture(scope="session")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, bytes]]:
    return make_adapters(tmp_path_factory.mktemp("peft-adapters"))


@pytest.fixture(scope="session")
def foreign_adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, bytes]]:
    """The same adapters made for a model with hidden size 32 (they do not fit the base)."""
    return make_adapters(tmp_path_factory.mktemp("peft-foreign"), hidden_size=32)


@pytest.fixture(scope="session")
def base_config() -> ModelConfig:
    return tiny_base()


@pytest.fixture(scope="session")
def redis_bin() -> str:
    binary = redis_binary()
    if binary is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server; scripts/ci_services.sh does it)")
    return binary


@pytest.fixture(scope="session")
def shared_redis(redis_bin: str) -> Iterator[RedisProcess]:
    proc = RedisProcess(redis_bin).start()
    yield proc
    proc.kill()


@pytest.fixture(scope="session")
def shared_moto() -> Iterator[MotoProcess]:
    proc = MotoProcess().start()
    yield proc
    proc.stop()


@dataclass
class StoreEnv:
    """A store over one backend combination, served on a loopback port, and a client of it."""

    kind: str
    settings: StoreSettings
    store: Store
    server: ServerThread
    client: StoreClient
    redis: RedisProcess | None = None
    moto: MotoProcess | None = None
    extra_clients: list[StoreClient] = field(default_factory=list)
    closed: bool = False

    def stored_objects(self) -> list[str]:
        """Everything in the blob backend (S3 keys, or files under the local directory) but the
        store's own marker (adapter_store/blob_marker.py)."""
        if self.settings.blob_backend == "s3":
            page = self.moto.s3().list_objects_v2(Bucket=self.settings.s3.bucket)
            keys = [o["Key"] for o in page.get("Contents", [])]
        else:
            root = Path(self.settings.local_dir)
            keys = [p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()]
        return sorted(k for k in keys if k.rpartition("/")[2] not in ("store-marker", ".store-marker"))

    def redis_keys(self, kinds: tuple[str, ...] = ("rec", "blob", "ids", "lru")) -> list[str]:
        """Redis keys of this store's index and cache ([] for the memory backends)."""
        if self.redis is None:
            return []
        ns = self.settings.redis.namespace
        client = self.redis.client()
        try:
            keys = [k.decode() for k in client.keys(f"{ns}:*")]
        finally:
            client.close()
        return sorted(k for k in keys if k[len(ns) + 1 :].split(":")[0] in kinds)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for c in [self.client, *self.extra_clients]:
            c.close()
        self.server.stop()


def make_settings(kind: str, tmp_path: Path, redis_proc: RedisProcess | None, moto_proc: MotoProcess | None,
                  **overrides: object) -> StoreSettings:
    redis, moto = redis_proc, moto_proc
    blobs, index = kind.split("-")
    s3 = redis_settings = None
    if blobs == "s3":
        bucket = f"store-{uuid.uuid4().hex[:12]}"
        moto.s3().create_bucket(Bucket=bucket)
        s3 = S3Settings(bucket=bucket, prefix="adapters/", endpoint_url=moto.endpoint, region="us-east-1",
                        connect_timeout_s=0.5, read_timeout_s=5.0, max_attempts=1,
                        multipart_threshold=5 * 1024 * 1024, multipart_chunksize=5 * 1024 * 1024)
    if index == "redis":
        redis_settings = RedisSettings(url=redis.url, namespace=f"test:{uuid.uuid4().hex[:8]}", socket_timeout_s=2.0)
    settings = StoreSettings(blob_backend=blobs, local_dir=str(tmp_path / "blobs"), s3=s3, index_backend=index,
                             redis=redis_settings, cache_max_bytes=64 * 1024 * 1024)
    return replace(settings, **overrides)


@pytest.fixture
def make_env(tmp_path: Path, base_config: ModelConfig) -> Iterator[Callable[..., StoreEnv]]:
    """make_env(kind, redis_proc=..., moto_proc=..., **settings overrides) -> a started StoreEnv."""
    made: list[StoreEnv] = []

    def make(kind: str, redis_proc: RedisProcess | None = None, moto_proc: MotoProcess | None = None,
             base: ModelConfig | None = base_config, **overrides: object) -> StoreEnv:
        settings = make_settings(kind, tmp_path / f"env{len(made)}", redis_proc, moto_proc, **overrides)
        store = build_store(settings, base=base, metrics=StoreMetrics())
        server = ServerThread(store)
        env = StoreEnv(kind, settings, store, server, StoreClient(server.target, base=base, retries=1, timeout_s=20),
                       redis_proc if "redis" in kind else None, moto_proc if kind.startswith("s3") else None)
        made.append(env)
        return env

    yield make
    for env in made:
        env.close()


@pytest.fixture(params=COMBOS)
def env(request: pytest.FixtureRequest, make_env: Callable[..., StoreEnv]) -> StoreEnv:
    """The store over each backend combination (shared Redis/moto processes, fresh bucket/namespace)."""
    kind = request.param
    redis = request.getfixturevalue("shared_redis") if "redis" in kind else None
    moto = request.getfixturevalue("shared_moto") if kind.startswith("s3") else None
    return make_env(kind, redis_proc=redis, moto_proc=moto)
