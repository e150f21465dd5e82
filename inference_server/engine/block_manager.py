"""KV cache block bookkeeping (plain Python): free blocks, per-sequence block tables, and the
prefix cache (engine/prefix_cache.py).

With prefix caching a block can be in several tables at once (a shared prompt prefix), so
blocks are reference counted. A block whose last table lets go goes back to the free list,
unless it holds a cached prefix: then it stays in the prefix index as unused, counts as free,
and is given out (its digest forgotten) only once the plain free blocks are gone, oldest first.
"""

from __future__ import annotations

from collections.abc import Sequence

from loraplex.inference_server.engine.prefix_cache import PrefixIndex


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"need num_blocks > 0 and block_size > 0, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() takes the lowest
        self._refs = [0] * num_blocks
        self._index = PrefixIndex()
        self.prefix_queried_tokens = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hit_tokens = 0  # of those, found cached (not computed again)

    @property
    def num_free(self) -> int:
        return len(self._free) + self._index.num_unused

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_grow(self, table: list[int], num_tokens: int, keep_free: int = 0) -> bool:
        """Whether ``table`` can be extended to hold ``num_tokens`` tokens with ``keep_free``
        blocks still free afterwards."""
        return self.blocks_for(num_tokens) - len(table) + keep_free <= self.num_free

    def grow(self, table: list[int], num_tokens: int) -> None:
        """Append blocks to ``table`` until it holds ``num_tokens`` tokens (checked first)."""
        need = self.blocks_for(num_tokens) - len(table)
        if need > self.num_free:
            raise RuntimeError(f"KV cache: {need} blocks needed, {self.num_free} free")
        for _ in range(need):
            block = self._free.pop() if self._free else self._index.evict()
            self._refs[block] = 1
            table.append(block)

    def free(self, table: list[int]) -> None:
        for block in reversed(table):
            self._refs[block] -= 1
            if self._refs[block] == 0:
                if self._index.holds(block):
                    self._index.release(block)
                else:
                    self._free.append(block)
        table.clear()

    def slot(self, table: list[int], position: int) -> int:
        """Cache slot of token ``position`` of the sequence owning ``table``."""
        return table[position // self.block_size] * self.block_size + position % self.block_size

    # -- prefix caching -----------------------------------------------------------------------
    def match_prefix(self, table: list[int], digests: Sequence[bytes], prompt_len: int) -> int:
        """Start an empty ``table`` with the cached blocks of the longest known prefix of a prompt
        of ``prompt_len`` tokens whose full blocks are ``digests``; return the tokens they hold.
        The prompt's last token is always computed (its logits start the generation), so a
        prompt of whole blocks reuses all but its last block."""
        if table:
            raise ValueError("match_prefix needs an empty block table")
        usable = digests[: (prompt_len - 1) // self.block_size] if self.prefix_caching else ()
        for digest in usable:
            block = self._index.lookup(digest)
            if block is None:
                break
            if self._refs[block] == 0:
                self._index.use(block)
            self._refs[block] += 1
            table.append(block)
        return len(table) * self.block_size

    def note_prefix(self, prompt_len: int, matched: int) -> None:
        """Count an admitted prompt: ``matched`` of its ``prompt_len`` tokens came from the cache."""
        self.prefix_queried_tokens += prompt_len
        self.prefix_hit_tokens += matched

    def cache_computed(self, table: list[int], digests: Sequence[bytes], num_computed: int) -> None:
        """Name the full prompt blocks of ``table`` whose KV is computed (the first
        ``num_computed`` tokens) by their digests, so later prompts can reuse them."""
        if not self.prefix_caching:
            return
        for block, digest in zip(table[: num_computed // self.block_size], digests):
            self._index.add(block, digest)
