"""The prefill kernels' alternative paths give the same y: the split-K sum in a cluster or in
global memory, x by TMA or by cp.async, the expand launched early or in plain stream order, the
expand on wgmma or mma.sync (bitwise where the arithmetic is the same), and the float64
reference's."""

from __future__ import annotations

import pytest
import torch

from loraplex.kernels import cuda as kcuda
from lora_problems import assert_close_rows, make_batch, reference64, seg_from_lengths

DTYPES = [torch.bfloat16, torch.float16]


@pytest.mark.parametrize("split", ["global", "unsplit"])
@pytest.mark.parametrize("rank_cap", [16, 64, 128])
def test_prefill_split_summed_without_a_cluster_gives_the_cluster_result(split, rank_cap, monkeypatch):
    """The prefill shrink's split-K partials, summed in the cluster's shared memory (sm_90+) or in
    global memory by each item's last block (devices without clusters), give bitwise the same y
    (the same sums in the same order); a shrink with no split at all gives the reference's."""
    from loraplex.kernels.checks import check_args
    from loraplex.kernels.cuda._launch import plan_call

    gen = torch.Generator().manual_seed(4100 + rank_cap)
    lengths = [700, 0, 1300, 130, 1]
    ranks = torch.randint(1, rank_cap + 1, (2, len(lengths)), generator=gen)
    batch = make_batch(gen, rows=sum(lengths), h_in=3000, widths=(1000, 333), ranks=ranks,
                       table=seg_from_lengths(lengths), rank_cap=rank_cap)
    rt = kcuda.default_cache().get(batch.x.device)
    if not rt.clusters:
        pytest.skip("no thread-block clusters on this device")
    problem = check_args(batch.y, batch.x, batch.ops())
    assert plan_call(rt, problem, 0, problem.nslots, batch.x.dtype).ksplit > 1  # the split is what is tested
    y0 = batch.y.clone()
    expected = reference64(batch, False)  # from y0: the reference adds into the y it is given
    kcuda.add_lora_slices(*batch.args())
    in_cluster = batch.y.clone()
    batch.y.copy_(y0)
    if split == "global":
        monkeypatch.setattr(rt, "clusters", False)
    else:
        monkeypatch.setattr("loraplex.kernels.cuda._launch.PREFILL_MAX_BLOCKS_PER_SM", 0)
        assert plan_call(rt, problem, 0, problem.nslots, batch.x.dtype).ksplit == 1
    kcuda.add_lora_slices(*batch.args())
    torch.cuda.synchronize()
    if split == "global":
        assert torch.equal(batch.y, in_cluster)
    assert_close_rows(batch.y, expected, y0)


@pytest.mark.parametrize("h_in, x_pad, rank_step", [(4096, 0, 8), (3000, 8, 8), (2048, 3, 8), (4096, 0, 4)])
@pytest.mark.parametrize("rank_cap", [16, 64, 128])
def test_prefill_shrink_x_by_tma_gives_the_cp_async_result(h_in, x_pad, rank_step, rank_cap, monkeypatch):
    """sm_90: the prefill shrink's x tiles by TMA (whole stages; a block with a partial k-range or
    an x no tensor map fits keeps cp.async) sum the same products in the same order as the
    cp.async copies: bitwise the same y, and the reference's. At rank cap 128 the TMA stages are
    multiplied by wgmma (sm_90a; n64 for ranks up to 64, n128 above), the cp.async ones by
    mma.sync: the tensor cores' sums are the same."""
    gen = torch.Generator().manual_seed(4300 + rank_cap + h_in + x_pad + rank_step)
    lengths = [700, 0, 1300, 130, 1]
    # ranks of multiples of rank_step (the A pieces' 16-byte copies, or 8-byte ones at 4: the TMA
    # path takes both), the cap among them
    ranks = rank_step * torch.randint(1, rank_cap // rank_step + 1, (2, len(lengths)), generator=gen)
    ranks[0, 2] = rank_cap
    batch = make_batch(gen, rows=sum(lengths), h_in=h_in, widths=(1000, 333), ranks=ranks, x_pad=x_pad,
                       table=seg_from_lengths(lengths), rank_cap=rank_cap)
    rt = kcuda.default_cache().get(batch.x.device)
    if not rt.tma:
        pytest.skip("no TMA on this device")
    by_tma, by_cp_async, expected, y0 = _on_and_off(batch, monkeypatch, "SHRINK_TMA")
    assert torch.equal(by_tma, by_cp_async)
    assert_close_rows(by_tma, expected, y0)


@pytest.mark.parametrize("rank_cap", [16, 128])
def test_prefill_expand_launched_early_gives_the_stream_ordered_result(rank_cap, monkeypatch):
    """sm_90: the prefill expand goes as its shrink's programmatic dependent (its blocks fetch y
    and B while the shrink runs, and wait for the shrink before reading v): y is bitwise the y of
    the two kernels in plain stream order, and the reference's (the workspace starts as NaN, so a
    v read too early shows)."""
    gen = torch.Generator().manual_seed(4600 + rank_cap)
    lengths = [2048, 300, 1, 900]
    ranks = torch.randint(1, rank_cap + 1, (2, len(lengths)), generator=gen)
    batch = make_batch(gen, rows=sum(lengths), h_in=2048, widths=(1024, 512), ranks=ranks,
                       table=seg_from_lengths(lengths), rank_cap=rank_cap)
    if not kcuda.default_cache().get(batch.x.device).pdl:
        pytest.skip("no programmatic dependent launch on this device")
    early, ordered, expected, y0 = _on_and_off(batch, monkeypatch, "PREFILL_PDL")
    assert torch.equal(early, ordered)
    assert_close_rows(early, expected, y0)


@pytest.mark.parametrize("widths, rank_cap", [((1000, 333), 128), ((4096,), 128), ((1024, 512), 64), ((700,), 48)])
def test_prefill_expand_on_wgmma_gives_the_mma_sync_result(widths, rank_cap, monkeypatch):
    """sm_90a: the prefill expand multiplies ranks from _tiles.WALK_WG_MIN_RANK by wgmma (v and B
    in the swizzled layout its descriptors read), the others by mma.sync, block by block. Every
    block on wgmma, every block on mma.sync, and the launcher's mix (ranks on both sides of the
    threshold, edge tiles, short items): bitwise the same y, and the reference's."""
    from loraplex.kernels.cuda import _tiles  # noqa: PLC0415
    from loraplex.kernels.cuda._nvrtc import arch_specific_target  # noqa: PLC0415

    if arch_specific_target("lora_expand.cu", torch.cuda.get_device_capability()) is None:
        pytest.skip("no sm_90a build of the expand on this device")
    gen = torch.Generator().manual_seed(4700 + rank_cap + sum(widths))
    lengths = [700, 0, 1300, 130, 1]
    ranks = torch.randint(1, rank_cap + 1, (len(widths), len(lengths)), generator=gen)
    ranks[0, 0], ranks[0, 2] = rank_cap, 8  # both paths in every launch
    batch = make_batch(gen, rows=sum(lengths), h_in=1024, widths=widths, ranks=ranks,
                       table=seg_from_lengths(lengths), rank_cap=rank_cap)
    y0 = batch.y.clone()
    expected = reference64(batch, False)
    out = {}
    for name, threshold in (("mixed", _tiles.WALK_WG_MIN_RANK), ("wgmma", 1), ("mma.sync", 129)):
        monkeypatch.setattr(_tiles, "WALK_WG_MIN_RANK", threshold)
        batch.y.copy_(y0)
        kcuda.add_lora_slices(*batch.args())
        torch.cuda.synchronize()
        out[name] = batch.y.clone()
    assert torch.equal(out["wgmma"], out["mma.sync"])
    assert torch.equal(out["mixed"], out["mma.sync"])
    assert_close_rows(out["mixed"], expected, y0)


def _on_and_off(batch, monkeypatch, flag: str):
    """(y with the launcher's `flag` as it is, y with it False, the float64 reference, y0): the
    same add_lora call on the same y0 both ways."""
    from loraplex.kernels.cuda import _launch  # noqa: PLC0415

    y0 = batch.y.clone()
    expected = reference64(batch, False)
    kcuda.add_lora_slices(*batch.args())
    on = batch.y.clone()
    batch.y.copy_(y0)
    monkeypatch.setattr(_launch, flag, False)
    kcuda.add_lora_slices(*batch.args())
    torch.cuda.synchronize()
    return on, batch.y, expected, y0
