"""The fault campaign: the whole system (redis-server, moto S3, the store sidecar, the inference
server) with one process killed or one link broken at a chosen point per test, each followed by
the same audit (campaign_cluster.Cluster.audit) once the fault is lifted, and a fresh upload to
show the system recovered. The tests share one cluster and run in order, so each audit also
covers every upload acknowledged before it."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from campaign_cluster import Cluster, wait_until
from lora_helpers import make_peft_adapter
from store_services import RedisProcess, redis_binary

from loraplex.clients.errors import LoraplexClientError, NotFoundError

MID_BLOB = 20_000  # bytes past an S3 PUT's key (into the blob) or a Redis SET's key where a transfer is held


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """PEFT folders for the tiny Llama, each large enough (~250 KB) to be held mid-transfer."""
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    out = tmp_path_factory.mktemp("campaign-adapters")
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    return {f"a{i}": make_peft_adapter(model, out / f"a{i}", dict(r=16, target_modules=targets), seed=10 + i,
                                       std=0.1) for i in range(8)}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, fault_moto, tiny_llama_dir, adapters) -> Iterator[Cluster]:  # noqa: ANN001
    binary = redis_binary()
    if binary is None:
        pytest.skip("redis-server is not installed (scripts/ci_services.sh installs it)")
    redis = RedisProcess(binary).start()
    made = Cluster(tmp_path_factory.mktemp("campaign"), redis, fault_moto, tiny_llama_dir)
    try:
        made.upload("acme/base-0", adapters["a0"])
        assert made.tokens("acme/base-0") != made.tokens(None), "the adapter changes nothing"
        made.audit()
        yield made
    finally:
        made.close()
        redis.kill()


def _failing_upload(cluster: Cluster, adapter_id: str, folder: Path) -> tuple[threading.Thread, list]:
    outcome: list = []

    def run() -> None:
        try:
            with cluster.client() as client:
                outcome.append(client.upload_adapter(adapter_id, folder, timeout=60))
        except LoraplexClientError as e:
            outcome.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


def test_sidecar_killed_during_an_uploads_s3_write(cluster, adapters):
    trap = cluster.sidecar.s3_relay.trap(b"/blobs/acme/killed-s3", extra=MID_BLOB)
    thread, outcome = _failing_upload(cluster, "acme/killed-s3", adapters["a1"])
    trap.wait_hit(30)
    cluster.sidecar.sigkill()
    thread.join(60)
    assert outcome and isinstance(outcome[0], LoraplexClientError), outcome

    cluster.start_sidecar()
    cluster.audit(not_listed=("acme/killed-s3",))
    cluster.upload("acme/after-sidecar-kill", adapters["a2"])
    cluster.audit()


def test_sidecar_killed_after_the_s3_commit_during_the_cache_write(cluster, adapters):
    ns = cluster.rig.namespace
    trap = cluster.sidecar.redis_relay.trap(f"{ns}:blob:acme/killed-cache@".encode(), extra=MID_BLOB)
    thread, outcome = _failing_upload(cluster, "acme/killed-cache", adapters["a3"])
    trap.wait_hit(30)
    assert cluster.rig.head("acme/killed-cache") is not None, "the head is written before the cache"
    cluster.sidecar.sigkill()
    thread.join(60)
    assert outcome and isinstance(outcome[0], LoraplexClientError), outcome

    cluster.start_sidecar()
    # Committed but not acknowledged: the store may keep it (it is whole) or not, never half of it.
    with cluster.store() as store:
        kept = store.fetch("acme/killed-cache")[0]
    assert kept.version == cluster.rig.head("acme/killed-cache").version
    with cluster.client() as client:
        client.delete_adapter("acme/killed-cache")  # not in the ledger: out of the audit's way
    cluster.upload("acme/killed-cache", adapters["a4"])  # the id is not left locked
    cluster.audit()


def test_redis_killed_during_an_uploads_cache_write(cluster, adapters):
    ns = cluster.rig.namespace
    trap = cluster.sidecar.redis_relay.trap(f"{ns}:blob:acme/redis-killed@".encode(), extra=MID_BLOB)
    thread, outcome = _failing_upload(cluster, "acme/redis-killed", adapters["a5"])
    trap.wait_hit(30)
    cluster.redis.kill()
    trap.drop()
    thread.join(60)
    assert outcome and not isinstance(outcome[0], Exception), f"S3 is the truth; the upload should land: {outcome}"
    cluster.ledger["acme/redis-killed"] = _acknowledge(cluster, "acme/redis-killed", adapters["a5"], outcome[0])
    cluster.audit()  # served without Redis

    cluster.redis.start()  # same port, empty: the index is rebuilt from S3
    client = cluster.redis.client()
    wait_until(lambda: client.exists(f"{ns}:complete"), what="index rebuilt after the Redis restart")
    client.close()
    cluster.upload("acme/after-redis-kill", adapters["a6"])
    cluster.audit()


def test_s3_connection_reset_mid_blob(cluster, adapters):
    trap = cluster.sidecar.s3_relay.trap(b"/blobs/acme/s3-reset", extra=MID_BLOB)
    thread, outcome = _failing_upload(cluster, "acme/s3-reset", adapters["a7"])
    trap.wait_hit(30)
    trap.drop()  # the connection is reset with the blob half sent
    thread.join(60)
    if isinstance(outcome[0], Exception):  # the retry may fail too: then nothing may be listed
        cluster.audit(not_listed=("acme/s3-reset",))
    else:
        cluster.ledger["acme/s3-reset"] = _acknowledge(cluster, "acme/s3-reset", adapters["a7"], outcome[0])
        cluster.audit()


def test_server_killed_mid_generation(cluster, adapters):
    done = threading.Event()

    def generate() -> None:
        try:
            with cluster.client() as client:
                for _ in client.generate("Once upon a time", adapter="acme/base-0", max_new_tokens=400,
                                         ignore_eos=True):
                    done.set()
        except LoraplexClientError:
            pass

    threading.Thread(target=generate, daemon=True).start()
    assert done.wait(60), "the generation never streamed a token"
    cluster.sigkill_server()
    cluster.start_server()
    cluster.audit()
    cluster.upload("acme/after-server-kill", adapters["a1"])
    cluster.audit()


def test_bucket_recreated_empty_behind_the_stores_back(cluster, adapters):
    """Last: it loses every upload. The loss is reported and the lost adapters are neither listed
    nor generated with (the server drops its copies on the store's resync), not served stale."""
    lost = sorted(cluster.ledger)
    s3 = cluster.moto.s3()
    for obj in s3.list_objects_v2(Bucket=cluster.rig.bucket).get("Contents", []):
        s3.delete_object(Bucket=cluster.rig.bucket, Key=obj["Key"])
    s3.delete_bucket(Bucket=cluster.rig.bucket)
    s3.create_bucket(Bucket=cluster.rig.bucket)

    def nothing_listed() -> bool:
        with cluster.client() as client, cluster.store() as store:
            return not client.list_adapters() and not list(store.iter_records())

    wait_until(nothing_listed, what="the lost adapters unlisted")
    assert "lost its objects" in cluster.rig.log(len(cluster.rig.sidecars) - 1)
    for adapter_id in lost:
        wait_until(lambda: _not_found(cluster, adapter_id), what=f"{adapter_id!r} no longer generated with")
    cluster.ledger.clear()
    cluster.upload("acme/after-bucket-loss", adapters["a2"])
    cluster.audit()


def _not_found(cluster: Cluster, adapter_id: str) -> bool:
    try:
        cluster.tokens(adapter_id)
    except NotFoundError:
        return True
    return False


def _acknowledge(cluster: Cluster, adapter_id: str, folder: Path, info):  # noqa: ANN001, ANN202
    from campaign_cluster import Acknowledged, folder_digests  # noqa: PLC0415

    return Acknowledged(info.version, folder_digests(folder), cluster.tokens(adapter_id))
