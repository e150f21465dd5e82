"""A bucket and a Redis namespace shared by store sidecars, each behind its own relays."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from pathlib import Path

from store_services import MotoProcess, RedisProcess, StoreProcess
from tcp_relay import TcpRelay

from loraplex.adapter_store.client import StoreClient
from loraplex.adapter_store.records import StoredRecord


@dataclass
class Sidecar:
    """One ``python -m loraplex.adapter_store.main`` process, and the relays it reaches S3 and Redis by."""

    process: StoreProcess
    s3_relay: TcpRelay
    redis_relay: TcpRelay

    @property
    def target(self) -> str:
        return self.process.target

    def client(self, timeout_s: float = 30.0) -> StoreClient:
        return StoreClient(self.target, retries=0, timeout_s=timeout_s)

    def sigkill(self) -> None:
        self.process.proc.kill()
        self.process.proc.wait(10)

    def close(self) -> None:
        if self.process.proc.poll() is None:
            self.sigkill()
        self.s3_relay.close()
        self.redis_relay.close()


class Rig:
    def __init__(self, tmp_path: Path, redis: RedisProcess, moto: MotoProcess) -> None:
        self.tmp_path = tmp_path
        self.redis = redis
        self.moto = moto
        self.bucket = f"faults-{uuid.uuid4().hex[:12]}"
        self.namespace = f"faults:{uuid.uuid4().hex[:8]}"
        moto.s3().create_bucket(Bucket=self.bucket)
        self.sidecars: list[Sidecar] = []

    def sidecar(self, *extra: str) -> Sidecar:
        """A sidecar over the rig's bucket and namespace, reaching both through fresh relays."""
        s3_relay, redis_relay = TcpRelay(self.moto.port), TcpRelay(self.redis.port)
        args = ["--s3-bucket", self.bucket, "--s3-endpoint-url", f"http://127.0.0.1:{s3_relay.port}",
                "--s3-region", "us-east-1", "--redis-url", f"redis://127.0.0.1:{redis_relay.port}/0",
                "--redis-namespace", self.namespace, "--log-level", "INFO", *extra]
        process = StoreProcess(args, self.tmp_path / f"sidecar{len(self.sidecars)}.log")
        car = Sidecar(process, s3_relay, redis_relay)
        self.sidecars.append(car)
        return car

    def head(self, adapter_id: str) -> StoredRecord | None:
        """The adapter's committed record, read from S3 directly (not through any relay)."""
        try:
            obj = self.moto.s3().get_object(Bucket=self.bucket, Key=f"heads/{adapter_id}")
        except self.moto.s3().exceptions.NoSuchKey:
            return None
        return StoredRecord.from_json(obj["Body"].read())

    def blob_keys(self) -> list[str]:
        page = self.moto.s3().list_objects_v2(Bucket=self.bucket, Prefix="blobs/")
        return sorted(o["Key"] for o in page.get("Contents", []))

    def lease_ttl_ms(self, adapter_id: str) -> int:
        client = self.redis.client()
        try:
            return int(client.pttl(f"{self.namespace}:lock:{adapter_id}"))
        finally:
            client.close()

    def log(self, index: int) -> str:
        return (self.tmp_path / f"sidecar{index}.log").read_text()

    def close(self) -> None:
        for car in self.sidecars:
            car.close()


def record_summary(record: StoredRecord | None) -> str:
    return "none" if record is None else json.dumps({"version": record.version, "sha256": record.info.sha256})
