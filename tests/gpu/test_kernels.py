"""CUDA SGMV/BGMV kernels against the float64 reference (kernels/reference.py).

Fresh random inputs every case (never zeros), the workspace poisoned with NaN so an
unwritten shrink result shows up, and y compared row by row; elements no adapter touches
must stay bit-identical.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import kernels
from kernels import cuda as kcuda
from lora_problems import assert_close_rows, make_batch, reference64, seg_from_lengths

DTYPES = [torch.bfloat16, torch.float16]


def _random_widths(gen, nslices):
    if nslices == 3:  # q/k/v with GQA: k and v narrower than q
        kv = int(torch.randint(1, 300, (1,), generator=gen))
        return (kv * int(torch.randint(1, 5, (1,), generator=gen)), kv, kv)
    return tuple(int(torch.randint(1, 700, (1,), generator=gen)) for _ in range(nslices))


def _random_ranks(gen, nslices, nslots):
    ranks = torch.randint(1, 129, (nslices, nslots), generator=gen)
    ranks[torch.rand(nslices, nslots, generator=gen) < 0.15] = 0
    small = torch.rand(nslices, nslots, generator=gen) < 0.3
    ranks[small] = torch.randint(1, 9, (int(small.sum()),), generator=gen)
    return ranks


def _run(batch, bgmv):
    y0 = batch.y.clone()
    ref = reference64(batch, bgmv)
    fn = kcuda.add_lora_slices_bgmv if bgmv else kcuda.add_lora_slices
    fn(*batch.args())
    torch.cuda.synchronize()
    assert_close_rows(batch.y, ref, y0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", range(10))
def test_sgmv_random_layouts(seed, dtype):
    gen = torch.Generator().manual_seed(1000 + seed)
    nslices = 1 + seed % 3
    nseg = int(torch.randint(1, 12, (1,), generator=gen))
    lengths = torch.randint(0, 40, (nseg,), generator=gen)
    lengths[torch.rand(nseg, generator=gen) < 0.3] = 0  # empty segments
    if seed % 4 == 0:
        lengths[0] = 300  # one long segment: the 64-row tile path
    table = seg_from_lengths(lengths.tolist() + [0, 0])  # trailing empty capacity
    rows = int(table[-1]) + int(torch.randint(0, 3, (1,), generator=gen))  # rows past seg[S]
    h_in = int(torch.randint(1, 1500, (1,), generator=gen))
    batch = make_batch(gen, rows=rows, h_in=h_in, widths=_random_widths(gen, nslices),
                       ranks=_random_ranks(gen, nslices, nseg + 2), table=table, dtype=dtype,
                       misalign=seed % 2 == 1, x_pad=seed % 3, rank_cap=128 if seed % 2 else None)
    _run(batch, bgmv=False)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", range(8))
def test_bgmv_random(seed, dtype):
    gen = torch.Generator().manual_seed(2000 + seed)
    nslices, nslots = 1 + seed % 3, int(torch.randint(1, 10, (1,), generator=gen))
    rows = int(torch.randint(1, 80, (1,), generator=gen))
    table = torch.randint(-1, nslots, (rows,), generator=gen, dtype=torch.int32)
    h_in = int(torch.randint(8, 2100, (1,), generator=gen))
    batch = make_batch(gen, rows=rows, h_in=h_in, widths=_random_widths(gen, nslices),
                       ranks=_random_ranks(gen, nslices, nslots), table=table, dtype=dtype,
                       misalign=seed % 2 == 0, x_pad=8 * (seed % 2))
    _run(batch, bgmv=True)


@pytest.mark.parametrize("decode_path", [False, True])
@pytest.mark.parametrize("rank", [1, 8, 16, 33, 64, 128])
def test_prefill_long_segments(rank, decode_path, monkeypatch):
    if decode_path:  # the same long segments through the split-K + CUDA-core decode kernels
        monkeypatch.setattr("kernels.cuda._launch.SMALL_BATCH_ROWS", 1 << 30)
    gen = torch.Generator().manual_seed(3000 + rank)
    table = seg_from_lengths([1500, 0, 1030, 7, 0])
    ranks = [[rank, 16, 0, rank, 5], [rank, 128, 3, 0, 2]]
    batch = make_batch(gen, rows=2537, h_in=1000, widths=(768, 200), ranks=ranks, table=table)
    _run(batch, bgmv=False)


@pytest.mark.parametrize("split", ["global", "unsplit"])
@pytest.mark.parametrize("rank_cap", [16, 64, 128])
def test_prefill_split_summed_without_a_cluster_gives_the_cluster_result(split, rank_cap, monkeypatch):
    """The prefill shrink's split-K partials, summed in the cluster's shared memory (sm_90+) or in
    global memory by each item's last block (devices without clusters), give bitwise the same y
    (the same sums in the same order); a shrink with no split at all gives the reference's."""
    from kernels.checks import check_args
    from kernels.cuda._launch import plan_call

    gen = torch.Generator().manual_seed(4100 + rank_cap)
    lengths = [700, 0, 1300, 130, 1]
    ranks = torch.randint(1, rank_cap + 1, (2, len(lengths)), generator=gen)
    batch = make_batch(gen, rows=sum(lengths), h_in=3000, widths=(1000, 333), ranks=ranks,
                       table=seg_from_lengths(lengths), rank_cap=rank_cap)
    rt = kcuda.default_cache().get(batch.x.device)
    if not rt.clusters:
        pytest.skip("no thread-block clusters on this device")
    problem = check_args(batch.y, batch.x, batch.pool, batch.a_off, batch.b_off, batch.ranks, batch.scales,
                         batch.layer, batch.widths, batch.workspace)
    assert plan_call(rt, problem, 0, problem.nslots, batch.x.dtype).ksplit > 1  # the split is what is tested
    y0 = batch.y.clone()
    expected = reference64(batch, False)  # from y0: the reference adds into the y it is given
    kcuda.add_lora_slices(*batch.args())
    in_cluster = batch.y.clone()
    batch.y.copy_(y0)
    if split == "global":
        monkeypatch.setattr(rt, "clusters", False)
    else:
        monkeypatch.setattr("kernels.cuda._launch.PREFILL_MAX_BLOCKS_PER_SM", 0)
        assert plan_call(rt, problem, 0, problem.nslots, batch.x.dtype).ksplit == 1
    kcuda.add_lora_slices(*batch.args())
    torch.cuda.synchronize()
    if split == "global":
        assert torch.equal(batch.y, in_cluster)
    assert_close_rows(batch.y, expected, y0)


@pytest.mark.parametrize("h_in, x_pad", [(4096, 0), (3000, 8), (2048, 3)])
@pytest.mark.parametrize("rank_cap", [16, 64, 128])
def test_prefill_shrink_x_by_tma_gives_the_cp_async_result(h_in, x_pad, rank_cap, monkeypatch):
    """sm_90: the prefill shrink's x tiles by TMA (whole stages; a block with a partial k-range or
    an x no tensor map fits keeps cp.async) sum the same products in the same order as the
    cp.async copies: bitwise the same y, and the reference's."""
    from kernels.cuda import _launch

    gen = torch.Generator().manual_seed(4300 + rank_cap + h_in + x_pad)
    lengths = [700, 0, 1300, 130, 1]
    # ranks of multiples of 8 (the A pieces' 16-byte copies: the TMA path), the cap among them
    ranks = 8 * torch.randint(1, rank_cap // 8 + 1, (2, len(lengths)), generator=gen)
    ranks[0, 2] = rank_cap
    batch = make_batch(gen, rows=sum(lengths), h_in=h_in, widths=(1000, 333), ranks=ranks, x_pad=x_pad,
                       table=seg_from_lengths(lengths), rank_cap=rank_cap)
    rt = kcuda.default_cache().get(batch.x.device)
    if not rt.tma:
        pytest.skip("no TMA on this device")
    y0 = batch.y.clone()
    expected = reference64(batch, False)
    kcuda.add_lora_slices(*batch.args())
    by_tma = batch.y.clone()
    batch.y.copy_(y0)
    monkeypatch.setattr(_launch, "SHRINK_TMA", False)
    kcuda.add_lora_slices(*batch.args())
    torch.cuda.synchronize()
    assert torch.equal(by_tma, batch.y)
    assert_close_rows(by_tma, expected, y0)


@pytest.mark.parametrize("rank_cap", [16, 128])
def test_prefill_expand_launched_early_gives_the_stream_ordered_result(rank_cap, monkeypatch):
    """sm_90: the prefill expand goes as its shrink's programmatic dependent (its blocks fetch y
    and B while the shrink runs, and wait for the shrink before reading v): y is bitwise the y of
    the two kernels in plain stream order, and the reference's (the workspace starts as NaN, so a
    v read too early shows)."""
    from kernels.cuda import _launch

    gen = torch.Generator().manual_seed(4600 + rank_cap)
    lengths = [2048, 300, 1, 900]
    ranks = torch.randint(1, rank_cap + 1, (2, len(lengths)), generator=gen)
    batch = make_batch(gen, rows=sum(lengths), h_in=2048, widths=(1024, 512), ranks=ranks,
                       table=seg_from_lengths(lengths), rank_cap=rank_cap)
    if not kcuda.default_cache().get(batch.x.device).pdl:
        pytest.skip("no programmatic dependent launch on this device")
    y0 = batch.y.clone()
    expected = reference64(batch, False)
    kcuda.add_lora_slices(*batch.args())
    early = batch.y.clone()
    batch.y.copy_(y0)
    monkeypatch.setattr(_launch, "PREFILL_PDL", False)
    kcuda.add_lora_slices(*batch.args())
    torch.cuda.synchronize()
    assert torch.equal(early, batch.y)
    assert_close_rows(early, expected, y0)


def _workload_lengths(name, batch_size, gen):
    if name == "distinct":
        return [1] * batch_size
    if name == "identical":
        return [batch_size]
    if name == "uniform":
        n = math.ceil(math.sqrt(batch_size))
        return [len(range(i, batch_size, n)) for i in range(n)]
    weights = 1.0 / torch.arange(1, batch_size + 1, dtype=torch.float64) ** 1.5  # Zipf 1.5
    counts = torch.bincount(torch.multinomial(weights, batch_size, True, generator=gen), minlength=batch_size)
    return [int(c) for c in counts if c > 0]


@pytest.mark.parametrize("workload", ["distinct", "uniform", "skewed", "identical"])
@pytest.mark.parametrize("batch_size", [1, 7, 64])
def test_workloads_h4096(workload, batch_size):
    gen = torch.Generator().manual_seed(batch_size)
    lengths = _workload_lengths(workload, batch_size, gen)
    table = seg_from_lengths(lengths)
    ranks = torch.full((1, len(lengths)), 16)
    batch = make_batch(gen, rows=batch_size, h_in=4096, widths=(4096,), ranks=ranks, table=table, layers=1)
    _run(batch, bgmv=False)


def test_mlp_widths_and_qkv_gqa():
    gen = torch.Generator().manual_seed(7)
    table = seg_from_lengths([3, 1, 0, 12])
    batch = make_batch(gen, rows=16, h_in=4096, widths=(11008, 11008), table=table,
                       ranks=[[16, 64, 8, 32], [16, 64, 8, 32]], layers=1)
    _run(batch, bgmv=False)
    batch = make_batch(gen, rows=16, h_in=11008, widths=(4096,), table=table, ranks=[[16, 64, 8, 32]], layers=1)
    _run(batch, bgmv=False)
    batch = make_batch(gen, rows=16, h_in=4096, widths=(4096, 1024, 1024), table=table,
                       ranks=[[16, 64, 8, 32]] * 3, layers=3)
    _run(batch, bgmv=False)


def test_split_k_is_deterministic():
    gen = torch.Generator().manual_seed(11)
    batch = make_batch(gen, rows=5, h_in=4096, widths=(4096,), ranks=[[16, 64]], table=seg_from_lengths([2, 3]))
    y0 = batch.y.clone()
    kcuda.add_lora_slices(*batch.args())
    first = batch.y.clone()
    batch.y.copy_(y0)
    kcuda.add_lora_slices(*batch.args())
    assert torch.equal(first, batch.y)


def _rewrite(dst, src):
    """Copy a new batch's table contents into the captured batch's tensors (same shapes)."""
    for name in ("x", "a_off", "b_off", "ranks", "scales", "table", "y"):
        getattr(dst, name).copy_(getattr(src, name))


@pytest.mark.parametrize("bgmv", [False, True])
def test_cuda_graph_replay_with_new_tables(bgmv):
    gen = torch.Generator().manual_seed(21)
    rows, nslots, widths = 24, 6, (512, 128, 128)

    def layout(seed):
        g = torch.Generator().manual_seed(seed)
        if bgmv:
            table = torch.randint(-1, nslots, (rows,), generator=g, dtype=torch.int32)
        else:
            cuts = sorted(torch.randint(0, rows + 1, (nslots - 1,), generator=g).tolist())
            table = torch.tensor([0, *cuts, rows], dtype=torch.int32)
        return make_batch(g, rows=rows, h_in=777, widths=widths, table=table, rank_cap=128,
                          ranks=_random_ranks(g, 3, nslots))

    first = layout(1)
    pool = torch.empty(4_000_000, dtype=torch.bfloat16, device="cuda").normal_(generator=None)
    captured = make_batch(gen, rows=rows, h_in=777, widths=widths, table=first.table, rank_cap=128,
                          ranks=first.ranks.cpu())
    captured.pool = pool
    fn = kcuda.add_lora_slices_bgmv if bgmv else kcuda.add_lora_slices
    fn(*captured.args())  # warm-up: compile, allocate scratch
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn(*captured.args())
    for seed in (2, 3, 4):
        new = layout(seed)  # new adapters (values, offsets, ranks), new segments, new x and y
        new.layer = captured.layer  # the layer index is a launch argument, baked into the graph
        n = new.pool.numel()
        base = 1000 * seed + 3  # place them at a new, odd position of the captured pool
        pool[base:base + n].copy_(new.pool)
        new.a_off += base
        new.b_off += base
        _rewrite(captured, new)
        captured.workspace.fill_(float("nan"))
        y0 = captured.y.clone()
        new.pool = pool
        new.y = y0.clone()
        ref = reference64(new, bgmv)
        graph.replay()
        torch.cuda.synchronize()
        assert_close_rows(captured.y, ref, y0)


def test_entry_point_dispatches_cuda_tensors():
    gen = torch.Generator().manual_seed(5)
    batch = make_batch(gen, rows=9, h_in=300, widths=(100,), ranks=[[4, 9]], table=seg_from_lengths([4, 5]))
    y0 = batch.y.clone()
    ref = reference64(batch, False)
    kernels.add_lora_slices(*batch.args())
    torch.cuda.synchronize()
    assert_close_rows(batch.y, ref, y0)


def test_bad_arguments_raise_value_errors():
    gen = torch.Generator().manual_seed(6)
    b = make_batch(gen, rows=4, h_in=64, widths=(32,), ranks=[[4]], table=seg_from_lengths([4]))
    args = list(b.args())
    cases = [
        (1, b.x.float(), "dtype"),
        (1, torch.empty(64, 4, dtype=b.x.dtype, device="cuda").t(), "contiguous"),
        (0, b.y[:, :16], "y"),
        (3, b.a_off.int(), "a_off"),
        (5, b.ranks.long(), "ranks"),
        (7, torch.zeros(5, dtype=torch.int64, device="cuda"), "seg"),
        (10, b.workspace[:, :2], "workspace"),
        (8, -1, "layer"),
    ]
    for index, value, word in cases:
        bad = list(args)
        bad[index] = value
        with pytest.raises(ValueError, match=word):
            kcuda.add_lora_slices(*bad)
    with pytest.raises(ValueError, match="row_slot"):
        kcuda.add_lora_slices_bgmv(*args[:7], torch.zeros(3, dtype=torch.int32, device="cuda"), *args[8:])


def test_launches_with_nothing_to_do_leave_y_and_later_launches_correct():
    """Launches whose segments are all empty or rank 0 change nothing, and leave no state
    behind that spoils the next launch (which must be right)."""
    gen = torch.Generator().manual_seed(31)
    empty = make_batch(gen, rows=5, h_in=512, widths=(256,), ranks=[[8, 8]], table=seg_from_lengths([0, 0]))
    zero_rank = make_batch(gen, rows=5, h_in=512, widths=(256,), ranks=[[0, 0]], table=seg_from_lengths([2, 3]))
    for b in (empty, zero_rank, empty):
        y0 = b.y.clone()
        kcuda.add_lora_slices(*b.args())
        torch.cuda.synchronize()
        assert torch.equal(b.y, y0)
    _run(make_batch(gen, rows=7, h_in=512, widths=(256,), ranks=[[8, 16]], table=seg_from_lengths([3, 4])), False)


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
        _run(batch, bgmv)


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
                       widths=_random_widths(gen, 1 + seed % 3), ranks=_random_ranks(gen, 1 + seed % 3, 9),
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
    (the row's segment found by the block, or read from row_slot): the result must be bit for bit
    that of 4-row tiles, for grouped and one-row segments, empty ones and rows past seg[S]."""
    from kernels.cuda import _launch

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
                       widths=_random_widths(gen, nslices), ranks=_random_ranks(gen, nslices, nseg + 1),
                       table=table, misalign=seed % 2 == 1, rank_cap=128 if seed % 3 else None)
    y0 = batch.y.clone()
    outs = []
    for threshold, with_rows in ((0, False), (1 << 20, False), (1 << 20, True)):
        monkeypatch.setattr(_launch, "ONE_ROW_ITEMS_ROWS", threshold)
        batch.y.copy_(y0)
        kcuda.add_lora_slices(*batch.args(), row_slot=row_slot.cuda() if with_rows else None)
        torch.cuda.synchronize()
        outs.append(batch.y.clone())
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
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

    from kernels.cuda._launch import SHRINK_PDL_CARVEOUT

    gen = torch.Generator().manual_seed(71)
    lengths = [1] * 40 + [3, 0, 7]
    ranks = _random_ranks(gen, 3, 43).clamp(max=rank_cap)
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


def test_outgrown_scratch_stays_with_the_graph_that_captured_it():
    """A captured graph keeps raw pointers into the kernels' scratch. A later, larger eager call
    (a larger decode batch after the graphs were captured) grows it; the outgrown buffer must
    stay allocated, so a tensor allocated afterwards is never written by a replay, and the
    replay still gives the eager result."""
    from kernels.checks import check_args
    from kernels.cuda._launch import Call, launch, plan_call
    from kernels.cuda._runtime import DeviceRuntime

    rt = DeviceRuntime(torch.device("cuda", torch.cuda.current_device()))  # fresh scratch, not the shared one

    def call(batch):
        problem = check_args(batch.y, batch.x, batch.pool, batch.a_off, batch.b_off, batch.ranks, batch.scales,
                             batch.layer, batch.widths, batch.workspace)
        c = Call(batch.y, batch.x, batch.pool, batch.a_off, batch.b_off, batch.ranks, batch.scales, batch.table,
                 batch.layer, batch.workspace)
        launch(rt, plan_call(rt, problem, 0, problem.nslots, batch.x.dtype), problem, c)

    gen = torch.Generator().manual_seed(9)
    lengths = [1] * 20 + [5, 3]
    small = make_batch(gen, rows=sum(lengths), h_in=2048, widths=(1024, 512), ranks=_random_ranks(gen, 2, 22),
                       table=seg_from_lengths(lengths), rank_cap=128)
    y0 = small.y.clone()
    call(small)
    eager = small.y.clone()
    captured = rt.partials.current
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call(small)
    big = make_batch(gen, rows=256, h_in=2048, widths=(1024, 512), ranks=_random_ranks(gen, 2, 3),
                     table=seg_from_lengths([100, 150, 6]), rank_cap=128)
    call(big)  # grows the scratch past the captured buffer
    torch.cuda.synchronize()
    assert rt.partials.current.numel() > captured.numel() and any(t is captured for t in rt.partials.retired)
    numel = captured.numel()
    del captured
    victim = torch.full((numel,), 7.0, device="cuda")  # where a freed buffer would be handed out again
    small.y.copy_(y0)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(small.y, eager)
    assert bool((victim == 7.0).all())
