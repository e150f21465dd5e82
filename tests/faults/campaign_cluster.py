"""The whole system for the fault campaign: redis-server, moto S3, the store sidecar (behind
relays to both, on a fixed port so it can be restarted under the server's feet) and the
inference server on a tiny random Llama, plus a ledger of every acknowledged upload and the
audit run after each fault."""

from __future__ import annotations

import hashlib
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from fault_rig import Rig, Sidecar
from store_services import MotoProcess, RedisProcess, free_port
from server_process import start_server, stop

from loraplex.adapter_store.client import StoreClient
from loraplex.adapter_store.records import StoredRecord
from loraplex.clients import LoraplexClient
from loraplex.clients.errors import LoraplexClientError

PROMPT = "Tell me about the sea"
NEW_TOKENS = 6
KEPT_FILES = ("adapter_config.json", "adapter_model.safetensors")
RECONNECT_S = 30.0  # how soon the server must reach a restarted sidecar: the fault is lifted, it recovers


@dataclass(frozen=True)
class Acknowledged:
    """An upload the client was told succeeded, and what it must keep doing."""

    version: str
    sha256: dict[str, str]  # file name -> sha256 of the bytes uploaded
    tokens: tuple[int, ...]  # its greedy tokens for PROMPT, taken when it was acknowledged


def folder_digests(folder: Path) -> dict[str, str]:
    return {name: hashlib.sha256((folder / name).read_bytes()).hexdigest() for name in KEPT_FILES}


class Cluster:
    def __init__(self, tmp_path: Path, redis: RedisProcess, moto: MotoProcess, model_dir: Path) -> None:
        self.tmp_path = tmp_path
        self.redis, self.moto, self.model_dir = redis, moto, model_dir
        self.rig = Rig(tmp_path, redis, moto)
        self.store_port = free_port()
        self.sidecar: Sidecar = self.start_sidecar()
        self.server: subprocess.Popen | None = None
        self.address = ""
        self.starts = 0
        self.ledger: dict[str, Acknowledged] = {}
        self.start_server()

    # ---------------------------------------------------------------- processes

    def start_sidecar(self) -> Sidecar:
        """(Re)start the sidecar on its port; once the server is up, wait until it reaches the
        sidecar again (its channel reconnects after a backoff), within RECONNECT_S."""
        self.sidecar = self.rig.sidecar("--listen", f"127.0.0.1:{self.store_port}")
        if getattr(self, "server", None) is not None:
            wait_until(self._server_reaches_store, RECONNECT_S, "the server reaching the restarted sidecar")
        return self.sidecar

    def _server_reaches_store(self) -> bool:
        try:
            with self.client(timeout=5) as client:
                client.list_adapters()
            return True
        except LoraplexClientError:
            return False

    def start_server(self) -> None:
        self.starts += 1
        logs = self.tmp_path / f"server{self.starts}"
        logs.mkdir()
        self.server, self.address = start_server(self.model_dir, logs, "--adapter-store", self.sidecar.target)
        with self.client() as client:
            client.wait_until_serving(180)

    def sigkill_server(self) -> None:
        stop(self.server)

    def client(self, timeout: float = 30.0) -> LoraplexClient:
        return LoraplexClient(self.address, timeout=timeout, retry_attempts=1)

    def store(self) -> StoreClient:
        return StoreClient(self.sidecar.target, retries=2, timeout_s=20)

    def close(self) -> None:
        if self.server is not None:
            stop(self.server)
        self.rig.close()

    # ---------------------------------------------------------------- uploads and audits

    def tokens(self, adapter_id: str | None) -> tuple[int, ...]:
        with self.client() as client:
            result = client.generate_text(PROMPT, adapter=adapter_id, max_new_tokens=NEW_TOKENS, ignore_eos=True)
        return tuple(result.token_ids)

    def upload(self, adapter_id: str, folder: Path) -> Acknowledged:
        """Upload through the server's public API; once acknowledged, it joins the ledger."""
        with self.client() as client:
            info = client.upload_adapter(adapter_id, folder, timeout=60)
        ack = Acknowledged(info.version, folder_digests(folder), self.tokens(adapter_id))
        self.ledger[adapter_id] = ack
        return ack

    def audit(self, not_listed: tuple[str, ...] = ()) -> None:
        """Every acknowledged upload listed (by the server and the store) and whole (its blob in
        S3 re-read against the sha256 of the bytes uploaded); every listed adapter generates its
        expected tokens; ``not_listed``: uploads that failed, and must not have half-happened."""
        with self.client() as client:
            served = {a.adapter_id for a in client.list_adapters()}
        with self.store() as store:
            stored = {r.adapter_id: r for r in store.iter_records()}
        for adapter_id, ack in self.ledger.items():
            assert adapter_id in served and adapter_id in stored, f"acknowledged {adapter_id!r} is not listed"
            record = stored[adapter_id]
            assert record.version == ack.version, f"{adapter_id!r}: version {record.version}, acknowledged {ack.version}"
            self._assert_blob_whole(record, ack)
        for adapter_id in not_listed:
            assert adapter_id not in served and adapter_id not in stored, f"failed upload {adapter_id!r} is listed"
        assert served == set(stored), f"server lists {sorted(served)}, store {sorted(stored)}"
        for adapter_id in sorted(served):
            assert self.tokens(adapter_id) == self.ledger[adapter_id].tokens, f"{adapter_id!r} generates other tokens"

    def _assert_blob_whole(self, record: StoredRecord, ack: Acknowledged) -> None:
        obj = self.moto.s3().get_object(Bucket=self.rig.bucket, Key=f"blobs/{record.blob_key}")
        files = record.unpack(obj["Body"].read())  # AdapterCorruptError on any sha256 mismatch
        got = {name: hashlib.sha256(files[name]).hexdigest() for name in KEPT_FILES}
        assert got == ack.sha256, f"{record.adapter_id!r}: stored bytes differ from the bytes uploaded"


def wait_until(predicate, timeout: float = 30.0, what: str = "condition") -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not met within {timeout}s")
        time.sleep(0.1)
