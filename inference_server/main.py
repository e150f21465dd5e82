"""``loraplex-server``: parse settings, configure logging, open the port, load the model, serve.

The gRPC port (and the OpenAI-compatible HTTP port, --http-port) opens before the model loads
(health NOT_SERVING, Generate UNAVAILABLE, /health 503) so orchestrators can probe it; the
weights load in a background thread with a progress bar; SIGTERM or SIGINT drains open streams
of both ports within ``--grace-period-s`` (a second signal aborts what is left at once) and exits 0.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

from loraplex.inference_server.settings import ServerSettings

log = logging.getLogger("loraplex.inference_server")

# The engine's step loop, the adapter loader and the gRPC event loop share one GIL. With
# Python's default 5 ms switch interval, a loader busy in Python (validating, planning an
# adapter) can hold the step loop off for 5 ms, half a 7B decode step; 0.5 ms bounds it.
GIL_SWITCH_INTERVAL_S = 0.0005


def configure_interpreter() -> None:
    """Process-wide interpreter settings of a serving process (the server and its benchmarks)."""
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message (and the exception, if any)."""

    def format(self, record: logging.LogRecord) -> str:
        out = {"time": self.formatTime(record), "level": record.levelname, "logger": record.name,
               "message": record.getMessage()}
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out)


def configure_logging(settings: ServerSettings) -> None:
    """Root logging to stderr in the chosen format and level (called before the model loads)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if settings.log_format == "json"
                         else logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(settings.log_level_number)


def engine_config(settings: ServerSettings) -> Any:
    """The EngineConfig for these settings (device and dtype ``auto`` resolved here)."""
    import torch  # noqa: PLC0415  (heavy: only when the server really starts)

    from loraplex.inference_server.engine.config import EngineConfig  # noqa: PLC0415

    device = settings.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = settings.dtype
    if dtype == "auto":
        dtype = "bfloat16" if device.startswith("cuda") else "float32"
    pool = {"adapter_pool_bytes": settings.adapter_pool_bytes} if settings.adapter_pool_bytes is not None else (
        {"adapter_pool_memory_fraction": settings.adapter_pool_memory_fraction} if device.startswith("cuda") else {})
    return EngineConfig(
        device=device, dtype=dtype, num_kv_blocks=settings.num_kv_blocks,
        kv_cache_memory_fraction=settings.kv_cache_memory_fraction, max_num_seqs=max_num_seqs(settings, device),
        max_num_batched_tokens=settings.max_num_batched_tokens, max_model_len=settings.max_model_len,
        admission_headroom_tokens=settings.admission_headroom_tokens,
        max_new_tokens_limit=settings.max_new_tokens_limit, max_waiting=settings.max_waiting,
        **pool, adapter_host_cache_bytes=settings.adapter_host_cache_bytes,
        max_lora_rank=settings.max_lora_rank, seed=settings.seed,
        tensor_parallel_size=settings.tensor_parallel, enforce_eager=settings.cuda_graphs == "off",
        launch_ahead=settings.launch_ahead != "off", require_cuda_graphs=settings.cuda_graphs == "on",
        require_launch_ahead=settings.launch_ahead == "on", served_model_name=settings.served_model_name,
        prefix_caching=settings.prefix_caching == "on",
    )


def max_num_seqs(settings: ServerSettings, device: str) -> int:
    """The batch size: as set, else 256 on a GPU (its graphs are captured for the sizes up to
    it) and 32 on the CPU, where a larger batch only lengthens every step. Capped by the step's
    token budget, which must hold one token of every running sequence."""
    if settings.max_num_seqs is not None:
        return settings.max_num_seqs
    return min(256 if device.startswith("cuda") else 32, settings.max_num_batched_tokens)


def model_source(settings: ServerSettings, device: str = "cpu") -> Any:
    """The ModelSource for ``--model`` / ``--model-format`` (no model: the embedded SmolLM2);
    dummy weights are drawn on ``device``."""
    from loraplex.inference_server.model.checkpoint import ModelSource  # noqa: PLC0415

    if settings.model_format == "dummy":
        return ModelSource(format="dummy", dummy=settings.model, seed=settings.seed, dummy_device=device)
    return ModelSource(format=settings.model_format, path=settings.model)


def build_engine(settings: ServerSettings) -> Any:
    """Load the model and build the engine (blocking; a progress bar while the weights load, on a
    terminal with plain logs only: JSON logs and log files get only log lines)."""
    from loraplex.inference_server import build  # noqa: PLC0415
    from loraplex.inference_server.engine.async_engine import AsyncEngine  # noqa: PLC0415

    adapters = adapter_source(settings)  # before the model: a store set up wrong stops the server at once
    config = engine_config(settings)
    # dummy weights drawn on the GPU (seconds for 7B); sharded engines draw on the CPU, then split
    source = model_source(settings, config.device if config.tensor_parallel_size == 1 else "cpu")
    log.info("loading the model (%s) on %s as %s", settings.model or "SmolLM2-135M-Instruct", config.device,
             config.dtype)
    progress = settings.log_format != "json" and sys.stderr.isatty()
    return build.build_engine(AsyncEngine, config, source, adapters, progress=progress)


def adapter_source(settings: ServerSettings) -> Any:
    """The local adapter directory, or (``--adapter-store``) a client of the store sidecar,
    made once the model is loaded so uploads are validated against the base model. The store
    is checked first (store_check.py): one that refuses the secret, or never answers, stops the
    server before the model loads (StoreStartupError)."""
    if settings.adapter_store is None:
        return settings.adapter_path
    from loraplex.adapter_store.client import StoreClient  # noqa: PLC0415
    from loraplex.inference_server.store_check import StoreCheck, wait_for_store  # noqa: PLC0415

    check = StoreCheck(settings.adapter_store, settings.adapter_store_secret_file, settings.adapter_store_wait_s)
    wait_for_store(check)
    address, max_rank, secret = settings.adapter_store, settings.max_lora_rank, check.secret()
    log.info("adapters from the store sidecar at %s", address)
    return lambda base: StoreClient(address, base=base, max_rank=max_rank, secret=secret)


async def _in_daemon_thread(fn: Callable[[], Any]) -> Any:
    """Run ``fn`` in a daemon thread (a stop during model load must not wait for the load)."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Any] = loop.create_future()

    def run() -> None:
        try:
            result = fn()
        except BaseException as exc:  # noqa: BLE001  (handed to the awaiting coroutine)
            loop.call_soon_threadsafe(lambda exc=exc: future.done() or future.set_exception(exc))
        else:
            loop.call_soon_threadsafe(lambda: future.done() or future.set_result(result))

    threading.Thread(target=run, name="model-loader", daemon=True).start()
    return await future


async def serve(settings: ServerSettings, build: Callable[[], Any] | None = None) -> int:
    """Run the server until SIGTERM/SIGINT; return the process exit code."""
    from loraplex.inference_server.auth.security import Security  # noqa: PLC0415
    from loraplex.inference_server.server.app import GrpcServer, ServerOptions  # noqa: PLC0415
    from loraplex.inference_server.store_check import StoreStartupError  # noqa: PLC0415

    try:
        security = Security.from_settings(settings)
    except (ValueError, OSError) as exc:
        log.error("cannot start: %s", exc)
        return 2
    security.log_startup()
    server = GrpcServer(ServerOptions.from_settings(settings), security=security)
    await server.start()
    try:
        http = await _start_http(settings, server)
    except OSError:
        await server.close()
        raise
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loading = asyncio.ensure_future(_in_daemon_thread(build or (lambda: build_engine(settings))))
    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait({loading, stopping}, return_when=asyncio.FIRST_COMPLETED)
    engine, code = None, 0
    if loading.done():
        try:
            engine = loading.result()
        except StoreStartupError as exc:
            log.error("cannot start: %s", exc)
            code = 1
        except (ValueError, OSError) as exc:
            log.error("cannot load the model: %s", exc)
            code = 1
        if engine is not None:
            await engine.start()
            await server.attach_engine(engine)
            await stopping
    else:
        log.info("stop requested while the model was loading")
        loading.cancel()
    stopping.cancel()
    log.info("shutting down (grace period %.1fs; a second SIGTERM or SIGINT ends it now)", settings.grace_period_s)
    again = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, again.set)
    await server.shutdown(settings.grace_period_s, again)  # drains HTTP streams too: the two edges share one state
    if http is not None:
        await http.close()
    if engine is not None:
        await engine.shutdown()
    return code


async def _start_http(settings: ServerSettings, server: Any) -> Any:
    """The OpenAI-compatible HTTP edge over the gRPC server's state (None with --http-port 0)."""
    if not settings.http_port:
        return None
    from loraplex.inference_server.http.app import HttpOptions, HttpServer  # noqa: PLC0415

    http = HttpServer(HttpOptions.from_settings(settings), server.state, server.metrics, server.security,
                      server.tenant_metrics)
    await http.start()
    return http


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``loraplex-server`` (and ``loraplex serve``)."""
    try:
        settings = ServerSettings.from_sources(argv)
    except ValueError as exc:
        print(f"loraplex-server: {exc}", file=sys.stderr)
        return 2
    configure_logging(settings)
    configure_interpreter()
    try:
        return asyncio.run(serve(settings))
    except OSError as exc:
        log.error("%s", exc)
        return 1


if __name__ == "__main__":
    sys.exit(main())
