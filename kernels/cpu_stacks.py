"""Stacked A/B of CPU decode batches, kept across steps and updated one adapter at a time.

A decode batch (every segment one row, one rank per slice) runs each slice of a fused
projection as two batched products over A [n, h_in, r] and B [n, r, w] stacked from the
adapters' pool places. Copying every adapter of the batch whenever the batch changes (a
request finishes, another joins) costs more than several decode steps, so the stacks live
in slots: slot s of every layer holds one adapter's A/B, the batch's n adapters take slots
0..n-1, an adapter that stays keeps its slot, and only slots whose adapter changed are
copied again (per layer, on first use). Rows reach their slot through an index (x rows
gathered in slot order, products put back in row order before the add); each row's floats
are the same as the reference's, since a batched product of one-row operands is its per-row
product.

A write to the pool (an adapter loaded into a freed place) changes the pool's write count
(``Tensor._version``). Writes announced through ``note_write`` (the adapter manager's loads)
make stale only the slots whose places they cover; any other change of the count makes every
slot stale (copied again into the same buffers). A batch larger than the slots gets new ones
(doubling).
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

# One row's adapter in a fused projection: (a offset, b offset) per batched slice.
PlaceKey = tuple[tuple[int, int], ...]


@dataclass(frozen=True, slots=True)
class DecodeLayout:
    """What one call's decode batch reads: per slice (rank, A offsets, B offsets, scales) by
    row, or None for a slice that is not batched."""

    h_in: int
    widths: tuple[int, ...]
    places: tuple[tuple[int, tuple[int, ...], tuple[int, ...], tuple[float, ...]] | None, ...]
    dtype: torch.dtype  # the pool's

    @property
    def rows(self) -> int:
        return len(next(p for p in self.places if p is not None)[1])

    def row_keys(self) -> list[PlaceKey]:
        batched = [p for p in self.places if p is not None]
        return [tuple((p[1][i], p[2][i]) for p in batched) for i in range(self.rows)]

    def shape_key(self, pool: torch.Tensor) -> tuple:
        ranks = tuple(None if p is None else p[0] for p in self.places)
        return (pool.data_ptr(), pool.dtype, self.h_in, self.widths, ranks)


@dataclass(frozen=True, slots=True)
class SliceOperands:
    """One batched slice of one layer, in slot order: A [n, h_in, r], B [n, r, w], scales [n, 1] (None: all 1)."""

    a: torch.Tensor
    b: torch.Tensor
    scale: torch.Tensor | None


@dataclass(frozen=True, slots=True)
class Assignment:
    """The batch's rows in slot order: ``order[s]`` is the row slot s serves and ``slot_of[i]``
    the slot of row i (both None: slot s serves row s)."""

    keys: tuple[PlaceKey, ...]  # slot s holds keys[s]
    order: torch.Tensor | None
    slot_of: torch.Tensor | None
    scales: tuple[torch.Tensor | None, ...]  # per slice, in slot order
    signature: tuple  # (keys, row order, scale values): equal signatures, equal assignments


@dataclass(slots=True, weakref_slot=True)
class _Slots:
    """One fused projection's slots: per layer, per slice, A and B buffers of ``capacity`` adapters."""

    capacity: int
    version: int
    serial: int  # tokens name slots by it (no reference that would keep evicted buffers alive)
    pool_ptr: int  # the pool they copy from (announced writes name it)
    a: dict[int, list[torch.Tensor | None]] = field(default_factory=dict)
    b: dict[int, list[torch.Tensor | None]] = field(default_factory=dict)
    held: dict[int, list[PlaceKey | None]] = field(default_factory=dict)  # per layer: the key each slot holds
    keys: tuple[PlaceKey, ...] = ()  # the current batch's key per slot (slots 0..n-1)
    generation: int = 0  # bumped when ``keys`` changes
    last: Assignment | None = None  # reused while the batch stays the same (steps of one batch)
    ready: dict[int, tuple[Assignment, list]] = field(default_factory=dict)  # per layer: operands of ``last``


class DecodeStacks:
    """The decode batches' stacks of up to ``max_entries`` fused projections (4: one model's
    q/k/v, o, gate/up and down), owned by the caller (one per pool); also the tables a step's
    calls read, remembered so the layers of one step read them once."""

    def __init__(self, max_entries: int = 4) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self.max_entries = max_entries
        self._slots: dict[tuple, _Slots] = {}
        self._plans: dict[tuple, tuple[object, tuple[torch.Tensor, ...]]] = {}
        self._serials = itertools.count()
        # announced writes: (pool data_ptr, count before, after, start, end)
        self._writes: deque[tuple[int, int, int, int, int]] = deque(maxlen=256)
        self.copies = 0  # (layer, slot) pairs copied from the pool, for tests and profiling

    def note_write(self, pool: torch.Tensor, start: int, end: int, before: int, after: int) -> None:
        """``pool``'s elements [start, end) were written, taking its write count from
        ``before`` to ``after`` with no other write in between (any thread)."""
        self._writes.append((pool.data_ptr(), before, after, start, end))

    def remember(self, sig: tuple, tables: tuple[torch.Tensor, ...], make: Callable[[], object]) -> object:
        """What ``make`` builds from ``tables``, once per ``sig`` (which must name the tables'
        storage and write counts); the tables are held so their memory is not reused meanwhile."""
        found = self._plans.get(sig)
        if found is not None:
            return found[0]
        if len(self._plans) >= 2 * self.max_entries:
            del self._plans[next(iter(self._plans))]
        plan = make()
        self._plans[sig] = (plan, tables)
        return plan

    def assign(self, pool: torch.Tensor, layout: DecodeLayout, previous: tuple | None) -> tuple:
        """Slots for a batch: (its Assignment, a token to pass back as ``previous`` for the
        next layer of the same call so the assignment is not redone). None: no caching
        possible (a pool without a write count): callers stack per call."""
        try:
            version = pool._version
        except RuntimeError:
            return None, None
        skey = layout.shape_key(pool)
        slots = self._slots.get(skey)
        if slots is not None and previous is not None and previous[0] == slots.serial \
                and previous[1] == slots.generation and slots.version == version:
            return previous[2], previous
        if slots is None or slots.capacity < layout.rows:
            capacity = max(layout.rows, 2 * slots.capacity if slots is not None else 0)
            slots = self._fresh(skey, _Slots(capacity, version, next(self._serials), pool.data_ptr()))
        elif slots.version != version:  # the pool was written
            self._forget_written(slots, version)
        assignment = self._place(slots, layout)
        token = (slots.serial, slots.generation, assignment)
        return assignment, token

    def operands(self, pool: torch.Tensor, layout: DecodeLayout, assignment: Assignment, layer: int
                 ) -> list[SliceOperands | None]:
        """The batched slices of ``layer`` in slot order, copying only slots whose adapter changed."""
        slots = self._slots[layout.shape_key(pool)]
        hit = slots.ready.get(layer)
        if hit is not None and hit[0] is assignment:  # a later step of the same batch
            return hit[1]
        n = len(assignment.keys)
        held = slots.held.setdefault(layer, [None] * slots.capacity)
        a_bufs = slots.a.setdefault(layer, [None] * len(layout.widths))
        b_bufs = slots.b.setdefault(layer, [None] * len(layout.widths))
        stale = [s for s in range(n) if held[s] != assignment.keys[s]]
        out: list[SliceOperands | None] = []
        for p, (place, width) in enumerate(zip(layout.places, layout.widths)):
            if place is None:
                out.append(None)
                continue
            r = place[0]
            if a_bufs[p] is None:
                a_bufs[p] = torch.empty(slots.capacity, layout.h_in, r, dtype=pool.dtype)
                b_bufs[p] = torch.empty(slots.capacity, r, width, dtype=pool.dtype)
            k = sum(1 for q in layout.places[:p] if q is not None)  # this slice's position in a key
            a_views = [pool.as_strided((layout.h_in, r), (r, 1), assignment.keys[s][k][0] + layer * layout.h_in * r)
                       for s in stale]
            b_views = [pool.as_strided((r, width), (width, 1), assignment.keys[s][k][1] + layer * r * width)
                       for s in stale]
            if len(stale) == n:  # the whole batch: one stacking copy per operand
                torch.stack(a_views, out=a_bufs[p][:n])
                torch.stack(b_views, out=b_bufs[p][:n])
            else:
                for s, a, b in zip(stale, a_views, b_views):
                    a_bufs[p][s].copy_(a)
                    b_bufs[p][s].copy_(b)
            out.append(SliceOperands(a_bufs[p][:n], b_bufs[p][:n], assignment.scales[p]))
        for s in stale:
            held[s] = assignment.keys[s]
        self.copies += len(stale)
        slots.ready[layer] = (assignment, out)
        return out

    def clear(self) -> None:
        self._slots.clear()
        self._plans.clear()

    def _forget_written(self, slots: _Slots, version: int) -> None:
        """Make stale the slots the writes since ``slots.version`` cover: only those if every
        write is announced, else all of them (the same buffers are filled again)."""
        ranges = _announced([w[1:] for w in list(self._writes) if w[0] == slots.pool_ptr], slots.version, version)
        slots.version = version
        slots.ready.clear()
        if ranges is None:
            slots.held.clear()
            slots.generation += 1
            return
        for held in slots.held.values():
            for s, key in enumerate(held):
                if key is not None and any(lo <= off < hi for pair in key for off in pair for lo, hi in ranges):
                    held[s] = None

    def _fresh(self, skey: tuple, slots: _Slots) -> _Slots:
        self._slots.pop(skey, None)
        while len(self._slots) >= self.max_entries:
            del self._slots[next(iter(self._slots))]  # the least recently created
        self._slots[skey] = slots
        return slots

    def _place(self, slots: _Slots, layout: DecodeLayout) -> Assignment:
        """Rows whose adapter already has a slot below n keep it; the others fill the rest."""
        rows = layout.row_keys()
        n = len(rows)
        keys: list[PlaceKey | None] = [None] * n
        unplaced = []
        previous = {key: s for s, key in enumerate(slots.keys)}
        for i, key in enumerate(rows):
            s = previous.pop(key, None)
            if s is not None and s < n and keys[s] is None:
                keys[s] = key
            else:
                unplaced.append(i)
        free = iter(s for s in range(n) if keys[s] is None)
        order = [0] * n
        for s, key in enumerate(keys):
            if key is not None:
                order[s] = rows.index(key)
        for i in unplaced:
            s = next(free)
            keys[s], order[s] = rows[i], i
        new_keys = tuple(keys)
        if new_keys != slots.keys:
            slots.keys = new_keys
            slots.generation += 1
        signature = (new_keys, tuple(order), tuple(None if p is None else p[3] for p in layout.places))
        if slots.last is not None and slots.last.signature == signature:
            return slots.last
        identity = order == list(range(n))
        scales = tuple(_slot_scales(place, order, identity, layout.dtype) if place is not None else None
                       for place in layout.places)
        if identity:
            assignment = Assignment(new_keys, None, None, scales, signature)
        else:
            slot_of = [0] * n
            for slot, row in enumerate(order):
                slot_of[row] = slot
            assignment = Assignment(new_keys, torch.tensor(order), torch.tensor(slot_of), scales, signature)
        slots.last = assignment
        slots.ready.clear()
        return assignment


def _announced(writes: list[tuple[int, int, int, int]], start: int, end: int) -> list[tuple[int, int]] | None:
    """The ranges of a chain of announced writes taking the write count from start to end,
    or None when some change of the count in between was not announced."""
    by_before = {before: (after, lo, hi) for before, after, lo, hi in writes}
    ranges, count = [], start
    while count != end:
        step = by_before.get(count)
        if step is None or step[0] <= count or len(ranges) > len(writes):
            return None
        count = step[0]
        ranges.append((step[1], step[2]))
    return ranges


def _slot_scales(place, order: Sequence[int], identity: bool, dtype: torch.dtype) -> torch.Tensor | None:
    scs = place[3]
    if all(s == 1.0 for s in scs):
        return None
    return torch.tensor([scs[i] for i in (range(len(scs)) if identity else order)], dtype=dtype).unsqueeze(1)


def stack_rows(pool: torch.Tensor, layout: DecodeLayout, layer: int) -> list[SliceOperands | None]:
    """The batched slices of ``layer`` stacked in row order (no slots: a fresh copy)."""
    h_in, out = layout.h_in, []
    for place, width in zip(layout.places, layout.widths):
        if place is None:
            out.append(None)
            continue
        r, a_offs, b_offs, _ = place
        a = torch.stack([pool.as_strided((h_in, r), (r, 1), off + layer * h_in * r) for off in a_offs])
        b = torch.stack([pool.as_strided((r, width), (width, 1), off + layer * r * width) for off in b_offs])
        out.append(SliceOperands(a, b, _slot_scales(place, range(len(a_offs)), True, layout.dtype)))
    return out
