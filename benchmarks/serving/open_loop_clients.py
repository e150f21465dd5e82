"""The open-loop clients of bench_open_loop.py: each request sent at its time over gRPC or HTTP, timed.

gRPC goes through the raw generated stubs on grpc.aio (as bench_grpc_vs_inprocess.py's workers), HTTP
through sse_client.py's raw SSE reader on /v1/completions (``prompt`` as token ids, ``model`` =
the adapter id or the base model's id, ``stream_options.include_usage`` for the token count).
Both ask for greedy decoding, ``ignore_eos`` and max_new_tokens = the drawn output length; a
constrained request (``--constrained-fraction``) asks for CONSTRAINED_SCHEMA instead of ``ignore_eos``:
an array of at least 4096 digits, which no drawn length completes, so it too runs to its length
while every step masks its tokens.

One process may not keep up with thousands of tokens/s of streamed messages, so a ClientPool of
worker processes splits each run's requests round robin; every worker sleeps until the run's
common start (time.perf_counter is CLOCK_MONOTONIC, one clock for all processes on Linux) and
then sends each of its requests at start + send_at, whether or not earlier ones have answered.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import time
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from benchmarks.serving.sse_client import HttpError, post_json
from benchmarks.serving.open_loop_metrics import RequestRecord
from benchmarks.serving.open_loop_workload import BenchRequest

EDGES = ("grpc", "http")
CONSTRAINED_SCHEMA = json.dumps({"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                                 "minItems": 4096})


@dataclass(frozen=True, slots=True)
class Endpoint:
    """Where the server listens, and the base model's id on its HTTP edge."""

    grpc_address: str
    http_port: int
    base_model: str


def _record(req: BenchRequest) -> RequestRecord:
    return RequestRecord(req.index, req.adapter, len(req.prompt), req.expected_tokens, time.perf_counter(),
                         choices=req.choices)


async def grpc_request(stub, pb, req: BenchRequest, timeout_s: float) -> RequestRecord:  # noqa: ANN001
    """Send ``req`` now over gRPC; its record (tokens counted from the streamed token ids)."""
    import grpc

    rec = _record(req)
    message = pb.GenerateRequest(adapter_id=req.adapter or "", token_ids=pb.TokenIds(ids=req.prompt),
                                 stopping=pb.StoppingCriteria(max_new_tokens=req.output_len,
                                                              ignore_eos=not req.constrained))
    if req.choices > 1:
        message.n = req.choices
    if req.constrained:
        message.response_format.json_schema = CONSTRAINED_SCHEMA
    finish = "none"
    try:
        async for m in stub.Generate(message, timeout=timeout_s):
            if m.token_ids:
                rec.arrivals.append(time.perf_counter())
                rec.tokens += len(m.token_ids)
            if m.finish_reason:
                finish = pb.FinishReason.Name(m.finish_reason).removeprefix("FINISH_REASON_").lower()
        if finish != "length":
            rec.error = f"finish reason {finish}"
    except grpc.aio.AioRpcError as exc:
        rec.error = f"gRPC {exc.code().name}"
    rec.done = time.perf_counter()
    rec.fail_if_short()
    return rec


def completion_body(req: BenchRequest, base_model: str) -> dict:
    """The /v1/completions body of ``req``: token-id prompt, greedy, exactly output_len tokens."""
    body = {"model": req.adapter or base_model, "prompt": list(req.prompt), "max_tokens": req.output_len,
            "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    if req.choices > 1:
        body["n"] = req.choices
    if req.constrained:
        del body["ignore_eos"]
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "digits", "schema": json.loads(CONSTRAINED_SCHEMA)}}
    return body


async def http_request(endpoint: Endpoint, req: BenchRequest, timeout_s: float) -> RequestRecord:
    """Send ``req`` now over HTTP (SSE); its record (tokens from the usage chunk)."""
    rec = _record(req)
    finish, writer = "none", None
    try:
        async with asyncio.timeout(timeout_s):
            reader, writer = await asyncio.open_connection("127.0.0.1", endpoint.http_port)
            response = await post_json(reader, writer, "/v1/completions", completion_body(req, endpoint.base_model))
            async for data in response.sse_data():
                if data == b"[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    raise RuntimeError(f"error event {event['error'].get('type', '')}")
                if event.get("usage"):
                    rec.tokens = event["usage"]["completion_tokens"]
                for choice in event["choices"]:
                    rec.arrivals.append(time.perf_counter())
                    finish = choice.get("finish_reason") or finish
        if finish != "length":
            rec.error = f"finish reason {finish}"
    except HttpError as exc:
        rec.error = f"HTTP {exc.status}"
    except TimeoutError:
        rec.error = "timeout"
    except (OSError, RuntimeError, ValueError, asyncio.IncompleteReadError) as exc:
        rec.error = str(exc)[:80] if isinstance(exc, RuntimeError) else type(exc).__name__
    finally:
        if writer is not None:
            writer.close()
    rec.done = time.perf_counter()
    rec.fail_if_short()
    return rec


async def _send_all(requests: list[BenchRequest], start: float,
                    send: Callable[[BenchRequest], Awaitable[RequestRecord]]) -> list[RequestRecord]:
    async def at_its_time(req: BenchRequest) -> RequestRecord:
        await asyncio.sleep(max(0.0, start + req.send_at - time.perf_counter()))
        return await send(req)

    return list(await asyncio.gather(*(at_its_time(r) for r in requests)))


async def run_share(edge: str, endpoint: Endpoint, requests: list[BenchRequest], start: float,
                    timeout_s: float = 600.0) -> list[RequestRecord]:
    """Send each of ``requests`` at ``start`` + its send_at (perf_counter seconds) over ``edge``."""
    if edge not in EDGES:
        raise ValueError(f"edge must be one of {EDGES}, got {edge!r}")
    if edge == "http":
        return await _send_all(requests, start, lambda req: http_request(endpoint, req, timeout_s))
    import grpc

    from loraplex.v1 import inference_pb2 as pb
    from loraplex.v1 import inference_pb2_grpc as pb_grpc

    async with grpc.aio.insecure_channel(endpoint.grpc_address) as channel:
        stub = pb_grpc.InferenceServiceStub(channel)
        await channel.channel_ready()
        return await _send_all(requests, start, lambda req: grpc_request(stub, pb, req, timeout_s))


def _worker(inbox: mp.Queue, outbox: mp.Queue) -> None:
    """A client process: run each job (edge, endpoint, requests, start, timeout) it is given."""
    while (job := inbox.get()) is not None:
        try:
            outbox.put((True, asyncio.run(run_share(*job))))
        except Exception:  # noqa: BLE001  (reported to the parent, which raises it)
            outbox.put((False, traceback.format_exc()))


class ClientPool:
    """``procs`` client processes, started once and reused by every run."""

    def __init__(self, procs: int) -> None:
        if procs < 1:
            raise ValueError(f"client processes must be >= 1, got {procs}")
        ctx = mp.get_context("spawn")
        self._outbox: mp.Queue = ctx.Queue()
        self._inboxes = [ctx.Queue() for _ in range(procs)]
        self._procs = [ctx.Process(target=_worker, args=(q, self._outbox), daemon=True) for q in self._inboxes]
        for p in self._procs:
            p.start()

    def run(self, edge: str, endpoint: Endpoint, requests: list[BenchRequest], lead_s: float = 1.0,
            timeout_s: float = 600.0) -> list[RequestRecord]:
        """Every request's record, in request order; the run starts ``lead_s`` from now (time for
        the workers to connect)."""
        start = time.perf_counter() + lead_s
        shares = [requests[i::len(self._procs)] for i in range(len(self._procs))]
        busy = [(q, s) for q, s in zip(self._inboxes, shares) if s]
        for inbox, share in busy:
            inbox.put((edge, endpoint, share, start, timeout_s))
        wait = lead_s + max((r.send_at for r in requests), default=0.0) + timeout_s + 60
        records = []
        for _ in busy:
            ok, got = self._outbox.get(timeout=wait)
            if not ok:
                raise RuntimeError(f"a client process failed:\n{got}")
            records += got
        return sorted(records, key=lambda r: r.index)

    def close(self) -> None:
        for inbox in self._inboxes:
            inbox.put(None)
        for p in self._procs:
            p.join(30)
            if p.is_alive():
                p.terminate()

