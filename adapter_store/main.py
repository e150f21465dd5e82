"""``loraplex-store``: run the adapter store sidecar.

Every flag can also come from the environment as LORAPLEX_STORE_<FLAG> (upper case,
dashes as underscores), e.g. LORAPLEX_STORE_S3_BUCKET. With no flags it serves a local
directory with an in-memory index: nothing external is needed. Giving an S3 bucket
selects the S3 blob backend, giving a Redis URL the Redis index/cache; AWS credentials
come from the standard AWS settings (AWS_ACCESS_KEY_ID, AWS_PROFILE, instance role...).

At start, one rule for the backends (Store.check_backends): an answer that says a setting is
wrong (no such bucket, no credentials, credentials refused) stops the store with exit code 1
and the fix; a backend that does not answer (an outage) is a warning, and the store serves.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from collections.abc import Mapping, Sequence

from loraplex.adapter_store.factory import build_store
from loraplex.adapter_store.metrics import StoreMetrics
from loraplex.adapter_store.secret import read_secret
from loraplex.adapter_store.server import StoreServer
from loraplex.adapter_store.settings import MIB, RedisSettings, S3Settings, StoreSettings
from loraplex.adapter_store.store import Store

log = logging.getLogger("loraplex.adapter_store")
ENV_PREFIX = "LORAPLEX_STORE_"


def _parser(env: Mapping[str, str]) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="loraplex-store", description="Run the loraplex adapter store sidecar.",
        epilog="S3 credentials come from the standard AWS chain (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, "
               "AWS_PROFILE or --s3-profile, an instance role or IRSA); the bucket must exist. At start the store "
               "refuses to run when S3 says the settings are wrong (no such bucket, no credentials, credentials "
               "refused) and only warns when S3 or Redis does not answer (an outage it waits out). Every flag can "
               f"also be set with its {ENV_PREFIX}<FLAG> variable, shown in brackets; flags win.")

    def flag(name: str, help_: str, **kw: object) -> None:
        key = ENV_PREFIX + name.upper().replace("-", "_")
        default = kw.pop("default", None)
        shown = f" (default: {default})" if default not in (None, "") else ""
        p.add_argument(f"--{name}", default=env.get(key, default), help=f"{help_}{shown} [${key}]", **kw)

    flag("listen", "host:port to serve on", default="127.0.0.1:50061")
    flag("blob-backend", "where adapters are kept (default: s3 if a bucket is given, else local)", choices=("local", "s3"))
    flag("local-dir", "directory of the local blob backend", default="./adapter-store")
    flag("s3-bucket", "S3 bucket")
    flag("s3-prefix", "key prefix inside the bucket (ends with '/')", default="")
    flag("s3-endpoint-url", "S3 endpoint (MinIO, moto, ...); default: AWS")
    flag("s3-region", "S3 region")
    flag("s3-profile", "AWS profile name")
    flag("s3-multipart-mib", "multipart upload threshold and part size, MiB", default="16", type=int)
    flag("index-backend", "index and cache (default: redis if a URL is given, else memory)", choices=("memory", "redis"))
    flag("redis-url", "Redis URL, e.g. redis://127.0.0.1:6379/0")
    flag("redis-namespace", "Redis key prefix; stores sharing it share adapters", default="loraplex:store")
    flag("cache-mib", "blob cache size, MiB (0 = off)", default="512", type=int)
    flag("max-adapter-mib", "largest accepted upload, MiB", default="1024", type=int)
    flag("max-rank", "largest accepted LoRA rank", default="128", type=int)
    flag("base-config", "base model's HF config.json (or folder): uploads must fit its shapes")
    flag("metrics-port", "Prometheus metrics HTTP port (0 = off)", default="0", type=int)
    flag("reconcile-interval-s", "seconds between rebuilds of the index from the blob store's heads, whatever "
         "the index says (0 = at start only)", default="300", type=float)
    flag("secret-file", "file holding the shared secret the inference server sends; without it, calls "
         "are not authenticated (keep --listen on localhost then)")
    flag("log-level", "logging level", default="INFO", type=str.upper,
         choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    return p


def parse_args(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> tuple[StoreSettings, str]:
    """(settings, log level) from flags, then LORAPLEX_STORE_* variables, then defaults."""
    a = _parser(os.environ if env is None else env).parse_args(argv)
    blob_backend = a.blob_backend or ("s3" if a.s3_bucket else "local")
    index_backend = a.index_backend or ("redis" if a.redis_url else "memory")
    s3 = None
    if blob_backend == "s3":
        part = int(a.s3_multipart_mib) * MIB
        s3 = S3Settings(
            bucket=a.s3_bucket or "", prefix=a.s3_prefix, endpoint_url=a.s3_endpoint_url, region=a.s3_region,
            profile=a.s3_profile, multipart_threshold=part, multipart_chunksize=part,
        )
    redis = None
    if index_backend == "redis":
        redis = RedisSettings(url=a.redis_url or RedisSettings.url, namespace=a.redis_namespace)
    settings = StoreSettings(
        blob_backend=blob_backend, local_dir=a.local_dir, s3=s3, index_backend=index_backend, redis=redis,
        cache_max_bytes=int(a.cache_mib) * MIB, max_adapter_bytes=int(a.max_adapter_mib) * MIB,
        max_rank=int(a.max_rank), base_config=a.base_config, listen=a.listen, metrics_port=int(a.metrics_port),
        secret_file=a.secret_file or None, reconcile_interval_s=float(a.reconcile_interval_s),
    )
    return settings, a.log_level.upper()


async def _serve(settings: StoreSettings, store: Store, metrics: StoreMetrics, secret: str | None) -> None:
    if settings.metrics_port:
        from prometheus_client import start_http_server  # noqa: PLC0415

        try:
            start_http_server(settings.metrics_port, registry=metrics.registry)
        except OSError as e:
            raise StartupError(f"cannot serve metrics on port {settings.metrics_port}: {e.strerror or e}") from None
    server = StoreServer(store, settings.listen, settings.chunk_bytes, settings.maintain_interval_s, secret=secret)
    try:
        port = await server.start()
    except (RuntimeError, OSError) as e:  # gRPC's "Failed to bind" is a RuntimeError
        raise StartupError(f"cannot listen on {settings.listen}: {e}") from None
    except ValueError as e:  # a backend configured wrong (Store.check_backends)
        raise StartupError(f"cannot start: {e}") from None
    print(f"loraplex-store listening on port {port}", flush=True)  # the line scripts wait for
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("shutting down")
    await server.stop()


class StartupError(Exception):
    """The store cannot start as configured (a port taken, a folder it cannot use): said in one
    line, without a traceback."""


def main(argv: Sequence[str] | None = None) -> int:
    """Console-script entry point."""
    try:
        settings, log_level = parse_args(argv)
        logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        metrics = StoreMetrics()
        secret = read_secret(settings.secret_file) if settings.secret_file else None
        store = _build(settings, metrics)
    except ValueError as e:
        print(f"loraplex-store: {e}", file=sys.stderr)
        return 2
    try:
        asyncio.run(_serve(settings, store, metrics, secret))
    except StartupError as e:
        print(f"loraplex-store: {e}", file=sys.stderr)
        return 1
    return 0


def _build(settings: StoreSettings, metrics: StoreMetrics) -> Store:
    try:
        return build_store(settings, metrics=metrics)
    except OSError as e:  # e.g. --local-dir is a file, or cannot be created
        where = f" {e.filename}" if e.filename else ""
        raise ValueError(f"cannot use{where}: {e.strerror or e}") from None


if __name__ == "__main__":
    sys.exit(main())
