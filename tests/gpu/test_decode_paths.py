"""The decode kernels' alternative paths give the same y: every rank cap, the expand by rows or by
segments, one-row items or four-row tiles, the expand launched as the shrink's programmatic
dependent (eager and in a CUDA graph); bitwise where the arithmetic is the same, and the float64
reference's."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from loraplex.kernels import cuda as kcuda
from lora_problems import (assert_close_rows, make_batch, random_ranks, random_widths, reference64,
                           run_against_reference, seg_from_lengths)

DTYPES = [torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cap", [16, 32, 64, 128])
@pytest.mark.parametrize("bgmv", [False, True])
def test_decode_expand_walks_every_rank_in_chunks(cap, bgmv, dtype):
    """The decode expand stages the rank in 16-row chunks, the decode shrink in 32-column
    chunks: ranks up to each workspace cap (one to eight chunks, partial last chunks), one-
    and multi-row items, widths off the tile size, misaligned A and B (the element-wise
    staging paths) and three slices."""
    gen = torch.Generator().manual_seed(3000 + cap)
    for misalign in (False, True):
        lengths = [1, 1, 5, 0, 1, 9, 3]
        table = seg_from_lengths(lengths) if not bgmv else torch.tensor(
            [i % 4 - (i % 7 == 6) for i in range(sum(lengths))], dtype=torch.int32)
        nslots = len(lengths) if not bgmv else 4
        ranks = torch.randint(1, cap + 1, (3, nslots), generator=gen)
        ranks[0, 0] = cap
        batch = make_batch(gen, rows=sum(lengths), h_in=int(torch.randint(64, 700, (1,), generator=gen)),
                           widths=(1100, 300, 300), ranks=ranks, table=table, dtype=dtype, misalign=misalign,
                           rank_cap=cap)
        run_against_reference(batch, bgmv)


@pytest.mark.parametrize("bgmv", [False, True])
def test_decode_result_does_not_depend_on_the_rank_cap(bgmv):
    """The decode grids are planned for the adapters, not for the engine's rank cap: the same
    batch under workspace caps 32 and 128 gives bitwise the same y (the server's default cap
    is 128; graphs captured under it must cost and compute what the adapters' ranks do)."""
    gen = torch.Generator().manual_seed(77)
    lengths = [1, 3, 1, 1, 6, 1]
    table = seg_from_lengths(lengths) if not bgmv else torch.tensor([i % 6 for i in range(13)], dtype=torch.int32)
    ranks = torch.randint(1, 33, (2, 6), generator=gen)
    batch = make_batch(gen, rows=13, h_in=4096, widths=(2000, 900), ranks=ranks, table=table, rank_cap=128)
    fn = kcuda.add_lora_slices_bgmv if bgmv else kcuda.add_lora_slices
    y0 = batch.y.clone()
    fn(*batch.args())
    under_128 = batch.y.clone()
    batch.y.copy_(y0)
    narrow = dataclasses.replace(batch, workspace=torch.full((2, 16, 32), float("nan"), dtype=batch.x.dtype,
                                                             device="cuda"))
    fn(*narrow.args())
    torch.cuda.synchronize()
    assert torch.equal(batch.y, under_128)
    assert_close_rows(under_128, reference64(dataclasses.replace(batch, y=y0.clone()), bgmv), y0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", range(4))
def test_decode_expand_by_rows_is_bitwise_the_segment_expand(seed, dtype):
    """With row_slot (the same layout as seg, row by row) the decode expand takes one row per
    item instead of walking segments: the result must not change by a bit, for one-row and
    long segments, empty ones and rows past seg[S]."""
    gen = torch.Generator().manual_seed(4000 + seed)
    lengths = torch.randint(0, 12, (9,), generator=gen)
    lengths[torch.rand(9, generator=gen) < 0.3] = 1
    lengths[2] = 0
    table = seg_from_lengths(lengths.tolist())
    rows = int(table[-1]) + 2  # two rows past seg[S]: no adapter
    row_slot = torch.full((rows,), -1, dtype=torch.int32)
    for i in range(9):
        row_slot[int(table[i]):int(table[i + 1])] = i
    batch = make_batch(gen, rows=rows, h_in=int(torch.randint(64, 1500, (1,), generator=gen)),
                       widths=random_widths(gen, 1 + seed % 3), ranks=random_ranks(gen, 1 + seed % 3, 9),
                       table=table, dtype=dtype, misalign=seed % 2 == 1, rank_cap=128 if seed % 2 else None)
    y0 = batch.y.clone()
    kcuda.add_lora_slices(*batch.args())
    by_segments = batch.y.clone()
    batch.y.copy_(y0)
    kcuda.add_lora_slices(*batch.args(), row_slot=row_slot.cuda())
    torch.cuda.synchronize()
    assert torch.equal(batch.y, by_segments)
    assert_close_rows(by_segments, reference64(dataclasses.replace(batch, y=y0.clone()), False), y0)


@pytest.mark.parametrize("seed", range(6))
def test_decode_one_row_items_are_bitwise_the_four_row_tiles(seed, monkeypatch):
    """Decode SGMV calls of up to ONE_ROW_ITEMS_ROWS rows take one row per item in both kernels
    (the row's segment found by the block, or read from row_slot); past it, with a row_slot, both
    take row_slot's runs as 4-row tiles (each kernel in RUN_ITEMS), or else the expand one row per
    item and the shrink seg's tiles. Every way, the result must be bit for bit that of seg's 4-row tiles, for grouped and
    one-row segments, empty ones and rows past seg[S]."""
    from loraplex.kernels.cuda import _launch, _plan

    gen = torch.Generator().manual_seed(6000 + seed)
    nseg = int(torch.randint(1, 40, (1,), generator=gen)) if seed % 2 else 1  # odd: many segments; even: one
    lengths = torch.randint(0, 24 if seed % 2 else 60, (nseg,), generator=gen)
    lengths[torch.rand(nseg, generator=gen) < 0.2] = 0
    lengths[0] = max(int(lengths[0]), 1)
    table = seg_from_lengths(lengths.tolist() + [0])
    rows = min(int(table[-1]) + 2, 250)  # rows past seg[S] have no adapter
    table = table.clamp(max=rows)
    row_slot = torch.full((rows,), -1, dtype=torch.int32)
    for i in range(nseg):
        row_slot[int(table[i]):int(table[i + 1])] = i
    nslices = 1 + seed % 3
    batch = make_batch(gen, rows=rows, h_in=int(torch.randint(64, 3000, (1,), generator=gen)),
                       widths=random_widths(gen, nslices), ranks=random_ranks(gen, nslices, nseg + 1),
                       table=table, misalign=seed % 2 == 1, rank_cap=128 if seed % 3 else None)
    y0 = batch.y.clone()
    outs = []
    both, neither = {"shrink", "expand"}, set()
    for threshold, with_rows, runs in ((0, False, both), (1 << 20, False, both), (1 << 20, True, both),
                                       (0, True, both), (0, True, neither), (0, True, {"shrink"}),
                                       (0, True, {"expand"})):
        monkeypatch.setattr(_plan, "ONE_ROW_ITEMS_ROWS", threshold)
        monkeypatch.setattr(_launch, "RUN_ITEMS", frozenset(runs))
        batch.y.copy_(y0)
        kcuda.add_lora_slices(*batch.args(), row_slot=row_slot.cuda() if with_rows else None)
        torch.cuda.synchronize()
        outs.append(batch.y.clone())
    assert all(torch.equal(outs[0], out) for out in outs[1:])
    assert_close_rows(outs[1], reference64(dataclasses.replace(batch, y=y0.clone()), False), y0)


@pytest.mark.parametrize("rank_cap", [16, 128])
@pytest.mark.parametrize("capture", [False, True], ids=["eager", "graph"])
def test_expand_launched_as_programmatic_dependent_gives_the_plain_result(capture, rank_cap):
    """On sm_90 a decode call under a rank cap of 16 launches the expand as a programmatic
    dependent of its shrink (it starts while the shrink finishes and waits for its partials on
    the device); a larger cap launches them plainly. y must be bitwise what the shrink and the
    expand give as two plain launches (stage calls), eagerly and replayed from a CUDA graph,
    call after call."""
    import cupy

    from loraplex.kernels.cuda._launch import SHRINK_PDL_CARVEOUT

    gen = torch.Generator().manual_seed(71)
    lengths = [1] * 40 + [3, 0, 7]
    ranks = random_ranks(gen, 3, 43).clamp(max=rank_cap)
    batch = make_batch(gen, rows=sum(lengths), h_in=4096, widths=(4096, 1024, 1024), ranks=ranks,
                       table=seg_from_lengths(lengths), rank_cap=rank_cap)
    rt = kcuda.default_cache().get(batch.x.device)
    y0 = batch.y.clone()
    kcuda.add_lora_slices(*batch.args(), stage="shrink")
    kcuda.add_lora_slices(*batch.args(), stage="expand")
    plain = batch.y.clone()
    batch.y.copy_(y0)
    kcuda.add_lora_slices(*batch.args())
    if capture:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            kcuda.add_lora_slices(*batch.args())
        for _ in range(3):
            batch.y.copy_(y0)
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(batch.y, plain)
    torch.cuda.synchronize()
    assert torch.equal(batch.y, plain)
    assert_close_rows(plain, reference64(dataclasses.replace(batch, y=y0.clone()), False), y0)
    assert rt.pdl == (torch.cuda.get_device_capability() >= (9, 0))
    if rt.pdl and rank_cap == 16:  # that shrink prefers shared memory (room for the expand's blocks)
        carveout = [cupy.cuda.driver.funcGetAttribute(9, rt.function("shrink_dec", batch.x.dtype, v).kernel.ptr)
                    for v in ("m4_pdl", "m4")]
        assert carveout[0] == SHRINK_PDL_CARVEOUT and carveout[1] != SHRINK_PDL_CARVEOUT  # the plain one keeps L1
