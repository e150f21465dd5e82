"""Which prefill chunks a CUDA-graph step may hold, and which an eager step sends to the paged
decode kernel: a graph replay re-reads each row's causal prefix, so a chunk's rows may read up
to GRAPH_PREFILL_READS cached tokens in all; an eager step keeps longer chunks on SDPA."""

from loraplex.inference_server.engine.step_plan import (GRAPH_PREFILL_READS, SHORT_PREFILL_READS, SpanPlan,
                                                        causal_reads, graph_span, kernel_span)


def span(q_len: int, ctx_len: int) -> SpanPlan:
    return SpanPlan(q_start=0, q_len=q_len, ctx_len=ctx_len, block_table=(0,))


def test_causal_reads_counts_each_rows_prefix() -> None:
    assert causal_reads(span(1, 300)) == 300  # a decode row reads its whole context
    assert causal_reads(span(3, 3)) == 1 + 2 + 3  # a fresh prompt: row i reads i + 1 tokens
    assert causal_reads(span(2, 10)) == 9 + 10  # a chunk after 8 cached tokens
    assert causal_reads(span(4, 4)) == sum(range(1, 5))


def test_a_fresh_prompt_of_up_to_511_tokens_stays_in_a_graph_step() -> None:
    assert graph_span(span(511, 511))
    assert not graph_span(span(512, 512))
    assert causal_reads(span(511, 511)) <= GRAPH_PREFILL_READS < causal_reads(span(512, 512))


def test_a_chunk_over_a_long_context_leaves_the_graphs_sooner() -> None:
    assert graph_span(span(128, 1024))  # 128 rows over 896 cached tokens
    assert not graph_span(span(256, 1280))  # the same rows read ~2x the limit
    assert graph_span(span(1, 100_000))  # decodes always fit: one row each


def test_eager_steps_keep_long_prompts_off_the_decode_kernel() -> None:
    assert kernel_span(span(128, 128)) and 128 * 128 <= SHORT_PREFILL_READS
    assert not kernel_span(span(224, 224))  # SDPA in an eager step, a graph replay where the step fits
    assert graph_span(span(224, 224))
    assert kernel_span(span(1, 100_000))
