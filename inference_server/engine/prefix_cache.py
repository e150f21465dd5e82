"""Prefix caching: which full KV blocks already hold a given prompt prefix, for which adapter.

A full block of a prompt is named by a chain digest: blake2b over the previous block's
digest, the adapter's id and content version, and the block's token ids. Two requests share a
block only when everything before it and in it is the same and they use the same adapter
version, so KV computed under one adapter (whose q/k/v projections it changed) is never read
under another, nor under the base model, nor after a re-upload. A 128-bit digest makes an
accidental collision negligible (a Python ``hash`` of 64 bits would not be, over millions of
blocks).

``PrefixIndex`` knows which block holds which digest, and keeps the blocks nobody uses any
more, least recently freed first, so they are reused on a hit and given out last on a miss.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence

_ROOT = b""


def block_digests(token_ids: Sequence[int], block_size: int, adapter_key: str) -> list[bytes]:
    """The chain digest of every full block of ``token_ids``, in order."""
    salt = adapter_key.encode()
    digests, prev = [], _ROOT
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        h = hashlib.blake2b(digest_size=16)
        h.update(prev)
        h.update(len(salt).to_bytes(4, "little"))
        h.update(salt)
        h.update(array("q", token_ids[start : start + block_size]).tobytes())
        prev = h.digest()
        digests.append(prev)
    return digests


class PrefixIndex:
    """digest <-> block for blocks whose KV is known, and the unused ones among them (LRU)."""

    def __init__(self) -> None:
        self._block_of: dict[bytes, int] = {}
        self._digest_of: dict[int, bytes] = {}
        self._unused: OrderedDict[int, None] = OrderedDict()  # oldest first

    @property
    def num_unused(self) -> int:
        return len(self._unused)

    def lookup(self, digest: bytes) -> int | None:
        return self._block_of.get(digest)

    def holds(self, block: int) -> bool:
        return block in self._digest_of

    def add(self, block: int, digest: bytes) -> None:
        """``block`` (in use, full, computed) now holds ``digest``; a digest another block already
        holds keeps that block (the two hold the same KV)."""
        if block in self._digest_of or digest in self._block_of:
            return
        self._block_of[digest] = block
        self._digest_of[block] = digest

    def use(self, block: int) -> None:
        """An unused cached block is taken again (a hit)."""
        self._unused.pop(block, None)

    def release(self, block: int) -> None:
        """A cached block's last user is gone: keep its KV, most recently freed last."""
        self._unused[block] = None

    def evict(self) -> int:
        """Forget the least recently freed unused block and give it out."""
        block, _ = self._unused.popitem(last=False)
        del self._block_of[self._digest_of.pop(block)]
        return block
