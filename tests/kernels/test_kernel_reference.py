"""loraplex.kernels.reference against a naive float64 per-row computation (CPU), plus the CUDA
wrappers' host-side logic that needs no GPU (launch-grid invariants, CPU rejection)."""

from __future__ import annotations

import math

import pytest
import torch

from loraplex.kernels.operands import LoraOperands

from loraplex.kernels import reference


def _pool_and_offsets(gen, h_in, widths, ranks, layers):
    nslices, nslots = ranks.shape
    a_off = torch.zeros(nslices, nslots, dtype=torch.int64)
    b_off = torch.zeros(nslices, nslots, dtype=torch.int64)
    pos = 5  # deliberately unaligned start
    for p in range(nslices):
        for s in range(nslots):
            r = int(ranks[p, s])
            a_off[p, s], pos = pos, pos + layers * h_in * r + 3
            b_off[p, s], pos = pos, pos + layers * r * widths[p] + 1
    return torch.randn(pos, generator=gen, dtype=torch.float64), a_off, b_off


def _naive(y, x, pool, a_off, b_off, ranks, scales, row_slot, layer, widths):
    """Row by row, slice by slice, in float64."""
    y = y.clone()
    h_in = x.shape[1]
    for t in range(x.shape[0]):
        s = int(row_slot[t])
        if s < 0:
            continue
        col = 0
        for p, w in enumerate(widths):
            r = int(ranks[p, s])
            if r:
                a0 = int(a_off[p, s]) + layer * h_in * r
                b0 = int(b_off[p, s]) + layer * r * w
                a = pool[a0 : a0 + h_in * r].reshape(h_in, r)
                b = pool[b0 : b0 + r * w].reshape(r, w)
                v = [sum(float(x[t, k]) * float(a[k, j]) for k in range(h_in)) for j in range(r)]
                for n in range(w):
                    y[t, col + n] += float(scales[p, s]) * sum(v[j] * float(b[j, n]) for j in range(r))
            col += w
        assert col == y.shape[1]
    return y


def _case(seed):
    gen = torch.Generator().manual_seed(seed)
    nslices = 1 + seed % 3
    kv = int(torch.randint(1, 6, (1,), generator=gen))
    widths = (4 * kv, kv, kv)[:nslices] if nslices == 3 else tuple(
        int(torch.randint(1, 9, (1,), generator=gen)) for _ in range(nslices))
    lengths = torch.randint(0, 4, (6,), generator=gen)
    lengths[2] = 0  # an empty segment
    nslots = len(lengths) + 2  # trailing empty capacity
    seg = torch.tensor([0, *torch.cumsum(lengths, 0).tolist()] + [int(lengths.sum())] * 2, dtype=torch.int32)
    ranks = torch.randint(1, 129, (nslices, nslots), generator=gen, dtype=torch.int32)
    ranks[:, 1] = 0  # rank-0 slot: no LoRA
    ranks[0, 0] = 1
    h_in, layers = int(torch.randint(1, 7, (1,), generator=gen)), 2
    pool, a_off, b_off = _pool_and_offsets(gen, h_in, widths, ranks, layers)
    rows = int(seg[-1])
    x = torch.randn(rows, h_in, generator=gen, dtype=torch.float64)
    y = torch.randn(rows, sum(widths), generator=gen, dtype=torch.float64)
    scales = torch.rand(nslices, nslots, generator=gen) + 0.5
    return x, y, pool, a_off, b_off, ranks, scales, seg, widths


@pytest.mark.parametrize("seed", range(6))
def test_sgmv_matches_naive_rows(seed):
    x, y, pool, a_off, b_off, ranks, scales, seg, widths = _case(seed)
    row_slot = torch.full((x.shape[0],), -1, dtype=torch.int32)
    for i in range(len(seg) - 1):
        row_slot[int(seg[i]) : int(seg[i + 1])] = i
    for layer in (0, 1):
        expect = _naive(y, x, pool, a_off, b_off, ranks, scales, row_slot, layer, widths)
        out = y.clone()
        ws = torch.full((len(widths), x.shape[0] + 1, 128), float("nan"), dtype=torch.float64)
        reference.add_lora_slices(out, x, LoraOperands(pool, a_off, b_off, ranks, scales, layer, widths, ws), seg)
        torch.testing.assert_close(out, expect, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("seed", range(6))
def test_bgmv_matches_naive_rows(seed):
    x, y, pool, a_off, b_off, ranks, scales, _, widths = _case(100 + seed)
    gen = torch.Generator().manual_seed(seed)
    row_slot = torch.randint(-1, ranks.shape[1], (x.shape[0],), generator=gen, dtype=torch.int32)
    expect = _naive(y, x, pool, a_off, b_off, ranks, scales, row_slot, 1, widths)
    out = y.clone()
    ws = torch.zeros(len(widths), x.shape[0], 128, dtype=torch.float64)
    reference.add_lora_slices_bgmv(out, x, LoraOperands(pool, a_off, b_off, ranks, scales, 1, widths, ws), row_slot)
    torch.testing.assert_close(out, expect, rtol=1e-9, atol=1e-9)
    untouched = row_slot < 0
    assert torch.equal(out[untouched], y[untouched])


def test_bf16_reference_rounds_shrink_result_once():
    x, y, pool, a_off, b_off, ranks, scales, seg, widths = _case(7)
    rows = x.shape[0]
    row_slot = torch.repeat_interleave(torch.arange(len(seg) - 1, dtype=torch.int32), torch.diff(seg))
    expect = _naive(y, x, pool, a_off, b_off, ranks, scales, row_slot, 0, widths)
    out = y.to(torch.bfloat16)
    ws = torch.zeros(len(widths), rows, 128, dtype=torch.bfloat16)
    ops = LoraOperands(pool.bfloat16(), a_off, b_off, ranks, scales, 0, widths, ws)
    reference.add_lora_slices(out, x.bfloat16(), ops, seg)
    err = (out.double() - expect).norm() / (expect - y).norm()
    assert err < 3e-2


def test_launch_plan_covers_every_work_item():
    from loraplex.kernels.checks import Problem
    from loraplex.kernels.cuda._plan import (DEC_ROWS, MAX_CLUSTER, MAX_KSPLIT, ONE_ROW_ITEMS_ROWS, PREFILL_BM,
                                             make_plan)

    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        nseg = int(torch.randint(1, 300, (1,), generator=gen))
        top = 3000 if _ % 2 else 3  # prefill-sized or decode-sized segments
        lengths = torch.randint(0, top, (nseg,), generator=gen) * (torch.rand(nseg, generator=gen) < 0.5)
        rows = int(lengths.sum()) + 1
        h_in = int(torch.randint(1, 20000, (1,), generator=gen))
        problem = Problem(rows, h_in, (64,) * (1 + nseg % 3), nseg, 16)
        wave = int(torch.randint(1, 2000, (1,), generator=gen))
        plan = make_plan(problem, 0, nseg, wave)
        assert plan.kc % 64 == 0 and (plan.ksplit - 1) * plan.kc < h_in <= plan.ksplit * plan.kc
        if plan.decode:  # one-row items up to ONE_ROW_ITEMS_ROWS rows, 4-row tiles past it
            assert plan.bm == (1 if rows <= ONE_ROW_ITEMS_ROWS else DEC_ROWS)
        else:  # one cluster of split blocks per item
            assert plan.bm == PREFILL_BM and plan.ksplit <= MAX_CLUSTER
        assert sum(math.ceil(int(n) / plan.bm) for n in lengths) <= plan.items
        assert 1 <= plan.ksplit <= MAX_KSPLIT
        if not plan.decode and plan.ksplit > 1:  # the prefill shrink's real blocks fit one wave of the device
            tiles = sum(math.ceil(int(n) / PREFILL_BM) for n in lengths)
            assert plan.ksplit * tiles * len(problem.widths) <= wave


def test_every_call_of_a_graph_step_takes_the_decode_kernels():
    """A step replayed from a CUDA graph (up to the engine's MAX_GRAPH_ROWS rows: a full batch of
    decodes plus short prompt chunks, one segment a sequence) takes the decode kernels: the prefill
    kernels' 128-row tiles would take a tile for each one-row segment, split for the few tiles its
    rows alone imply. Longer (eager) calls take the prefill kernels unless their segments average
    few rows for their rank (24 at rank 16, 6 at 64: the decode kernels' cost grows with the rank;
    an eager step's seg has its own segments, a graph's its capacity); BGMV is always decode."""
    from loraplex.inference_server.engine.cuda_graphs import MAX_GRAPH_ROWS
    from loraplex.kernels.checks import Problem
    from loraplex.kernels.cuda import _plan

    for rows in (1, 256, 257, 300, MAX_GRAPH_ROWS):
        assert _plan.is_decode(rows, _plan.MODE_SGMV, 1, 128)
        plan = _plan.make_plan(Problem(rows, 4096, (4096, 1024, 1024), 256, 16), _plan.MODE_SGMV, 256, 132)
        assert plan.decode and plan.bm == (1 if rows <= _plan.ONE_ROW_ITEMS_ROWS else _plan.DEC_ROWS)
    sgmv = _plan.MODE_SGMV
    assert not _plan.is_decode(MAX_GRAPH_ROWS + 1, sgmv, 1, 16)
    assert _plan.is_decode(1024, sgmv, 257, 16)  # 256 decodes beside a 768-row prompt chunk
    assert _plan.is_decode(2048, sgmv, 2048 // 16, 16) and not _plan.is_decode(2048, sgmv, 2048 // 32, 16)
    assert _plan.is_decode(2048, sgmv, 2048 // 4, 64) and not _plan.is_decode(2048, sgmv, 2048 // 8, 64)
    assert _plan.is_decode(2048, sgmv, 2048 // 16, 8)  # ranks under 16 count as 16
    assert _plan.is_decode(4096, _plan.MODE_BGMV, 4096, 128)


def test_prefill_split_k_counts_a_tile_for_each_segment():
    """An eager step on the prefill kernels: a 128-row tile for each segment, so 79 short prompts
    beside a long one leave no room for a split-K in one wave of 132 blocks, where the same rows
    as one prompt split 8 ways. The grid holds items for the step's own segments only."""
    from loraplex.kernels.checks import Problem
    from loraplex.kernels.cuda._plan import MAX_CLUSTER, MODE_SGMV, make_plan

    problem = Problem(2048, 4096, (4096,), 256, 16)  # 256 table columns: max_num_seqs
    many = make_plan(problem, MODE_SGMV, 80, 132)  # 79 prompts of 8 rows and one of 1416
    assert not many.decode and many.ksplit == 1 and many.items == 80 + 16
    one = make_plan(problem, MODE_SGMV, 1, 132)
    assert not one.decode and one.ksplit == min(132 // 16, MAX_CLUSTER) and one.items == 1 + 16


@pytest.mark.parametrize("rows", [1, 64, 65, 128, 256])
def test_decode_kernels_take_row_slot_runs_past_the_one_row_items(rows):
    """Which items each decode kernel walks, by the call's rows: up to ONE_ROW_ITEMS_ROWS one row
    each; past it, given a row_slot (the engine's calls), row_slot's runs in both kernels (one
    grid row a batch row, runs cut in 4-row tiles on the device); without a row_slot, seg's 4-row
    tiles; BGMV calls always one row each."""
    from loraplex.kernels.checks import Problem
    from loraplex.kernels.cuda import _launch, _plan

    seg = torch.tensor([0, rows], dtype=torch.int32)
    row_slot = torch.zeros(rows, dtype=torch.int32)
    problem = Problem(rows, 4096, (4096, 1024, 1024), 8, 16)
    plan = _plan.make_plan(problem, _plan.MODE_SGMV, 8, 0)
    bgmv = _plan.make_plan(problem, _plan.MODE_BGMV, rows, 0)
    for kernel in (_launch._shrink_items, _launch._expand_items):
        table, ntable, mode, items = kernel(plan, _launch.Call(None, None, None, seg, row_slot), rows)
        if rows <= _plan.ONE_ROW_ITEMS_ROWS:
            assert (table is row_slot, mode, items) == (True, _plan.MODE_BGMV, rows)
        else:
            assert (table is row_slot, ntable, mode, items) == (True, rows, _plan.MODE_RUNS, rows)
        without = kernel(plan, _launch.Call(None, None, None, seg), rows)
        if rows > _plan.ONE_ROW_ITEMS_ROWS:
            assert without[0] is seg and without[2] == _plan.MODE_SGMV and without[3] == plan.items
        assert kernel(bgmv, _launch.Call(None, None, None, row_slot), rows)[2:] == (_plan.MODE_BGMV, rows)


def test_cuda_wrappers_reject_cpu_tensors():
    from loraplex.kernels import cuda as kcuda

    x, y, pool, a_off, b_off, ranks, scales, seg, widths = _case(1)
    ws = torch.zeros(len(widths), x.shape[0], 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="CUDA"):
        kcuda.add_lora_slices(y.bfloat16(), x.bfloat16(),
                              LoraOperands(pool.bfloat16(), a_off, b_off, ranks, scales, 0, widths, ws), seg)


def test_expand_follows_its_shrink_early_for_prefill_and_one_pass_decode_calls():
    """The expand goes as the shrink's programmatic dependent for calls of both stages on a device
    that has it: prefill calls, and decode calls under a rank cap of 16; never for a stage call, a
    decode call of a larger cap (its shrink re-reads A through L1) or a device without it."""
    from loraplex.kernels.checks import Problem
    from loraplex.kernels.cuda._launch import expand_follows_early
    from loraplex.kernels.cuda._plan import make_plan

    def follows(rows, rank_cap, only=None, device_pdl=True):
        problem = Problem(rows, 4096, (4096,), 4, rank_cap)
        return expand_follows_early(make_plan(problem, 0, 4, 528), problem, only, device_pdl)

    assert follows(64, 16) and follows(1, 8) and follows(256, 16)
    assert not follows(64, 16, only="shrink") and not follows(64, 16, only="expand")
    assert follows(4096, 16) and follows(4096, 128)  # prefill, whatever the cap
    assert not follows(4096, 16, only="shrink") and not follows(4096, 64, device_pdl=False)
    assert not follows(64, 32) and not follows(64, 128)
    assert not follows(64, 16, device_pdl=False)


def test_prefill_split_k_is_capped_in_blocks_a_multiprocessor_and_by_the_cluster_size():
    """plan_call caps the prefill wave at PREFILL_MAX_BLOCKS_PER_SM blocks a multiprocessor,
    however many the shrink's occupancy allows (more splits measured slower), and the split at
    MAX_CLUSTER (an item's split blocks are one thread-block cluster)."""
    from types import SimpleNamespace

    import torch

    from loraplex.kernels.checks import Problem
    from loraplex.kernels.cuda._launch import PREFILL_MAX_BLOCKS_PER_SM, plan_call
    from loraplex.kernels.cuda._plan import MAX_CLUSTER, PREFILL_BM

    rt = SimpleNamespace(sms=132, resident_blocks=lambda *a: 16 * 132)
    for rows in (600, 1024, 4096, 9000):
        plan = plan_call(rt, Problem(rows, 4096, (4096,), 1, 16), 0, 1, torch.bfloat16)
        items = math.ceil(rows / PREFILL_BM)
        assert not plan.decode and plan.bm == PREFILL_BM
        assert plan.ksplit * items <= PREFILL_MAX_BLOCKS_PER_SM * 132 and plan.ksplit <= MAX_CLUSTER
        assert (plan.ksplit + 1) * items > PREFILL_MAX_BLOCKS_PER_SM * 132 or plan.ksplit == MAX_CLUSTER
    assert plan_call(rt, Problem(600, 4096, (4096,), 1, 16), 0, 1, torch.bfloat16).ksplit == MAX_CLUSTER
    from loraplex.kernels.cuda._plan import MODE_SGMV, Plan

    with pytest.raises(ValueError, match="invalid launch plan"):  # more splits than one cluster holds
        Plan(MODE_SGMV, 4, False, PREFILL_BM, 40, MAX_CLUSTER + 1, 64)
    assert Plan(MODE_SGMV, 4, True, 4, 40, MAX_CLUSTER + 1, 64).ksplit == MAX_CLUSTER + 1  # decode: global partials


def test_walking_expand_covers_a_call_in_one_wave_of_whole_column_groups():
    """The walking expand's tiles a block: as many column groups an item as one wave holds (whole
    groups: no ragged second wave), every column covered, at most MAX_WALK tiles."""
    from loraplex.kernels.cuda._plan import MAX_WALK, PREFILL_BM, walk_count
    from loraplex.kernels.cuda._tiles import WALK_BN

    # (widths, rows, resident blocks) -> tiles a block
    cases = {((4096,), 4096, 528): 4,  # 32 items x 16 groups of 4 tiles = 512 blocks
             ((11008,), 4096, 264): 22,  # 172 tiles: 32 x 8 groups = 256 blocks, not 32 x 11 = 352
             ((4096,), 300, 528): 1,  # 3 items: every tile its own block
             ((4096,), 200_000, 528): MAX_WALK,  # more items than a wave: the longest walk
             ((4096, 1024, 1024), 4096, 396): 8}  # q/k/v: 96 tiles over 12 groups an item
    for (widths, rows, wave), want in cases.items():
        walk = walk_count(widths, rows, PREFILL_BM, wave)
        assert walk == want, (widths, rows, wave, walk)
        groups = sum(-(-(-(-w // WALK_BN)) // walk) for w in widths)
        assert walk * groups >= sum(-(-w // WALK_BN) for w in widths)  # every column tile has a block
