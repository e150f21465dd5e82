"""Adapter pool bookkeeping: range allocator, LRU eviction, reference counts, invalidation."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lora_helpers import make_peft_adapter

from loraplex.adapter_store.errors import AdapterNotFoundError, ResourceExhaustedError
from loraplex.inference_server.lora.local_directory import LocalAdapterDirectory
from loraplex.inference_server.lora.pool.adapter_pool import AdapterPool
from loraplex.inference_server.lora.pool.packing import plan_layout
from loraplex.inference_server.lora.pool.range_allocator import RangeAllocator
from loraplex.inference_server.model.config import ModelConfig

CFG = ModelConfig(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=8)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 500)), min_size=1, max_size=300))
def test_range_allocator_accounting_is_exact(ops: list[tuple[bool, int]]) -> None:
    alloc = RangeAllocator(8192, align=16)
    live: dict[int, int] = {}
    for do_free, size in ops:
        if do_free and live:
            start = sorted(live)[size % len(live)]
            alloc.free(start)
            del live[start]
        else:
            start = alloc.alloc(size)
            if start is not None:
                live[start] = -(-size // 16) * 16
    assert alloc.used == sum(live.values())
    spans = sorted(live.items())
    assert all(a + n <= b for (a, n), (b, _) in zip(spans, spans[1:])), "ranges overlap"
    for start in list(live):
        alloc.free(start)
    assert alloc.used == 0 and alloc.largest_free == 8192


@pytest.fixture(scope="module")
def adapter_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    hf = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in CFG.to_hf().items() if k != "architectures"}))
    root = tmp_path_factory.mktemp("pool-adapters")
    for i in range(6):
        make_peft_adapter(hf, root / f"a{i}", dict(r=8, target_modules=["q_proj", "down_proj"]),
                          seed=i, std=0.1)
    return root


@pytest.fixture(scope="module")
def adapter_root_cached(adapter_root: Path) -> Path:
    return adapter_root


def _manager(root: Path, adapters_fit: int) -> AdapterPool:
    source = LocalAdapterDirectory(root, CFG)
    biggest = max(plan_layout(source.resolve(f"a{i}").spec, CFG).num_elements for i in range(6))
    return AdapterPool(source, CFG, biggest * adapters_fit + 64 * 16, torch.float32, "cpu", acquire_timeout_s=0.2)


def test_lru_evicts_the_least_recently_used_idle_adapter(adapter_root: Path) -> None:
    mgr = _manager(adapter_root, 3)
    for name in ("a0", "a1", "a2"):
        mgr.release(mgr.acquire(name))
    mgr.release(mgr.acquire("a0"))  # a0 becomes most recent
    mgr.release(mgr.acquire("a3"))  # evicts a1, the least recent
    assert set(mgr.resident_ids()) == {"a0", "a2", "a3"}
    assert mgr.stats().evictions == 1


def test_adapters_in_use_are_never_evicted_and_a_full_pool_waits(adapter_root: Path) -> None:
    mgr = _manager(adapter_root, 2)
    held = [mgr.acquire("a0"), mgr.acquire("a1")]
    with pytest.raises(ResourceExhaustedError, match="in-use"):
        mgr.acquire("a2")  # bounded wait, then a clear error
    got = []
    waiter = threading.Thread(target=lambda: got.append(mgr.acquire("a2")))
    waiter.start()
    mgr.release(held[0])  # frees room: the waiter proceeds
    waiter.join(timeout=5)
    assert got and got[0].adapter_id == "a2"
    assert set(mgr.resident_ids()) == {"a1", "a2"}


def test_pool_contents_match_the_packed_adapter(adapter_root: Path) -> None:
    mgr = _manager(adapter_root, 2)
    ra = mgr.acquire("a4")
    n = ra.layout.num_elements
    from safetensors.torch import load_file

    tensors = load_file(adapter_root / "a4" / "adapter_model.safetensors")
    a = tensors["base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight"]  # [r, in]
    r, fan_in = a.shape
    start = ra.placement.a_offsets[0] + 1 * fan_in * r
    assert torch.equal(mgr.pool[start : start + fan_in * r].view(fan_in, r), a.t())
    assert mgr.stats().used_bytes >= n * 4


def test_every_copy_into_the_pool_is_announced_with_its_range_and_write_counts(adapter_root: Path) -> None:
    mgr = _manager(adapter_root, 2)
    heard = []
    mgr.add_write_listener(lambda pool, start, end, before, after: heard.append((pool, start, end, before, after)))
    for name in ("a0", "a1", "a2"):  # the third evicts the first and reuses its place
        mgr.release(mgr.acquire(name))
    assert len(heard) == 3
    for pool, start, end, before, after in heard:
        assert pool is mgr.pool and 0 <= start < end <= pool.numel() and after > before
    counts = [(before, after) for _, _, _, before, after in heard]
    assert all(a[1] <= b[0] for a, b in zip(counts, counts[1:])), "windows do not overlap"
    assert heard[2][1] == heard[0][1], "the evicted adapter's place is reused and announced again"
    with torch.inference_mode():
        frozen = _manager(adapter_root, 1)
    assert not frozen.counts_pool_writes
    with pytest.raises(ValueError, match="inference mode"):
        frozen.add_write_listener(lambda *a: None)


def test_invalidate_keeps_the_running_copy_until_released(adapter_root: Path) -> None:
    mgr = _manager(adapter_root, 3)
    old = mgr.acquire("a0")
    mgr.invalidate("a0")
    assert "a0" not in mgr.resident_ids() and old.stale
    new = mgr.acquire("a0")
    assert new is not old and new.start != old.start
    used = mgr.stats().used_bytes
    mgr.release(old)
    assert mgr.stats().used_bytes < used


class _FailingFirstWrite:
    """The pool's writes, with the first copy held until ``go`` and then failing (a device copy error)."""

    def __init__(self, inner) -> None:
        self.inner, self.calls = inner, 0
        self.entered, self.go = threading.Event(), threading.Event()

    def write(self, start, packed) -> None:
        self.calls += 1
        if self.calls == 1:
            self.entered.set()
            assert self.go.wait(10)
            raise RuntimeError("device copy failed")
        self.inner.write(start, packed)


def test_a_failed_copy_racing_a_reupload_fails_its_joiners_and_spares_the_new_copy(adapter_root: Path) -> None:
    """A copy into the pool fails after a re-upload invalidated its adapter and a newer load placed
    the new version: the requests that joined the failed load are told so (they waited forever),
    the new version stays resident (it was dropped and its place leaked), and every place is freed once."""
    mgr = _manager(adapter_root, 3)
    writes = mgr._writes = _FailingFirstWrite(mgr._writes)
    outcome: dict[str, object] = {}

    def acquire(name: str) -> None:
        try:
            outcome[name] = mgr.acquire("a0")
        except Exception as e:  # noqa: BLE001  (the test reads it)
            outcome[name] = e

    loader = threading.Thread(target=acquire, args=("loader",), daemon=True)
    loader.start()
    assert writes.entered.wait(10)
    joiner = threading.Thread(target=acquire, args=("joiner",), daemon=True)
    joiner.start()
    _wait_for(lambda: mgr.stats().counters["gpu_joins"] == 1)
    mgr.invalidate("a0")  # the re-upload: a newer load places the new version while the old copy runs
    newer = mgr.acquire("a0")
    writes.go.set()
    loader.join(10)
    joiner.join(10)
    assert not joiner.is_alive(), "a request that joined the failed load waits forever"
    assert isinstance(outcome["loader"], RuntimeError)
    assert isinstance(outcome["joiner"], ResourceExhaustedError)
    assert mgr.resident_ids() == ["a0"] and mgr.try_acquire_resident("a0") is newer
    mgr.release(newer)
    mgr.release(newer)
    assert mgr.stats().used_bytes == newer.layout.num_elements * 4
    mgr.invalidate("a0")
    assert mgr.stats().used_bytes == 0


def _wait_for(check, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


class _PausedSource:
    """The adapter directory, with resolve() of one id held after it read the files until released."""

    def __init__(self, inner: LocalAdapterDirectory, adapter_id: str) -> None:
        self.inner, self.adapter_id = inner, adapter_id
        self.read, self.go = threading.Event(), threading.Event()

    def resolve(self, adapter_id: str):
        files = self.inner.resolve(adapter_id)
        if adapter_id == self.adapter_id and not self.go.is_set():
            self.read.set()
            assert self.go.wait(10)
        return files


@pytest.mark.parametrize("change", ["delete", "reupload"])
def test_a_delete_or_reupload_during_a_cold_load_is_never_lost(tmp_path: Path, adapter_root: Path, change) -> None:
    """A load that read an adapter's files before it was deleted or replaced must not place
    (and serve) those files afterwards: it fetches again, so a deleted adapter is NOT_FOUND and
    a replaced one serves the new version."""
    import shutil

    root = tmp_path / "adapters"
    shutil.copytree(adapter_root / "a0", root / "x")
    local = LocalAdapterDirectory(root, CFG)
    source = _PausedSource(local, "x")
    size = plan_layout(local.resolve("x").spec, CFG).num_elements
    mgr = AdapterPool(source, CFG, 4 * size + 64 * 16, torch.float32, "cpu", acquire_timeout_s=5)
    result: dict[str, object] = {}

    def load() -> None:
        try:
            result["ra"] = mgr.acquire("x")
        except Exception as e:  # noqa: BLE001  (the test reads it)
            result["error"] = e

    thread = threading.Thread(target=load)
    thread.start()
    assert source.read.wait(10)  # the load has read the files ...
    if change == "delete":  # ... and the adapter goes away before it is placed
        local.delete("x")
    else:
        local.put("x", _reupload_files(adapter_root))
    mgr.invalidate("x")
    source.go.set()
    thread.join(10)
    if change == "delete":
        assert isinstance(result.get("error"), AdapterNotFoundError), result
        assert "x" not in mgr.resident_ids() and "x" not in mgr.held_versions()
        with pytest.raises(AdapterNotFoundError):
            mgr.acquire("x")
    else:
        ra = result["ra"]
        assert ra.version == local.get("x").version and mgr.held_versions()["x"] == ra.version
    assert mgr.stats().counters["stale_fetches"] == 1


def _reupload_files(adapter_root: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in (adapter_root / "a1").iterdir() if p.is_file()}


def test_unknown_adapter_is_not_found(adapter_root: Path) -> None:
    with pytest.raises(AdapterNotFoundError):
        _manager(adapter_root, 1).acquire("missing")


def test_host_tier_serves_a_reload_without_refetching(adapter_root: Path) -> None:
    mgr = _manager(adapter_root, 1)
    mgr.release(mgr.acquire("a0"))
    mgr.release(mgr.acquire("a1"))  # evicts a0 from the pool; a0 stays in the host tier
    mgr.release(mgr.acquire("a0"))
    counters = mgr.stats().counters
    assert counters["source_fetches"] == 2 and counters["host_hits"] == 1 and counters["gpu_evictions"] == 2


def test_prefetch_stages_in_the_host_tier_without_a_pool_place(adapter_root: Path) -> None:
    mgr = _manager(adapter_root, 1)
    mgr.prefetch("a2")
    assert mgr.resident_ids() == [] and mgr.stats().counters["source_fetches"] == 1
    mgr.release(mgr.acquire("a2"))  # from the host tier: no second fetch
    counters = mgr.stats().counters
    assert counters["source_fetches"] == 1 and counters["host_hits"] == 1
    with pytest.raises(AdapterNotFoundError):
        mgr.prefetch("nope")


def test_no_starvation_with_many_more_adapters_than_slots(tmp_path: Path) -> None:
    """64 adapters over 8 slots, 16 threads hammering a Zipf mix: every acquisition completes
    within a bound, and waiters are served in arrival order (resident adapters rotate out)."""
    import random

    from transformers import LlamaConfig, LlamaForCausalLM

    hf = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in CFG.to_hf().items() if k != "architectures"}))
    base = make_peft_adapter(hf, tmp_path / "src", dict(r=8, target_modules=["q_proj"]), seed=0, std=0.1)
    files = {f.name: f.read_bytes() for f in base.iterdir() if f.is_file()}
    source = LocalAdapterDirectory(tmp_path / "store", CFG)
    for i in range(64):
        source.put(f"t/a{i}", files)
    size = plan_layout(source.resolve("t/a0").spec, CFG).num_elements
    mgr = AdapterPool(source, CFG, 8 * (size + 64), torch.float32, "cpu", acquire_timeout_s=30.0)
    weights = [1 / (k + 1) ** 1.5 for k in range(64)]
    waits: list[float] = []
    errors: list[BaseException] = []

    def client(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(40):
            name = f"t/a{rng.choices(range(64), weights)[0]}"
            t0 = time.monotonic()
            try:
                ra = mgr.acquire(name)
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)
                return
            waits.append(time.monotonic() - t0)
            time.sleep(0.002)  # "decoding"
            mgr.release(ra)

    threads = [threading.Thread(target=client, args=(s,)) for s in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors[:3]
    assert len(waits) == 16 * 40
    assert max(waits) < 10.0, f"an acquisition waited {max(waits):.2f}s"
    stats = mgr.stats()
    assert stats.in_use == 0 and stats.waiting == 0 and stats.resident <= 8
    assert stats.counters["gpu_evictions"] > 0


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["acq", "rel", "inv"]), st.integers(0, 5)), min_size=1, max_size=120))
def test_pool_byte_accounting_is_exact(adapter_root_cached, ops) -> None:
    mgr = _manager(adapter_root_cached, 3)
    held: list = []
    for op, i in ops:
        if op == "acq":
            try:
                held.append(mgr.acquire(f"a{i}"))
            except ResourceExhaustedError:
                pass
        elif op == "rel" and held:
            mgr.release(held.pop(i % len(held)))
        elif op == "inv":
            mgr.invalidate(f"a{i}")
        live = {id(r): r for r in held} | {id(r): r for r in mgr._resident.values()}
        expected = sum(-(-r.layout.num_elements // 64) * 64 for r in live.values()) * 4
        assert mgr.stats().used_bytes == expected
    for ra in held:
        mgr.release(ra)


def test_host_arena_never_overwrites_a_leased_entry() -> None:
    from loraplex.inference_server.lora.pool.host_cache import HostAdapterCache, PackedAdapter
    from loraplex.inference_server.lora.resident import AdapterLayout

    layout = AdapterLayout((0,) * 7, (0.0,) * 7, (0,) * 7, (0,) * 7, 64)
    cache = HostAdapterCache(2 * 64 * 4)
    entries = []
    for name in ("x", "y"):
        buf, start = cache.reserve(64, torch.float32)
        buf.fill_(ord(name))
        entries.append(cache.insert(PackedAdapter(name, "v1", buf, layout, start)))  # leased
    cache.release(entries[1])  # y idle, x still leased
    buf, start = cache.reserve(64, torch.float32)  # evicts y, not x
    assert start == entries[1].start and torch.all(entries[0].flat == ord("x"))
    cache.invalidate("x")  # leased: stays allocated until released
    assert cache.reserve(64, torch.float32)[1] == -1  # arena full: a standalone buffer, not cached
    cache.release(entries[0])
    assert cache.reserve(64, torch.float32)[1] == entries[0].start


def test_a_cold_load_checks_the_adapter_once_when_the_source_checked_it_against_this_base(
    adapter_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The source validates an adapter against its base model; the manager checks it again
    only when that base is not its own (a cold load parsed every adapter twice)."""
    import loraplex.inference_server.lora.pool.adapter_pool as manager_module

    calls: list[ModelConfig] = []
    parse = manager_module.parse_adapter_files
    monkeypatch.setattr(manager_module, "parse_adapter_files",
                        lambda files, base, **kw: calls.append(base) or parse(files, base, **kw))
    mgr = _manager(adapter_root, 3)
    mgr.release(mgr.acquire("a0"))
    assert calls == []
    other = ModelConfig(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2,
                        num_heads=4, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-5 / 2)
    assert other != CFG
    checked_elsewhere = AdapterPool(LocalAdapterDirectory(adapter_root, other), CFG, mgr._alloc.capacity,
                                       torch.float32, "cpu")
    checked_elsewhere.release(checked_elsewhere.acquire("a1"))
    assert calls == [CFG]
