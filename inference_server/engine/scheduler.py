"""Continuous batching (plain Python): which sequences run this step, and how many tokens.

Each step first gives every running sequence its next chunk (one token for a decode, the
rest of a prompt for a chunked prefill), then admits waiting sequences while the token
budget, the batch size and the KV blocks allow: round-robin across tenants, FCFS within a
tenant (fair_queue.py), so one tenant's flood cannot starve another. When blocks run out, the newest running
sequence is preempted: its blocks are freed and it goes back to the front of the queue,
to be recomputed later (never dropped).

Admission keeps headroom: a waiting sequence is admitted only if the blocks it takes leave room
for every running sequence to decode ``admission_headroom_tokens`` more tokens. Without it a
preempted sequence came back as soon as its own freed blocks allowed, recomputed its whole
context in one long step (every other row's token waits for it), and was the newest again when
blocks next ran out. bench_textgen at max batch 128 on an H100 (384 requests, 4538 KV blocks):
791 preemptions and a per-token p99 of 294 ms without headroom, 53 and 45 ms with 64 tokens
(benchmarks/RESULTS.md; benchmarks/engine/replay_scheduler.py replays the scheduler alone).

A sequence admitted with nothing computed starts from the longest prompt prefix already in the
KV cache for the same adapter version (prefix caching, engine/prefix_cache.py): only the rest
of its prompt is computed. Each step's computed full prompt blocks are named for later prompts
(``computed``). Requests of one prompt group (the ``n`` choices of one prompt) take turns: while
one of them is computing the shared prompt, the next waits at the head of the queue, then starts
from that prompt's cached blocks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from loraplex.inference_server.engine.block_manager import BlockManager
from loraplex.inference_server.engine.fair_queue import FairQueue
from loraplex.inference_server.engine.prefix_cache import block_digests
from loraplex.inference_server.engine.sequence import Sequence, SeqStatus


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    # tokens of room per running sequence an admission leaves free (0: none; --admission-headroom-tokens)
    admission_headroom_tokens: int = 64


@dataclass(slots=True)
class ScheduledBatch:
    seqs: list[Sequence]
    num_tokens: list[int]  # this step's new tokens per sequence
    preempted: list[Sequence]

    @property
    def empty(self) -> bool:
        return not self.seqs


class Scheduler:
    def __init__(self, config: SchedulerConfig, blocks: BlockManager) -> None:
        self.config = config
        self.blocks = blocks
        self.waiting = FairQueue()
        self.running: list[Sequence] = []
        self.num_preemptions = 0  # total, for metrics and tests

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, seq: Sequence) -> None:
        """Take a finished or aborted sequence out and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free(seq.block_table)

    def schedule(self, exclude: frozenset[int] = frozenset()) -> ScheduledBatch:
        """exclude: ids (``id(seq)``) of running sequences to leave out of this step (they
        stay running): the engine's sequences whose in-flight token is their last."""
        batch = ScheduledBatch([], [], [])
        budget = self.config.max_num_batched_tokens
        budget = self._schedule_running(batch, budget, exclude)
        if not batch.preempted:
            self._admit_waiting(batch, budget)
        now = time.monotonic()
        for seq in batch.seqs:
            if seq.first_scheduled is None:
                seq.first_scheduled = now
        return batch

    def _schedule_running(self, batch: ScheduledBatch, budget: int, exclude: frozenset[int]) -> int:
        queue = [s for s in self.running if id(s) not in exclude]
        while queue and budget > 0:
            seq = queue.pop(0)
            chunk = min(seq.num_pending, budget)
            while not self.blocks.can_grow(seq.block_table, seq.num_computed + chunk):
                victim = queue.pop() if queue else seq
                self._preempt(victim, batch)
                if victim is seq:
                    break
            else:
                self.blocks.grow(seq.block_table, seq.num_computed + chunk)
                batch.seqs.append(seq)
                batch.num_tokens.append(chunk)
                budget -= chunk
        return budget

    def _preempt(self, seq: Sequence, batch: ScheduledBatch) -> None:
        self.running.remove(seq)
        self.blocks.free(seq.block_table)
        seq.num_computed = 0
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        batch.preempted.append(seq)

    def _admit_waiting(self, batch: ScheduledBatch, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            fresh = seq.num_computed == 0 and not seq.block_table
            if fresh and self._sibling_computing_prompt(seq):
                break  # one step or a few: then its prompt's blocks are cached for it
            if fresh and seq.reuses_prefix:
                seq.num_computed = self.blocks.match_prefix(seq.block_table, self._digests(seq), seq.num_prompt)
            chunk = min(seq.num_pending, budget)
            if not self.blocks.can_grow(seq.block_table, seq.num_computed + chunk, keep_free=self._headroom_blocks()):
                if fresh:  # give the matched blocks back until it is admitted
                    self.blocks.free(seq.block_table)
                    seq.num_computed = 0
                break  # the head waits for blocks, nobody overtakes it
            if fresh:
                self.blocks.note_prefix(seq.num_prompt, seq.num_computed)
            self.waiting.popleft()
            self.blocks.grow(seq.block_table, seq.num_computed + chunk)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            batch.seqs.append(seq)
            batch.num_tokens.append(chunk)
            budget -= chunk

    def _headroom_blocks(self) -> int:
        """Blocks an admission must leave free: room for every running sequence to decode
        ``admission_headroom_tokens`` more tokens (counted together, in whole blocks), at most a
        quarter of the cache (a small cache still runs sequences side by side)."""
        wanted = -(-len(self.running) * self.config.admission_headroom_tokens // self.blocks.block_size)
        return min(wanted, self.blocks.num_blocks // 4)

    def _sibling_computing_prompt(self, seq: Sequence) -> bool:
        """Whether a running request of ``seq``'s prompt group is still computing that prompt
        (only with prefix caching, which is how the others share it)."""
        group = seq.request.prompt_group
        if group is None or not self.blocks.prefix_caching or not seq.reuses_prefix:
            return False
        return any(s.request.prompt_group == group and s.num_computed < s.num_prompt for s in self.running)

    def computed(self, seq: Sequence) -> None:
        """``seq.num_computed`` grew: name its newly computed full prompt blocks for reuse."""
        if self.blocks.prefix_caching:
            self.blocks.cache_computed(seq.block_table, self._digests(seq), min(seq.num_computed, seq.num_prompt))

    def _digests(self, seq: Sequence) -> list[bytes]:
        if not self.blocks.prefix_caching:
            return []
        if seq.prefix_digests is None:
            seq.prefix_digests = block_digests(seq.request.prompt_token_ids, self.blocks.block_size, seq.kv_key)
        return seq.prefix_digests
