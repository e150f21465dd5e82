"""The asyncio front of the engine: ``generate`` streams token events, ``abort`` cancels.

The step loop runs in its own thread (model work never blocks the event loop); adapter
loading runs in a small thread pool (a cold adapter never blocks the step loop). Events
cross back to the event loop with ``call_soon_threadsafe``. On the CPU the step loop's
OpenMP team is kept the only one in the process (engine/cpu_threads.py says why).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from loraplex.adapter_store.errors import (AdapterNotFoundError, InvalidRequestError, ResourceExhaustedError,
                                            UnavailableError)
from loraplex.inference_server.engine import cpu_threads
from loraplex.inference_server.engine.admission import Admission
from loraplex.inference_server.engine.config import EngineConfig
from loraplex.inference_server.engine.info import EngineInfo, EngineStats
from loraplex.inference_server.engine.llm_engine import LLMEngine
from loraplex.inference_server.engine.lora_capacity import LoraCapacity
from loraplex.inference_server.engine.request import FinishReason, GenerationRequest, Timings, TokenEvent, Usage
from loraplex.inference_server.engine.token_stream import TokenStream
from loraplex.inference_server.lora.managed_adapters import ManagedAdapters
from loraplex.inference_server.lora.pool.adapter_pool import AcquireCancelled, AdapterPool
from loraplex.inference_server.lora.pool.pool_stats import PoolStats

log = logging.getLogger(__name__)


class AsyncEngine:
    def __init__(
        self, core: LLMEngine, manager: AdapterPool, adapters: ManagedAdapters, info: EngineInfo, config: EngineConfig,
        capacity: LoraCapacity,
    ) -> None:
        self._core = core
        self._manager = manager
        self._capacity = capacity
        self._unqueued: dict[str, _Unqueued] = {}  # requests the step loop does not have yet
        self.adapters = adapters
        self.info = info
        self.tokenizer = core.tokenizer
        self._config = config
        self._streams: dict[str, TokenStream] = {}
        self._admission = Admission(config.max_streams)  # streams, by tenant
        self._ops: list[Callable[[], None]] = []
        self._cv = threading.Condition()
        self._on_cpu = str(config.device).startswith("cpu")
        self._intra_op_threads = torch.get_num_threads()  # the step loop's, read before loaders change it
        # loader threads mostly wait (store I/O, their turn for pool space, copy events)
        self._loader = ThreadPoolExecutor(max_workers=64, thread_name_prefix="adapter-loader",
                                          initializer=cpu_threads.one_intra_op_thread if self._on_cpu else None)
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closing = False

    # -- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        if self._on_cpu:  # this thread may have loaded the model; it runs no model work from now on
            cpu_threads.release_openmp_team()
        self._thread = threading.Thread(target=self._run, name="engine-step-loop", daemon=True)
        self._thread.start()
        self.adapters.start_watching()

    async def shutdown(self) -> None:
        """Abort everything still running and stop the step loop."""
        self._closing = True
        self.adapters.stop_watching()
        for rid in list(self._streams):
            self.abort(rid)
        with self._cv:
            self._cv.notify_all()
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join, 30)
        self._core.runner.close()  # tensor parallelism: stop the worker ranks
        self._loader.shutdown(wait=False, cancel_futures=True)

    # -- requests ----------------------------------------------------------------------------
    async def generate(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        """Stream the request's token events (a reader behind the steps gets the events
        waiting merged into one); raises before the first event on bad input (a response format
        the grammar library refuses among it), an unknown adapter, or a full queue."""
        self._admit(request)
        # counted from admission on, not after the first await: requests arriving while others'
        # grammars compile would each find the room those had not taken yet, past --max-waiting
        stream = TokenStream()
        self._streams[request.request_id] = stream
        self._admission.opened(request.tenant)
        arrival = time.monotonic()
        finished = False
        try:
            aborted, grammar, adapter = await self._prepare(request)
            if aborted:  # before the step loop had it: it ends here, holding nothing
                finished = True
                yield self._aborted_early(request, arrival)
                return
            self._submit(lambda: self._add(request, adapter, grammar))
            while True:
                event = await stream.get()  # all that is waiting, merged: a reader behind catches up
                finished = event.finish_reason is not None
                yield event
                if finished:
                    return
        finally:
            self._streams.pop(request.request_id, None)
            self._admission.closed(request.tenant)
            if not finished:
                self.abort(request.request_id)

    def _admit(self, request: GenerationRequest) -> None:
        if self._closing or self._thread is None:
            raise UnavailableError("the engine is not running (starting up or shutting down)")
        if request.stopping.max_new_tokens > self.info.max_new_tokens_limit:
            raise InvalidRequestError(f"at most {self.info.max_new_tokens_limit}", "max_new_tokens")
        if request.request_id in self._streams:
            raise InvalidRequestError(f"request id {request.request_id!r} is already in use", "request_id")
        if not self._admission.room_for(request.tenant):
            raise ResourceExhaustedError(f"request queue is full ({self._config.max_waiting} waiting)")
        self._core.check(request)

    async def _prepare(self, request: GenerationRequest):
        """(aborted, grammar, adapter): the request's grammar compiled and its adapter taken,
        unless ``abort`` came first (then nothing is held). An abort of a request the step loop
        did not have yet was lost: one waiting for adapter pool space (a shutdown's grace period
        over) waited on, was queued and ran after it."""
        unqueued = self._unqueued[request.request_id] = _Unqueued()
        cancel = unqueued.cancel
        grammar = adapter = None
        try:
            if request.grammar is not None:  # compiled off the event loop and the step loop (cached)
                grammar = await asyncio.to_thread(self._core.grammars.compile, request.grammar)
            if not cancel.is_set():
                adapter = await self._acquire(request, unqueued)
        except AcquireCancelled:
            if not cancel.is_set():
                raise
        finally:
            self._unqueued.pop(request.request_id, None)
        if cancel.is_set() and adapter is not None:
            self._manager.release(adapter)
            adapter = None
        return cancel.is_set(), grammar, adapter

    @staticmethod
    def _aborted_early(request: GenerationRequest, arrival: float) -> TokenEvent:
        waited = time.monotonic() - arrival
        return TokenEvent(request.request_id, (), "", finish_reason=FinishReason.ABORT,
                          usage=Usage(len(request.prompt_token_ids), 0), timings=Timings(waited, waited, waited))

    async def _acquire(self, request: GenerationRequest, unqueued: _Unqueued):
        if request.adapter_id is None:
            return None
        adapter = await self._acquire_current(request, unqueued)
        if request.adapter_version is not None and adapter.version != request.adapter_version:
            self._manager.release(adapter)  # replaced since the request was admitted for that version
            raise AdapterNotFoundError(request.adapter_id)
        return adapter

    async def _acquire_current(self, request: GenerationRequest, unqueued: _Unqueued):
        resident = self._manager.try_acquire_resident(request.adapter_id)
        if resident is not None:
            return resident
        loading = self._loader.submit(self._manager.acquire, request.adapter_id, unqueued.cancel)
        unqueued.loading = request.adapter_id
        try:
            return await asyncio.wrap_future(loading)
        except asyncio.CancelledError:  # the caller left: stop waiting for pool space
            self._manager.cancel_wait(unqueued.cancel)
            loading.add_done_callback(self._release_unclaimed)
            raise
        finally:
            unqueued.loading = None

    def _release_unclaimed(self, loading: Future) -> None:
        """An acquisition that completed after its caller left: give the reference back."""
        if not loading.cancelled() and loading.exception() is None:
            self._manager.release(loading.result())

    def _add(self, request: GenerationRequest, adapter, grammar) -> None:
        if request.request_id not in self._streams:  # the caller left while the adapter loaded
            if adapter is not None:
                self._manager.release(adapter)
            return
        try:
            self._core.add_request(request, adapter, grammar)
        except Exception as e:  # checked on admission; anything here is a race, reported
            if adapter is not None:
                self._manager.release(adapter)
            log.warning("request %s rejected at queueing: %s", request.request_id, e)
            self._deliver([TokenEvent(request.request_id, (), "", finish_reason=FinishReason.ERROR)])

    def abort(self, request_id: str) -> None:
        unqueued = self._unqueued.get(request_id)
        if unqueued is not None:  # its grammar compiles or its adapter loads: it ends before the step loop
            self._manager.cancel_wait(unqueued.cancel)
            return
        self._submit(lambda: self._core.abort(request_id))

    def pool_stats(self) -> PoolStats:
        """The adapter pool's tiers, counters and load latency."""
        return self._manager.stats()

    def stats(self) -> EngineStats:
        running_adapters, waiting_adapters = self._core.adapters_in_flight()
        # waiting for the pool: waiting too, as routers read it
        loading = {u.loading for u in list(self._unqueued.values()) if u.loading is not None}
        pool = self._manager.stats()
        self._capacity.note(self._manager.resident_footprints())
        return EngineStats(
            num_running=self._core.num_running,
            num_waiting=self._core.num_waiting,
            free_kv_blocks=self._core.blocks.num_free,
            total_kv_blocks=self._core.blocks.num_blocks,
            resident_adapters=pool.resident,
            preemptions=self._core.num_preemptions,
            running_adapters=running_adapters,
            waiting_adapters=tuple(sorted(loading.union(waiting_adapters))),
            prefix_queried_tokens=self._core.blocks.prefix_queried_tokens,
            prefix_hit_tokens=self._core.blocks.prefix_hit_tokens,
            max_lora=self._capacity.max_lora(pool.capacity_bytes),
        )

    # -- the step loop (engine thread) -----------------------------------------------------
    def _submit(self, op: Callable[[], None]) -> None:
        with self._cv:
            self._ops.append(op)
            self._cv.notify()

    def _run(self) -> None:
        if self._on_cpu:
            cpu_threads.set_intra_op_threads(self._intra_op_threads)
        while True:
            with self._cv:
                while not self._ops and not self._core.has_work() and not self._closing:
                    self._cv.wait()
                ops, self._ops = self._ops, []
                if self._closing and not ops and not self._core.has_work():
                    return
            for op in ops:
                op()
            events = self._core.step()
            if events:
                self._deliver(events)

    def _deliver(self, events: list[TokenEvent]) -> None:
        self._loop.call_soon_threadsafe(self._dispatch, events)

    def _dispatch(self, events: list[TokenEvent]) -> None:
        for event in events:
            stream = self._streams.get(event.request_id)
            if stream is not None:
                stream.put(event)


@dataclass
class _Unqueued:
    """A request between admission and the step loop: its grammar compiles, its adapter loads."""

    cancel: threading.Event = field(default_factory=threading.Event)  # set by abort(); also ends a pool wait
    loading: str | None = None  # the adapter a loader thread fetches or places for it (the stats' waiting)
