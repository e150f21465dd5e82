"""KV cache block bookkeeping (plain Python): free list and per-sequence block tables."""

from __future__ import annotations


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"need num_blocks > 0 and block_size > 0, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() takes the lowest

    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_grow(self, table: list[int], num_tokens: int) -> bool:
        """Whether ``table`` can be extended to hold ``num_tokens`` tokens."""
        return self.blocks_for(num_tokens) - len(table) <= len(self._free)

    def grow(self, table: list[int], num_tokens: int) -> None:
        """Append blocks to ``table`` until it holds ``num_tokens`` tokens (checked first)."""
        need = self.blocks_for(num_tokens) - len(table)
        if need > len(self._free):
            raise RuntimeError(f"KV cache: {need} blocks needed, {len(self._free)} free")
        for _ in range(need):
            table.append(self._free.pop())

    def free(self, table: list[int]) -> None:
        self._free.extend(reversed(table))
        table.clear()

    def slot(self, table: list[int], position: int) -> int:
        """Cache slot of token ``position`` of the sequence owning ``table``."""
        return table[position // self.block_size] * self.block_size + position % self.block_size
