"""A model-free engine with the AsyncEngine interface, to measure the serving edge alone.

Like the real engine, a step thread produces one token for every running request each
step and hands the step's events to the event loop with one ``call_soon_threadsafe``, into
the same per-request ``TokenStream`` (a reader behind gets the waiting events merged); it
just does no model work, so it can feed the edge far more tokens per second than any model.
Each token's text is the ``time.perf_counter()`` at which the step made it, and a space
(CLOCK_MONOTONIC, the same clock in every process of the machine), so a client can measure
the delivery latency of every token, also of tokens merged into one message.

    python -m benchmarks.serving.synthetic_engine --port 50051 --step-ms 1     # a loraplex server over it
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import threading
import time
from collections.abc import AsyncIterator


from loraplex.inference_server.engine.info import EngineInfo, EngineStats
from loraplex.inference_server.engine.request import (
    FinishReason, GenerationRequest, Timings, TokenEvent, Usage)
from loraplex.inference_server.engine.token_stream import TokenStream


SYNTHETIC_INFO = EngineInfo(model_name="synthetic", dtype="none", device="cpu", max_context_len=1 << 20,
                            max_batch_size=1 << 16, max_new_tokens_limit=1 << 20, vocab_size=32000,
                            eos_token_ids=(), max_lora_rank=128)


class SyntheticTokenizer:
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [min(ord(c), 31999) for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(map(chr, ids))

    def token_bytes(self, token_id: int) -> bytes:
        return chr(token_id).encode()

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        return self.encode("".join(m["content"] for m in messages))


class SyntheticEngine:
    """One token per running request every ``step_s`` seconds; any adapter id is accepted."""

    def __init__(self, step_s: float = 0.001) -> None:
        if not step_s > 0:
            raise ValueError(f"step_s must be > 0, got {step_s}")
        self.info = SYNTHETIC_INFO
        self.tokenizer = SyntheticTokenizer()
        self.adapters = None  # no adapter management: the bench never calls it
        self._step_s = step_s
        self._running: dict[str, list] = {}  # request id -> [request, tokens done, stream, t0]
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closing = threading.Event()
        self._thread: threading.Thread | None = None

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="synthetic-steps", daemon=True)
        self._thread.start()

    async def shutdown(self) -> None:
        self._closing.set()
        if self._thread is not None:
            self._thread.join(5)

    def stats(self) -> EngineStats:
        return EngineStats(num_running=len(self._running), num_waiting=0, free_kv_blocks=0, total_kv_blocks=0,
                           resident_adapters=0, preemptions=0)

    def pool_stats(self) -> None:
        return None  # no adapter pool

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._running.pop(request_id, None)

    async def generate(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        stream = TokenStream()
        with self._lock:
            self._running[request.request_id] = [request, 0, stream, time.perf_counter()]
        try:
            while True:
                event = await stream.get()
                yield event
                if event.finish_reason is not None:
                    return
        finally:
            self.abort(request.request_id)

    def _run(self) -> None:
        while not self._closing.wait(self._step_s):
            events = []
            stamp = f"{time.perf_counter():.9f} "
            with self._lock:
                for rid, entry in list(self._running.items()):
                    request, done, stream, t0 = entry
                    entry[1] = done = done + 1
                    token = 100 + done % 1000
                    if done < request.stopping.max_new_tokens:
                        events.append((stream, TokenEvent(rid, (token,), stamp)))
                        continue
                    del self._running[rid]
                    elapsed = time.perf_counter() - t0
                    events.append((stream, TokenEvent(
                        rid, (token,), stamp, finish_reason=FinishReason.LENGTH,
                        usage=Usage(len(request.prompt_token_ids), done), timings=Timings(0.0, elapsed, elapsed))))
            if events and self._loop is not None:
                self._loop.call_soon_threadsafe(_dispatch, events)


def _dispatch(events: list) -> None:
    for stream, event in events:
        stream.put(event)


def _positive(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def main() -> int:
    """Serve the synthetic engine with the real loraplex server (loraplex.inference_server.main.serve)."""
    from loraplex.inference_server.main import configure_logging, serve  # noqa: PLC0415
    from loraplex.inference_server.settings import ServerSettings  # noqa: PLC0415

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--step-ms", type=_positive, default=1.0)
    parser.add_argument("--http-port", type=int, default=0, help="the OpenAI-compatible HTTP port (0: off)")
    parser.add_argument("--metrics-port", type=int, default=0, help="Prometheus /metrics (0: off)")
    args = parser.parse_args()
    settings = ServerSettings.from_sources(["--port", str(args.port), "--metrics-port", str(args.metrics_port),
                                            "--http-port", str(args.http_port),
                                            "--log-level", "WARNING", "--max-concurrent-streams", "100000"], {})
    configure_logging(settings)
    return asyncio.run(serve(settings, build=lambda: SyntheticEngine(args.step_ms / 1000)))


if __name__ == "__main__":
    sys.exit(main())
