"""Fixtures of the fault campaign: real redis-server and moto S3 processes, real PEFT adapters,
and a rig that starts store sidecars behind TCP relays (tcp_relay.py) to kill them mid-transfer."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fault_rig import Rig
from store_adapters import make_adapters
from store_services import (  # noqa: F401  (aws_test_credentials: a fixture)
    MotoProcess, RedisProcess, aws_test_credentials, redis_binary,
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test here starts processes and kills them: all slow, all faults."""
    here = Path(__file__).parent
    for item in items:
        if here in Path(item.fspath).parents:
            item.add_marker(pytest.mark.slow)
            item.add_marker(pytest.mark.faults)


@pytest.fixture(scope="session", autouse=True)
def _aws_credentials(aws_test_credentials: None) -> None:
    """Every test here talks to moto's S3 with test credentials."""


@pytest.fixture(scope="session")
def fault_adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, bytes]]:
    return make_adapters(tmp_path_factory.mktemp("fault-adapters"))


@pytest.fixture(scope="session")
def fault_redis() -> Iterator[RedisProcess]:
    binary = redis_binary()
    if binary is None:
        pytest.skip("redis-server is not installed (scripts/ci_services.sh installs it)")
    proc = RedisProcess(binary).start()
    yield proc
    proc.kill()


@pytest.fixture(scope="session")
def fault_moto() -> Iterator[MotoProcess]:
    proc = MotoProcess().start()
    yield proc
    proc.stop()


@pytest.fixture
def rig(tmp_path: Path, fault_redis: RedisProcess, fault_moto: MotoProcess) -> Iterator[Rig]:
    """A fresh bucket and Redis namespace; sidecars made with rig.sidecar() are killed at the end."""
    made = Rig(tmp_path, fault_redis, fault_moto)
    yield made
    made.close()
