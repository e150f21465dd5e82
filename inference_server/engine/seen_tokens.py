"""The penalties' token history of each penalized sequence, kept on the device: the repetition
penalty's "seen tokens" (``SeenTokens``: prompt and output, one bool a token) and the presence
and frequency penalties' output counts (``OutputCounts``: output only, an int32 count a token).

A penalized row's penalty applies once to every distinct token its sequence has seen (prompt
and output). Rebuilding that set each step from the host's token ids costs the host
O(prompt + output) Python per penalized row, every step: at a few thousand tokens a
sequence that is milliseconds a step, which a launched step cannot hide. Here each such
sequence owns a row of V bools on the device that grows by its new tokens only, so a step's
host work is O(rows): the tokens the host learned since the last step, and the newest token
of a launched step's input, which is still on the device (scattered there from its tensor).

Each token position is added once (a launched step's newest token from the device, then never
again from the host), which the counts need and the bools do not mind.

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
    slot: int  # its row in the table
    counted: int  # token_ids[:counted] are in that row


class _TokenRows:
    """Per tracked sequence in the step, a device row of V entries built from its tokens.

    ``rows`` keeps the rows of the sequences it is called with and frees the others' (a
    sequence that comes back, after a preemption say, is rebuilt from its token ids once).
    The table (``max_seqs`` rows and an all-zero one, V from the logits) is allocated on the
    first step that tracks a row, so servers whose requests never need it never hold it."""

    dtype: torch.dtype = torch.bool

    def __init__(self, max_seqs: int) -> None:
        self._capacity = max_seqs
        self._table: torch.Tensor | None = None  # [max_seqs + 1, V]; row max_seqs stays zero
        self._entries: dict[int, _Entry] = {}  # id(seq) -> its row
        self._free: list[int] = list(range(max_seqs))

    def tracks(self, seq: Sequence) -> bool:
        """Whether ``seq``'s sampling needs this history."""
        raise NotImplementedError

    def first_position(self, seq: Sequence) -> int:
        """The first token position the history holds (0: the prompt too)."""
        return 0

    def mask(self, seqs: Seq[Sequence], vocab: int, device: torch.device,
             newest: tuple[list[int], torch.Tensor] | None = None) -> torch.Tensor | None:
        """[len(seqs), vocab] on ``device``: row i is sequence i's history if tracked, else
        zeros; None when no row is tracked. ``newest``: (rows, int64 token ids on the device) of
        rows whose last token is a placeholder still being sampled on the device (a launched
        step's input): added too (rows this history does not track are skipped)."""
        tracked = [i for i, s in enumerate(seqs) if self.tracks(s)]
        if not tracked:
            return None
        table = self._table_for(vocab, device)
        self._keep_only({id(seqs[i]) for i in tracked})
        slot_of_row = [self._capacity] * len(seqs)  # untracked rows read the all-zero row
        fresh: list[int] = []
        flat: list[int] = []
        entries = {}
        for i in tracked:
            entry = entries[i] = self._entry(seqs[i], fresh)
            slot_of_row[i] = entry.slot
            flat += [entry.slot * vocab + t for t in self._new_ids(entry)]
        if fresh:
            table.index_fill_(0, to_device(fresh, device), 0)
        if flat:
            self._add(table.view(-1), to_device(flat, device))
        if newest is not None:
            self._add_newest(table, vocab, newest, entries, slot_of_row)
        return table.index_select(0, to_device(slot_of_row, device))

    def _add_newest(self, table: torch.Tensor, vocab: int, newest: tuple[list[int], torch.Tensor],
                    entries: dict[int, _Entry], slot_of_row: list[int]) -> None:
        picks = [(k, i) for k, i in enumerate(newest[0]) if i in entries]
        if not picks:
            return
        for _, i in picks:  # the placeholder's position is in the row from now on
            entry = entries[i]
            entry.counted = max(entry.counted, len(entry.seq.token_ids))
        tokens = newest[1]
        if len(picks) != len(newest[0]):
            tokens = tokens.index_select(0, to_device([k for k, _ in picks], tokens.device))
        slots = to_device([slot_of_row[i] for _, i in picks], tokens.device)
        self._add(table.view(-1), slots * vocab + tokens)

    def _add(self, flat_table: torch.Tensor, where: torch.Tensor) -> None:
        flat_table.index_fill_(0, where, True)

    def _table_for(self, vocab: int, device: torch.device) -> torch.Tensor:
        if self._table is None or self._table.shape[1] != vocab or self._table.device != device:
            self._table = torch.zeros(self._capacity + 1, vocab, dtype=self.dtype, device=device)
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
        entry = self._entries[id(seq)] = _Entry(seq, self._free.pop(), self.first_position(seq))
        fresh.append(entry.slot)
        return entry

    @staticmethod
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


class SeenTokens(_TokenRows):
    """bool rows: the tokens each repetition-penalized sequence has seen, prompt included."""

    def tracks(self, seq: Sequence) -> bool:
        return seq.request.sampling.repetition_penalty != 1.0


class OutputCounts(_TokenRows):
    """int32 rows: how often each token occurs in the output of each sequence with a presence
    or frequency penalty."""

    dtype = torch.int32

    def tracks(self, seq: Sequence) -> bool:
        return seq.request.sampling.counts_output

    def first_position(self, seq: Sequence) -> int:
        return seq.num_prompt

    def _add(self, flat_table: torch.Tensor, where: torch.Tensor) -> None:
        flat_table.index_add_(0, where, torch.ones(where.shape, dtype=self.dtype, device=where.device))
