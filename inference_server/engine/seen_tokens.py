"""The repetition penalty's "seen tokens" of each penalized sequence, kept on the device.

A penalized row's penalty applies once to every distinct token its sequence has seen (prompt
and output). Rebuilding that set each step from the host's token ids costs the host
O(prompt + output) Python per penalized row, every step: at a few thousand tokens a
sequence that is milliseconds a step, which a launched step cannot hide. Here each such
sequence owns a row of V bools on the device that grows by its new tokens only, so a step's
host work is O(rows): the tokens the host learned since the last step, and the newest token
of a launched step's input, which is still on the device (scattered there from its tensor).

Nothing here reads back to the host or copies from pageable memory: index lists reach the
device through pinned memory (``sampler.to_device``) and rows are set with ``index_fill_``'s
scalar form (``t[i, j] = True`` on a CUDA tensor would copy the Python ``True`` to the device
with a blocking copy, a stream sync that waits for the step in flight).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from loraplex.inference_server.engine.sampler import to_device
from loraplex.inference_server.engine.sequence import PLACEHOLDER, Sequence


@dataclass(eq=False, slots=True)
class _Entry:
    seq: Sequence  # held, so its id() stays this sequence's while the entry lives
    slot: int  # its row in SeenTokens' table
    counted: int  # token_ids[:counted] are set in that row


class SeenTokens:
    """Per penalized sequence in the step, a device row of V bools: the token ids it has seen.

    ``mask`` keeps the rows of the sequences it is called with and frees the others' (a
    sequence that comes back, after a preemption say, is rebuilt from its token ids once).
    The table (``max_seqs`` rows and an all-False one, V from the logits) is allocated on the
    first penalized step, so servers whose requests have no penalty never hold it."""

    def __init__(self, max_seqs: int) -> None:
        self._capacity = max_seqs
        self._table: torch.Tensor | None = None  # bool [max_seqs + 1, V]; row max_seqs stays False
        self._entries: dict[int, _Entry] = {}  # id(seq) -> its row
        self._free: list[int] = list(range(max_seqs))

    def mask(self, seqs: Seq[Sequence], vocab: int, device: torch.device,
             newest: tuple[list[int], torch.Tensor] | None = None) -> torch.Tensor | None:
        """bool [len(seqs), vocab] on ``device``: row i marks the tokens sequence i has seen if
        it has a repetition penalty (placeholders skipped), else nothing; None when no row has a
        penalty. ``newest``: (rows, int64 token ids on the device) of rows whose last token is
        a placeholder still being sampled on the device (a launched step's input): set too."""
        penalized = [i for i, s in enumerate(seqs) if s.request.sampling.repetition_penalty != 1.0]
        if not penalized:
            return None
        table = self._table_for(vocab, device)
        self._keep_only({id(seqs[i]) for i in penalized})
        slot_of_row = [self._capacity] * len(seqs)  # rows without a penalty read the all-False row
        fresh: list[int] = []
        flat: list[int] = []
        for i in penalized:
            entry = self._entry(seqs[i], fresh)
            slot_of_row[i] = entry.slot
            flat += [entry.slot * vocab + t for t in _new_ids(entry)]
        flat_table = table.view(-1)
        if fresh:
            table.index_fill_(0, to_device(fresh, device), False)
        if flat:
            flat_table.index_fill_(0, to_device(flat, device), True)
        if newest is not None and newest[0]:
            slots = to_device([slot_of_row[i] for i in newest[0]], device)
            flat_table.index_fill_(0, slots * vocab + newest[1], True)
        return table.index_select(0, to_device(slot_of_row, device))

    def _table_for(self, vocab: int, device: torch.device) -> torch.Tensor:
        if self._table is None or self._table.shape[1] != vocab or self._table.device != device:
            self._table = torch.zeros(self._capacity + 1, vocab, dtype=torch.bool, device=device)
            self._entries.clear()
            self._free = list(range(self._capacity))
        return self._table

    def _keep_only(self, live: set[int]) -> None:
        """Free the rows of sequences not in this step (finished, preempted, aborted)."""
        for key in [k for k in self._entries if k not in live]:
            self._free.append(self._entries.pop(key).slot)

    def _entry(self, seq: Sequence, fresh: list[int]) -> _Entry:
        """``seq``'s entry; a new one takes a free row, listed in ``fresh`` to be cleared."""
        entry = self._entries.get(id(seq))
        if entry is not None and entry.seq is seq:
            return entry
        if not self._free:
            raise RuntimeError(f"more than {self._capacity} penalized sequences in one step")
        entry = self._entries[id(seq)] = _Entry(seq, self._free.pop(), 0)
        fresh.append(entry.slot)
        return entry


def _new_ids(entry: _Entry) -> list[int]:
    """The token ids the host learned since the entry was last updated (placeholders, only
    ever last, stay for later), and the entry moved past them."""
    ids = entry.seq.token_ids
    known = len(ids)
    while known > entry.counted and ids[known - 1] == PLACEHOLDER:
        known -= 1
    new = [t for t in ids[entry.counted : known] if t >= 0]
    entry.counted = max(entry.counted, known)
    return new
