"""The router contract (#41 item 1): three real ``loraplex-server`` processes on the CPU, each with
an adapter pool that holds two rank-8 adapters, and a scorer written from the Gateway API
Inference Extension's lora-affinity rules (the one llm-d and KServe deploy: 1.0 if the adapter
is running on the replica, 0.8 if its running plus waiting adapters number fewer than
``max_lora``, 0.6 if the adapter is waiting there, else 0), plus its queue and KV-cache scorers'
inputs, reading each replica's /metrics as the endpoint picker does. ``max_lora`` is the pool's
real capacity (2, not the batch size): a replica whose pool is full of other adapters is not
"free", and a third adapter sent there waits for pool space, listed as waiting. The picker
chooses the replica the rules say for a hot, a cold and a waiting adapter."""

from __future__ import annotations

import http.client
import json
import shutil
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from lora_helpers import make_peft_adapter
from server_helpers import free_port
from server_process import start_server, stop

pytestmark = pytest.mark.slow
# tiny Llama, rank 8 on q_proj and v_proj, float32: 3 layers x 8 x ((64+64) + (64+32)) elements
RANK8_BYTES = 3 * 8 * (128 + 96) * 4
POOL_BYTES = 2 * RANK8_BYTES + 1000  # holds two such adapters, not three
ADAPTERS = [f"a{i}" for i in range(1, 7)]
WEIGHTS = {"lora": 3.0, "queue": 1.0, "kv": 1.0}


@pytest.fixture(scope="module")
def adapter_root(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    root = tmp_path_factory.mktemp("rank8")
    for seed, name in enumerate(ADAPTERS):
        make_peft_adapter(hf, root / name, dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]), seed, 0.05)
    return root


class Replica:
    def __init__(self, name: str, tiny_llama_dir: Path, adapter_root: Path, tmp: Path, *extra: str) -> None:
        self.name = name
        self.dir = tmp / name
        self.dir.mkdir()
        shutil.copytree(adapter_root, self.dir / "adapters")
        self.port = free_port()
        self.proc, _ = start_server(tiny_llama_dir, self.dir, "--http-port", str(self.port), "--adapter-pool-bytes",
                                    str(POOL_BYTES), "--max-lora-rank", "8", *extra)
        self.streams: list[http.client.HTTPConnection] = []

    def wait_serving(self) -> None:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, (self.dir / "server.log").read_text()
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.1)
        raise AssertionError(f"{self.name} did not start")

    def complete(self, adapter: str, max_tokens: int) -> dict:
        body = json.dumps({"model": adapter, "prompt": "Count:", "max_tokens": max_tokens, "ignore_eos": True})
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}/v1/completions", data=body.encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as r:
            return json.loads(r.read())

    def start_long(self, adapter: str) -> None:
        """A streamed request that runs until closed (its headers come with its first token)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        body = {"model": adapter, "prompt": "Count:", "max_tokens": 2000, "ignore_eos": True, "stream": True}
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        self.streams.append(conn)

    def close_streams(self) -> None:
        for conn in self.streams:
            conn.close()
        self.streams.clear()

    def scrape(self) -> dict:
        """What the endpoint picker reads: running and waiting adapters, max_lora, queue, KV use."""
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=5).read().decode()
        families = {f.name: f for f in text_string_to_metric_families(text)}
        info = max(families["vllm:lora_requests_info"].samples, key=lambda s: s.value).labels  # the newest series
        resident = {(s.labels["adapter"], s.labels["tier"]) for s in families["loraplex:lora_resident"].samples}
        return {"running": set(filter(None, info["running_lora_adapters"].split(","))),
                "waiting": set(filter(None, info["waiting_lora_adapters"].split(","))),
                "max_lora": int(info["max_lora"]),
                "queue": families["vllm:num_requests_waiting"].samples[0].value,
                "kv": families["vllm:kv_cache_usage_perc"].samples[0].value, "resident": resident}


def lora_affinity(m: dict, adapter: str) -> float:
    """GIE's lora-affinity scorer (pkg/epp/scheduling/framework/plugins/scorer/lora_affinity.go)."""
    if adapter in m["running"]:
        return 1.0
    if len(m["running"]) + len(m["waiting"]) < m["max_lora"]:
        return 0.8
    if adapter in m["waiting"]:
        return 0.6
    return 0.0


def pick(metrics: dict[str, dict], adapter: str) -> tuple[str, dict[str, float]]:
    """The replica a weighted sum of the lora-affinity, queue and KV-cache scorers chooses (the
    queue scorer: fewest waiting requests, normalised over the candidates; KV: free cache)."""
    queues = [m["queue"] for m in metrics.values()]
    lo, hi = min(queues), max(queues)
    scores = {}
    for name, m in metrics.items():
        queue = 1.0 if hi == lo else (hi - m["queue"]) / (hi - lo)
        scores[name] = (WEIGHTS["lora"] * lora_affinity(m, adapter) + WEIGHTS["queue"] * queue
                        + WEIGHTS["kv"] * (1.0 - m["kv"]))
    return max(scores, key=scores.get), scores


def _until(replicas: dict[str, Replica], want, timeout: float = 60) -> dict[str, dict]:
    deadline = time.monotonic() + timeout
    while True:
        metrics = {name: r.scrape() for name, r in replicas.items()}
        if want(metrics):
            return metrics
        assert time.monotonic() < deadline, metrics
        time.sleep(0.05)


def test_the_lora_affinity_rules_pick_the_right_replica(tiny_llama_dir: Path, adapter_root: Path,
                                                        tmp_path: Path) -> None:
    replicas = {"A": Replica("A", tiny_llama_dir, adapter_root, tmp_path),
                "B": Replica("B", tiny_llama_dir, adapter_root, tmp_path),
                "C": Replica("C", tiny_llama_dir, adapter_root, tmp_path, "--max-num-seqs", "1")}
    a, b, c = replicas.values()
    try:
        for r in replicas.values():
            r.wait_serving()
        b.complete("a6", 2)  # B has served a rank-8 adapter, and holds it, idle
        a.start_long("a1")
        a.start_long("a2")
        c.start_long("a4")
        _until(replicas, lambda m: m["A"]["running"] == {"a1", "a2"})  # before a3: the loaders race otherwise
        a.start_long("a3")  # a third adapter: A's pool holds two, so it waits for pool space
        metrics = _until(replicas, lambda m: m["A"]["running"] == {"a1", "a2"} and m["A"]["waiting"] == {"a3"}
                         and m["C"]["running"] == {"a4"})
        c.start_long("a5")  # C decodes one request at a time: a5 queues
        metrics = _until(replicas, lambda m: m["C"]["waiting"] == {"a5"} and ("a1", "store") in m["B"]["resident"])
        assert {m["max_lora"] for m in metrics.values()} == {2}  # the pool's capacity, not the batch size
        assert ("a6", "gpu") in metrics["B"]["resident"] and ("a6", "gpu") not in metrics["A"]["resident"]
        assert {("a1", "gpu"), ("a2", "gpu")} <= metrics["A"]["resident"]
        assert pick(metrics, "a1")[0] == "A"  # hot: running on A
        assert pick(metrics, "a6")[0] == "B"  # cold: only B has room for one more adapter
        assert pick(metrics, "a5")[0] == "B"  # waiting on C, but B has room: 0.8 beats 0.6
        b.start_long("a6")
        b.start_long("a2")
        metrics = _until(replicas, lambda m: m["B"]["running"] == {"a2", "a6"})
        choice, scores = pick(metrics, "a5")
        assert choice == "C", scores  # every pool full: the replica where a5 already waits
        assert pick(metrics, "a2")[0] in ("A", "B") and lora_affinity(metrics["C"], "a2") == 0.0
    finally:
        for r in replicas.values():
            r.close_streams()
            stop(r.proc)
