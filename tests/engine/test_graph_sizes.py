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
