"""A request's token stream: a reader that keeps up gets one event a step; a reader that fell
behind gets everything waiting as one event, with the same tokens, text, log-probabilities and
finish; an engine failure is never merged with the tokens before it."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest

from loraplex.inference_server.engine.request import FinishReason, Timings, TokenEvent, Usage
from loraplex.inference_server.engine.token_stream import MAX_MERGED_TOKENS, TokenStream, merge_events
from lora_helpers import collect, greedy_request, load_engine, make_test_adapters, text_of, tokens_of


def _token(i: int, logprobs: bool = False) -> TokenEvent:
    lp = (-0.1 * i,) if logprobs else None
    tops = ({i: -0.1 * i, i + 1: -1.0 - i},) if logprobs else None
    return TokenEvent("r", (i,), f"t{i} ", lp, tops)


def _last(i: int, reason: FinishReason = FinishReason.LENGTH) -> TokenEvent:
    return TokenEvent("r", (i,), f"t{i}.", None, None, reason, Usage(3, i), Timings(0.1, 0.2, 0.3))


def _drain(stream: TokenStream, n: int) -> list[TokenEvent]:
    async def main() -> list[TokenEvent]:
        return [await asyncio.wait_for(stream.get(), 5) for _ in range(n)]  # fewer events fail, not hang

    return asyncio.run(main())


def test_a_reader_that_keeps_up_gets_each_event_as_it_was_put() -> None:
    async def main() -> list[TokenEvent]:
        stream, got = TokenStream(), []
        for i in range(3):
            stream.put(_token(i))
            got.append(await stream.get())
        return got

    assert asyncio.run(main()) == [_token(0), _token(1), _token(2)]


def test_events_waiting_for_a_reader_arrive_as_one() -> None:
    stream = TokenStream()
    for i in range(4):
        stream.put(_token(i, logprobs=True))
    stream.put(TokenEvent("r", (4,), "end", (-0.4,), ({4: -0.4},), FinishReason.STOP, Usage(3, 5),
                          Timings(0.1, 0.2, 0.3)))
    (event,) = _drain(stream, 1)
    assert event.token_ids == (0, 1, 2, 3, 4)
    assert event.text == "t0 t1 t2 t3 end"
    assert event.logprobs == pytest.approx((0.0, -0.1, -0.2, -0.3, -0.4))
    assert [sorted(t) for t in event.top_logprobs] == [[0, 1], [1, 2], [2, 3], [3, 4], [4]]
    assert event.finish_reason is FinishReason.STOP
    assert event.usage == Usage(3, 5) and event.timings == Timings(0.1, 0.2, 0.3)


def test_a_request_without_logprobs_keeps_none_and_a_tokenless_finish_joins() -> None:
    abort = TokenEvent("r", (), "", finish_reason=FinishReason.ABORT, usage=Usage(3, 2))
    merged = merge_events([_token(0), _token(1), abort])
    assert merged.logprobs is None and merged.top_logprobs is None
    assert merged.token_ids == (0, 1) and merged.finish_reason is FinishReason.ABORT
    with_logprobs = merge_events([_token(0, logprobs=True), abort])
    assert with_logprobs.logprobs == (0.0,) and len(with_logprobs.top_logprobs) == 1


def test_the_prompt_logprobs_of_the_first_token_event_survive_a_merge() -> None:
    """A slow reader (a loaded event loop) must still get the prompt's log-probabilities that
    only the first token event carries (echo with logprobs, prompt_logprobs)."""
    first = dataclasses.replace(_token(0, logprobs=True), prompt_logprobs=(None, -1.5, -0.25),
                                prompt_top_logprobs=(None, {7: -1.5}, {8: -0.25}))
    stream = TokenStream()
    for event in (first, _token(1, logprobs=True), _last(2)):
        stream.put(event)
    (event,) = _drain(stream, 1)
    assert event.token_ids == (0, 1, 2)
    assert event.prompt_logprobs == (None, -1.5, -0.25)
    assert event.prompt_top_logprobs == (None, {7: -1.5}, {8: -0.25})
    assert merge_events([_token(0), _last(1)]).prompt_logprobs is None  # a request that asked for none


def test_an_error_is_not_merged_with_the_tokens_before_it() -> None:
    stream = TokenStream()
    error = TokenEvent("r", (), "", finish_reason=FinishReason.ERROR)
    for event in (_token(0), _token(1), error):
        stream.put(event)
    first, second = _drain(stream, 2)
    assert first.token_ids == (0, 1) and first.finish_reason is None and first.text == "t0 t1 "
    assert second == error


def test_nothing_is_merged_past_the_finishing_event() -> None:
    stream = TokenStream()
    for event in (_token(0), _last(1), _token(2)):
        stream.put(event)
    first, second = _drain(stream, 2)
    assert first.token_ids == (0, 1) and first.finish_reason is FinishReason.LENGTH
    assert second == _token(2)


def test_a_merged_event_holds_at_most_max_merged_tokens() -> None:
    stream = TokenStream()
    total = 2 * MAX_MERGED_TOKENS + 5
    for i in range(total - 1):
        stream.put(_token(i))
    stream.put(_last(total - 1))
    events = _drain(stream, 3)
    assert [len(e.token_ids) for e in events] == [MAX_MERGED_TOKENS, MAX_MERGED_TOKENS, 5]
    assert [t for e in events for t in e.token_ids] == list(range(total))
    assert events[-1].finish_reason is FinishReason.LENGTH and events[0].finish_reason is None


@pytest.fixture(scope="module")
def adapter_dir(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_test_adapters(tiny_llama_dir, tmp_path_factory.mktemp("adapters"))


def test_a_slow_reader_of_the_engine_gets_every_token_in_fewer_events(tiny_llama_dir: Path,
                                                                        adapter_dir: Path) -> None:
    """What a client that reads slower than the steps sees: the same tokens and text as a
    client that keeps up, in fewer messages, and the finish with usage on the last."""
    engine = load_engine(tiny_llama_dir, adapter_dir)
    prompt = engine.tokenizer.encode("Once upon a time")
    n = 40

    async def main() -> tuple[list[TokenEvent], list[TokenEvent]]:
        await engine.start()
        try:
            fast = await collect(engine, greedy_request("fast", prompt, "attn-r8", n))
            slow = []
            async for event in engine.generate(greedy_request("slow", prompt, "attn-r8", n)):
                slow.append(event)
                if len(slow) == 1:
                    while engine.stats().num_running:  # the engine finishes while this reader waits
                        await asyncio.sleep(0.01)
                    await asyncio.sleep(0.1)  # and its last step's events reach the loop
            return fast, slow
        finally:
            await engine.shutdown()

    fast, slow = asyncio.run(main())
    assert tokens_of(slow) == tokens_of(fast) and len(tokens_of(fast)) == n
    assert text_of(slow) == text_of(fast)
    # the first token, then the rest at once (the last step's events may trail in a loaded run)
    assert 2 <= len(slow) <= 3, [len(e.token_ids) for e in slow]
    assert slow[-1].finish_reason is FinishReason.LENGTH and slow[-1].usage.completion_tokens == n
