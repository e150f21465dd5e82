"""Which step sizes get a CUDA graph: every batch up to the batch size has one to pad to."""

import pytest

from loraplex.inference_server.engine.cuda_graphs import MAX_GRAPH_ROWS, default_sizes


@pytest.mark.parametrize("max_num_seqs", [1, 3, 8, 32, 100, 128, 256, 300])
def test_every_batch_up_to_the_batch_size_pads_to_a_captured_size(max_num_seqs: int) -> None:
    sizes = default_sizes(max_num_seqs, 2048)
    assert list(sizes) == sorted(set(sizes))
    assert max_num_seqs in sizes
    for batch in range(1, max_num_seqs + 1):
        padded = min(s for s in sizes if s >= batch)
        assert padded - batch <= max(7, batch // 2), (batch, padded)  # at most half the batch is padding
    assert max(sizes) == MAX_GRAPH_ROWS  # short prompts admitted beside a decode batch stay in graphs


def test_batch_256_captures_few_sizes_and_the_token_budget_caps_them() -> None:
    assert len(default_sizes(256, 2048)) <= 20  # start-up time and graph memory at the default GPU batch
    assert default_sizes(32, 2048)[:7] == (1, 2, 4, 8, 16, 24, 32)
    capped = default_sizes(256, 300)
    assert max(capped) == 300 and 256 in capped


def test_a_step_replays_the_smallest_graph_that_holds_it_or_runs_eagerly() -> None:
    from loraplex.inference_server.engine.cuda_graphs import GraphShape, graph_size
    from loraplex.inference_server.engine.step_plan import SpanPlan

    shape = GraphShape(default_sizes(32, 2048), max_blocks=8, block_size=16, pad_slot=0)
    decodes = [SpanPlan(i, 1, 100, (0,) * 7) for i in range(20)]
    assert graph_size(shape, 20, decodes, samples=True) == 24
    assert graph_size(shape, 20, decodes, samples=False) is None  # nothing to sample: eager
    assert graph_size(shape, 0, [], samples=True) is None
    prompt = SpanPlan(20, 100, 100, (0,) * 7)  # a fresh 100-token prompt beside the decodes
    assert graph_size(shape, 120, [*decodes, prompt], samples=True) == 128
    wide = SpanPlan(0, 1, 200, (0,) * 13)  # a block table wider than the graphs'
    assert graph_size(shape, 1, [wide], samples=True) is None
    assert graph_size(shape, MAX_GRAPH_ROWS + 1, decodes, samples=True) is None
    late_chunk = SpanPlan(0, 200, 1000, (0,) * 63)  # 200 rows over 800 cached tokens: past graph_span
    assert graph_size(GraphShape(shape.sizes, 64, 16, 0), 200, [late_chunk], samples=True) is None
    assert graph_size(GraphShape(shape.sizes, 64, 16, 0), 200, [SpanPlan(0, 200, 200, (0,) * 13)], True) == 256
