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

from loraplex import kernels
from loraplex.kernels import cuda as kcuda
from lora_problems import (assert_close_rows, make_batch, random_ranks, random_widths, reference64,
                           run_against_reference, seg_from_lengths)

DTYPES = [torch.bfloat16, torch.float16]


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
    batch = make_batch(gen, rows=rows, h_in=h_in, widths=random_widths(gen, nslices),
                       ranks=random_ranks(gen, nslices, nseg + 2), table=table, dtype=dtype,
                       misalign=seed % 2 == 1, x_pad=seed % 3, rank_cap=128 if seed % 2 else None)
    run_against_reference(batch, bgmv=False)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", range(8))
def test_bgmv_random(seed, dtype):
    gen = torch.Generator().manual_seed(2000 + seed)
    nslices, nslots = 1 + seed % 3, int(torch.randint(1, 10, (1,), generator=gen))
    rows = int(torch.randint(1, 80, (1,), generator=gen))
    table = torch.randint(-1, nslots, (rows,), generator=gen, dtype=torch.int32)
    h_in = int(torch.randint(8, 2100, (1,), generator=gen))
    batch = make_batch(gen, rows=rows, h_in=h_in, widths=random_widths(gen, nslices),
                       ranks=random_ranks(gen, nslices, nslots), table=table, dtype=dtype,
                       misalign=seed % 2 == 0, x_pad=8 * (seed % 2))
    run_against_reference(batch, bgmv=True)


@pytest.mark.parametrize("decode_path", [False, True])
@pytest.mark.parametrize("rank", [1, 8, 16, 33, 64, 128])
def test_prefill_long_segments(rank, decode_path, monkeypatch):
    if decode_path:  # the same long segments through the split-K + CUDA-core decode kernels
        monkeypatch.setattr("loraplex.kernels.cuda._plan.SMALL_BATCH_ROWS", 1 << 30)
    gen = torch.Generator().manual_seed(3000 + rank)
    table = seg_from_lengths([1500, 0, 1030, 7, 0])
    ranks = [[rank, 16, 0, rank, 5], [rank, 128, 3, 0, 2]]
    batch = make_batch(gen, rows=2537, h_in=1000, widths=(768, 200), ranks=ranks, table=table)
    run_against_reference(batch, bgmv=False)


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
    run_against_reference(batch, bgmv=False)


def test_mlp_widths_and_qkv_gqa():
    gen = torch.Generator().manual_seed(7)
    table = seg_from_lengths([3, 1, 0, 12])
    batch = make_batch(gen, rows=16, h_in=4096, widths=(11008, 11008), table=table,
                       ranks=[[16, 64, 8, 32], [16, 64, 8, 32]], layers=1)
    run_against_reference(batch, bgmv=False)
    batch = make_batch(gen, rows=16, h_in=11008, widths=(4096,), table=table, ranks=[[16, 64, 8, 32]], layers=1)
    run_against_reference(batch, bgmv=False)
    batch = make_batch(gen, rows=16, h_in=4096, widths=(4096, 1024, 1024), table=table,
                       ranks=[[16, 64, 8, 32]] * 3, layers=3)
    run_against_reference(batch, bgmv=False)


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


def _row_slot(seg: torch.Tensor, rows: int) -> torch.Tensor:
    """row_slot of seg's layout: row t of segment i -> i, -1 past seg[S]."""
    row_slot = torch.full((rows,), -1, dtype=torch.int32, device=seg.device)
    for i in range(seg.numel() - 1):
        row_slot[int(seg[i]):int(seg[i + 1])] = i
    return row_slot


@pytest.mark.parametrize("bgmv,rows", [(False, 24), (True, 24), (False, 100)],
                         ids=["sgmv", "bgmv", "sgmv-runs"])
def test_cuda_graph_replay_with_new_tables(bgmv, rows):
    """A captured call replays correctly with new tables: adapters, offsets, ranks, segments, x
    and y. 100 SGMV rows with a row_slot take row_slot's runs as items (the engine's batches of
    more than ONE_ROW_ITEMS_ROWS rows), whose heads change with the segments."""
    gen = torch.Generator().manual_seed(21)
    nslots, widths = 6, (512, 128, 128)
    runs = not bgmv and rows > 64

    def layout(seed):
        g = torch.Generator().manual_seed(seed)
        if bgmv:
            table = torch.randint(-1, nslots, (rows,), generator=g, dtype=torch.int32)
        else:
            cuts = sorted(torch.randint(0, rows + 1, (nslots - 1,), generator=g).tolist())
            table = torch.tensor([0, *cuts, rows], dtype=torch.int32)
        return make_batch(g, rows=rows, h_in=777, widths=widths, table=table, rank_cap=128,
                          ranks=random_ranks(g, 3, nslots))

    first = layout(1)
    pool = torch.empty(4_000_000, dtype=torch.bfloat16, device="cuda").normal_(generator=None)
    captured = make_batch(gen, rows=rows, h_in=777, widths=widths, table=first.table, rank_cap=128,
                          ranks=first.ranks.cpu())
    captured.pool = pool
    fn = kcuda.add_lora_slices_bgmv if bgmv else kcuda.add_lora_slices
    row_slot = _row_slot(captured.table, rows) if runs else None
    extra = {"row_slot": row_slot} if runs else {}
    fn(*captured.args(), **extra)  # warm-up: compile, allocate scratch
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn(*captured.args(), **extra)
    for seed in (2, 3, 4):
        new = layout(seed)  # new adapters (values, offsets, ranks), new segments, new x and y
        new.layer = captured.layer  # the layer index is a launch argument, baked into the graph
        n = new.pool.numel()
        base = 1000 * seed + 3  # place them at a new, odd position of the captured pool
        pool[base:base + n].copy_(new.pool)
        new.a_off += base
        new.b_off += base
        _rewrite(captured, new)
        if runs:
            row_slot.copy_(_row_slot(new.table, rows))
        captured.workspace.fill_(float("nan"))
        y0 = captured.y.clone()
        new.pool = pool
        new.y = y0.clone()
        ref = reference64(new, bgmv)
        graph.replay()
        torch.cuda.synchronize()
        assert_close_rows(captured.y, ref, y0)


def _decodes_beside_a_prompt(rows: int, decodes: int, capacity: int, seed: int):
    """A step's LoRA batch at qkv widths, rank cap 16: `decodes` one-row segments of distinct rank-16
    adapters, a prompt chunk (rank 8), 5 base-model rows (rank 0) and 3 rows of padding past seg[S];
    tables of `capacity` columns (those past the step's segments rank 16, never read)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = [1] * decodes + [rows - decodes - 8, 5]
    ranks = [[16] * decodes + [8, 0] + [16] * (capacity - decodes - 2)] * 3
    return make_batch(gen, rows=rows, h_in=4096, widths=(4096, 1024, 1024), ranks=ranks,
                      table=seg_from_lengths(lengths), layers=1, rank_cap=16)


@pytest.mark.parametrize("rows", [300, 512])
def test_graph_step_of_distinct_decodes_and_a_prompt_on_the_decode_kernels(rows):
    """The engine's widest graph steps: 255 distinct adapters decoding, one prompt chunk of another
    adapter, base-model rows and padding (rows past seg[S]), through the decode kernels with the
    engine's row_slot, as shrink then expand stage calls; checked against the float64 reference."""
    from loraplex.kernels.cuda._plan import is_decode

    assert is_decode(rows, 0, 257, 16)
    batch = _decodes_beside_a_prompt(rows, 255, 257, seed=rows)
    y0 = batch.y.clone()
    ref = reference64(batch, False)
    row_slot = _row_slot(batch.table, rows)
    for stage in ("shrink", "expand"):
        kcuda.add_lora_slices(*batch.args(), stage=stage, row_slot=row_slot)
    torch.cuda.synchronize()
    assert_close_rows(batch.y, ref, y0)


@pytest.mark.parametrize("rows,decodes,decode_path", [(300, 255, True), (1024, 255, True), (1024, 40, False)])
def test_a_seg_of_the_steps_own_segments_short_of_the_tables_capacity(rows, decodes, decode_path):
    """An eager step's seg stops at its last segment, short of the tables' columns (the engine's
    capacity): distinct decodes, a prompt chunk and base-model rows, on the decode kernels (up to
    512 rows, or segments of a few rows on average at rank 16) and on the prefill kernels (a tile a
    segment, split by their count), against the float64 reference."""
    from loraplex.kernels.cuda._plan import is_decode

    nseg = decodes + 2
    assert is_decode(rows, 0, nseg, 16) == decode_path
    batch = _decodes_beside_a_prompt(rows, decodes, 320, seed=7 + rows + decodes)
    assert batch.table.shape[0] == nseg + 1 and batch.a_off.shape[1] == 320
    y0 = batch.y.clone()
    ref = reference64(batch, False)
    kcuda.add_lora_slices(*batch.args(), row_slot=_row_slot(batch.table, rows))
    torch.cuda.synchronize()
    assert_close_rows(batch.y, ref, y0)


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
    y, x, ops, seg = b.args()
    cases = [
        ({"x": b.x.float()}, "dtype"),
        ({"x": torch.empty(64, 4, dtype=b.x.dtype, device="cuda").t()}, "contiguous"),
        ({"y": b.y[:, :16]}, "y"),
        ({"a_off": b.a_off.int()}, "a_off"),
        ({"ranks": b.ranks.long()}, "ranks"),
        ({"seg": torch.zeros(5, dtype=torch.int64, device="cuda")}, "seg"),
        ({"workspace": b.workspace[:, :2]}, "workspace"),
        ({"layer": -1}, "layer"),
    ]
    for change, word in cases:
        call = {"y": y, "x": x, "seg": seg} | {k: v for k, v in change.items() if k in ("y", "x", "seg")}
        bad_ops = dataclasses.replace(ops, **{k: v for k, v in change.items() if k not in ("y", "x", "seg")})
        with pytest.raises(ValueError, match=word):
            kcuda.add_lora_slices(call["y"], call["x"], bad_ops, call["seg"])
    with pytest.raises(ValueError, match="row_slot"):
        kcuda.add_lora_slices_bgmv(y, x, ops, torch.zeros(3, dtype=torch.int32, device="cuda"))


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
    run_against_reference(make_batch(gen, rows=7, h_in=512, widths=(256,), ranks=[[8, 16]], table=seg_from_lengths([3, 4])), False)


def test_outgrown_scratch_stays_with_the_graph_that_captured_it():
    """A captured graph keeps raw pointers into the kernels' scratch. A later, larger eager call
    (a larger decode batch after the graphs were captured) grows it; the outgrown buffer must
    stay allocated, so a tensor allocated afterwards is never written by a replay, and the
    replay still gives the eager result."""
    from loraplex.kernels.checks import check_args
    from loraplex.kernels.cuda._launch import Call, launch, plan_call
    from loraplex.kernels.cuda._runtime import DeviceRuntime

    rt = DeviceRuntime(torch.device("cuda", torch.cuda.current_device()))  # fresh scratch, not the shared one

    def call(batch):
        problem = check_args(batch.y, batch.x, batch.ops())
        c = Call(batch.y, batch.x, batch.ops(), batch.table)
        launch(rt, plan_call(rt, problem, 0, problem.nslots, batch.x.dtype), problem, c)

    gen = torch.Generator().manual_seed(9)
    lengths = [1] * 20 + [5, 3]
    small = make_batch(gen, rows=sum(lengths), h_in=2048, widths=(1024, 512), ranks=random_ranks(gen, 2, 22),
                       table=seg_from_lengths(lengths), rank_cap=128)
    y0 = small.y.clone()
    call(small)
    eager = small.y.clone()
    captured = rt.partials.current
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call(small)
    big = make_batch(gen, rows=256, h_in=2048, widths=(1024, 512), ranks=random_ranks(gen, 2, 3),
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
