"""Prefix caching: a prompt prefix's KV blocks are reused by later requests of the same adapter
version (never of another), the answer is the one computed from scratch, and cached blocks are
given out again, least recently freed first, once the free ones run out."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from loraplex.inference_server.engine.block_manager import BlockManager
from loraplex.inference_server.engine.detokenizer import IncrementalDetokenizer
from loraplex.inference_server.engine.prefix_cache import block_digests
from loraplex.inference_server.engine.request import GenerationRequest, StoppingCriteria
from loraplex.inference_server.engine.scheduler import Scheduler, SchedulerConfig
from loraplex.inference_server.engine.sequence import Sequence
from lora_helpers import ADAPTER_CONFIGS, collect, greedy_request, load_engine, make_test_adapters, tokens_of

BS = 4


def test_digests_name_the_whole_prefix_and_the_adapter_version() -> None:
    tokens = list(range(1, 14))
    base = block_digests(tokens, BS, "")
    assert len(base) == 3 and base == block_digests(tokens, BS, "")
    assert block_digests(tokens, BS, "acme/a@v1")[0] != base[0]
    assert block_digests(tokens, BS, "acme/a@v1") != block_digests(tokens, BS, "acme/a@v2")
    changed = block_digests([99, *tokens[1:]], BS, "")
    assert all(a != b for a, b in zip(changed, base)), "a change in block 0 renames every later block"
    assert block_digests(tokens[:4] + [0] * 4, BS, "")[0] == base[0]


def _prompt_blocks(blocks: BlockManager, tokens: list[int], key: str = "") -> tuple[list[int], list[bytes]]:
    table: list[int] = []
    digests = block_digests(tokens, BS, key)
    matched = blocks.match_prefix(table, digests, len(tokens))
    blocks.grow(table, len(tokens))
    blocks.cache_computed(table, digests, len(tokens))
    return table, digests[: matched // BS]


def test_freed_prompt_blocks_are_reused_and_all_but_the_last_token_is_matched() -> None:
    blocks = BlockManager(16, BS)
    table, _ = _prompt_blocks(blocks, list(range(1, 13)))  # 3 full blocks
    first = list(table)
    blocks.free(table)
    assert blocks.num_free == 16, "cached blocks count as free"
    table: list[int] = []
    digests = block_digests(list(range(1, 13)), BS, "")
    assert blocks.match_prefix(table, digests, 12) == 8, "the last token is computed: 2 of 3 blocks"
    assert table == first[:2]
    other: list[int] = []
    assert blocks.match_prefix(other, block_digests(list(range(1, 13)), BS, "acme/a@v1"), 12) == 0
    longer: list[int] = []
    assert blocks.match_prefix(longer, block_digests(list(range(1, 20)), BS, ""), 19) == 12
    assert longer == first, "both tables share the blocks (reference counted)"
    blocks.free(table)
    assert blocks.num_free == 16 - 3, "the longer prompt still holds all three"
    blocks.free(longer)
    assert blocks.num_free == 16


def test_cached_blocks_are_given_out_only_after_the_free_ones_least_recently_freed_first() -> None:
    blocks = BlockManager(6, BS)
    table_a, _ = _prompt_blocks(blocks, [1] * 8)  # 2 blocks
    table_b, _ = _prompt_blocks(blocks, [2] * 8)
    a, b = list(table_a), list(table_b)
    blocks.free(table_a)
    blocks.free(table_b)
    plain: list[int] = []
    blocks.grow(plain, 8)  # the 2 never-cached blocks first
    assert not set(plain) & set(a + b)
    blocks.grow(plain, 12)  # then the least recently freed cached block: a's last
    assert plain[2] in a
    lost: list[int] = []
    assert blocks.match_prefix(lost, block_digests([1] * 9, BS, ""), 9) == 4, "a's first block survives"
    kept: list[int] = []
    assert blocks.match_prefix(kept, block_digests([2] * 9, BS, ""), 9) == 8


def test_prefix_caching_off_never_matches() -> None:
    blocks = BlockManager(8, BS, prefix_caching=False)
    table, _ = _prompt_blocks(blocks, list(range(1, 10)))
    blocks.free(table)
    again: list[int] = []
    assert blocks.match_prefix(again, block_digests(list(range(1, 10)), BS, ""), 9) == 0


class _NoText:
    def decode(self, ids, skip_special_tokens=True):
        return ""


def _seq(rid: str, prompt: list[int], tenant: str | None = None) -> Sequence:
    request = GenerationRequest(rid, tuple(prompt), stopping=StoppingCriteria(max_new_tokens=10), tenant=tenant)
    return Sequence.create(request, None, IncrementalDetokenizer(_NoText(), []), None)


def test_the_scheduler_gives_a_repeated_prefix_only_its_new_tokens() -> None:
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), BlockManager(32, BS))
    system = list(range(1, 21))  # 5 blocks
    first = _seq("a", system + [30, 31])
    sched.add(first)
    batch = sched.schedule()
    assert batch.num_tokens == [22]
    first.num_computed += 22
    sched.computed(first)
    sched.add(_seq("b", system + [40, 41, 42]))
    batch = sched.schedule()
    assert [(s.request_id, n) for s, n in zip(batch.seqs, batch.num_tokens)][-1] == ("b", 3)
    assert sched.blocks.prefix_hit_tokens == 20 and sched.blocks.prefix_queried_tokens == 22 + 23


def test_a_prompt_s_cached_blocks_serve_its_own_tenant_only() -> None:
    """Tenant b's request finds nothing of tenant a's identical prompt in the cache (a hit would
    make b's first token come sooner: b could time whether a sent it); a's next request finds it."""
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), BlockManager(32, BS))
    system = list(range(1, 21))
    first = _seq("a1", system + [30], tenant="a")
    sched.add(first)
    sched.schedule()
    first.num_computed += 21
    sched.computed(first)
    for rid, tenant, hits in (("b1", "b", 0), ("a2", "a", 20), ("no tenant", None, 0)):
        before = sched.blocks.prefix_hit_tokens
        seq = _seq(rid, system + [40], tenant=tenant)
        sched.add(seq)
        sched.schedule()
        assert sched.blocks.prefix_hit_tokens - before == hits, rid
        seq.num_computed += 21 - hits
        sched.computed(seq)


@pytest.fixture(scope="module")
def adapter_dir(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_test_adapters(tiny_llama_dir, tmp_path_factory.mktemp("adapters"))


def test_a_shared_system_prompt_is_computed_once_per_adapter_and_changes_no_token(
        tiny_llama_dir: Path, adapter_dir: Path) -> None:
    cached = load_engine(tiny_llama_dir, adapter_dir, block_size=4)
    fresh = load_engine(tiny_llama_dir, adapter_dir, block_size=4, prefix_caching=False)
    system = cached.tokenizer.encode("You are a helpful assistant. Answer briefly and politely, please.")
    adapter = next(iter(ADAPTER_CONFIGS))
    questions = [cached.tokenizer.encode(q) for q in (" What is 2+2?", " Name a colour.", " Say hi.")]

    def requests(prefix: str) -> list[GenerationRequest]:
        return [greedy_request(f"{prefix}{i}-{name}", system + q, name, 12)
                for i, q in enumerate(questions) for name in (None, adapter)]

    def rounds(engine) -> tuple[dict, dict, int]:
        """Round a (nothing cached yet), then round b; and the hits round a left behind."""
        async def main():
            await engine.start()
            try:
                first = await asyncio.gather(*(collect(engine, r) for r in requests("a")))
                hits = engine.stats().prefix_hit_tokens
                second = await asyncio.gather(*(collect(engine, r) for r in requests("b")))
            finally:
                await engine.shutdown()
            return ({r.request_id: tokens_of(e) for r, e in zip(requests("a"), first)},
                    {r.request_id: tokens_of(e) for r, e in zip(requests("b"), second)}, hits)
        return asyncio.run(main())

    first, second, hits_after_first = rounds(cached)
    expected_first, expected_second, _ = rounds(fresh)
    assert first == expected_first and second == expected_second
    shared = len(system) // 4 * 4
    assert cached.stats().prefix_hit_tokens - hits_after_first >= len(requests("b")) * shared, \
        "every second-round request reuses the system prompt's blocks for its own adapter"
    assert fresh.stats().prefix_hit_tokens == 0
    assert cached.stats().free_kv_blocks == cached.stats().total_kv_blocks


def test_the_prefix_cache_counts_are_prometheus_counters() -> None:
    from prometheus_client import generate_latest  # noqa: PLC0415
    from prometheus_client.parser import text_string_to_metric_families  # noqa: PLC0415

    from loraplex.inference_server.engine.info import EngineStats  # noqa: PLC0415
    from loraplex.inference_server.edge.metrics import ServerMetrics  # noqa: PLC0415

    metrics = ServerMetrics()
    stats = EngineStats(num_running=0, num_waiting=0, free_kv_blocks=4, total_kv_blocks=4, resident_adapters=0,
                        preemptions=0, prefix_queried_tokens=120, prefix_hit_tokens=80)
    metrics.bind_engine_stats(lambda: stats)
    families = {f.name: f for f in text_string_to_metric_families(generate_latest(metrics.registry).decode())}
    for name, value in (("loraplex_prefix_cache_queried_tokens", 120), ("loraplex_prefix_cache_hit_tokens", 80)):
        assert families[name].type == "counter"
        assert [s.value for s in families[name].samples if s.name.endswith("_total")] == [value]
