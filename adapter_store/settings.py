"""Typed, validated settings of the store. main.py fills them from flags and environment."""

from __future__ import annotations

from dataclasses import dataclass

MIB = 1024 * 1024
BLOB_BACKENDS = ("local", "s3")
INDEX_BACKENDS = ("memory", "redis")


@dataclass(frozen=True, slots=True)
class S3Settings:
    """Where blobs live on S3. Credentials: the standard AWS chain (or ``profile``)."""

    bucket: str
    prefix: str = ""  # key prefix, e.g. "loraplex/"; "" or ending in "/"
    endpoint_url: str | None = None  # None: AWS; e.g. http://127.0.0.1:9000 for MinIO or moto
    region: str | None = None
    profile: str | None = None
    multipart_threshold: int = 16 * MIB
    multipart_chunksize: int = 16 * MIB
    connect_timeout_s: float = 2.0
    # between two reads of a socket (not a whole transfer); with the retry, an S3 that stops
    # answering costs one S3 call ~20 s. An upload or a delete makes several (the blob, the head,
    # the check of a failed head write): with S3 hung it answers after up to ~60 s, past the CLI's
    # 30 s deadline, whose error then cannot tell whether the write landed (the store's S3 calls
    # do not yet follow the caller's deadline)
    read_timeout_s: float = 10.0
    max_attempts: int = 2

    def __post_init__(self) -> None:
        if not self.bucket:
            raise ValueError("s3: a bucket name is required (--s3-bucket)")
        if self.prefix and not self.prefix.endswith("/"):
            raise ValueError(f"s3: prefix must end with '/', got {self.prefix!r}")
        if self.multipart_chunksize < 5 * MIB or self.multipart_threshold < 5 * MIB:
            raise ValueError("s3: multipart threshold and chunk size must be >= 5 MiB (S3's minimum part)")
        if self.connect_timeout_s <= 0 or self.read_timeout_s <= 0 or self.max_attempts < 1:
            raise ValueError("s3: timeouts must be > 0 and max_attempts >= 1")


@dataclass(frozen=True, slots=True)
class RedisSettings:
    """The Redis that holds the index, the blob cache and the change channel."""

    url: str = "redis://127.0.0.1:6379/0"
    namespace: str = "loraplex:store"  # key prefix; stores sharing it share adapters
    socket_timeout_s: float = 2.0  # a Redis that does not answer is then skipped a while (redis_conn.Breaker)

    def __post_init__(self) -> None:
        if not self.url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"redis: url must start with redis://, rediss:// or unix://, got {self.url!r}")
        if not self.namespace or any(c.isspace() for c in self.namespace):
            raise ValueError(f"redis: namespace must be non-empty without spaces, got {self.namespace!r}")
        if self.socket_timeout_s <= 0:
            raise ValueError("redis: socket timeout must be > 0")


@dataclass(frozen=True, slots=True)
class StoreSettings:
    """Everything the store process needs. The defaults need no Redis and no S3."""

    blob_backend: str = "local"
    local_dir: str = "./adapter-store"
    s3: S3Settings | None = None
    index_backend: str = "memory"
    redis: RedisSettings | None = None
    cache_max_bytes: int = 512 * MIB  # blob cache (memory or Redis); 0 disables it
    max_adapter_bytes: int = 1024 * MIB  # one upload, all files together
    max_rank: int = 128
    base_config: str | None = None  # HF config.json (or its folder): check shapes against the base model
    listen: str = "127.0.0.1:50061"
    metrics_port: int = 0  # Prometheus HTTP port; 0 = off
    chunk_bytes: int = 1 * MIB  # Get stream chunk size
    maintain_interval_s: float = 2.0  # how often a degraded index is re-synced
    # how often the index is rebuilt from the heads whatever it says (a store killed between a head
    # and its index write, a Redis restored from an older snapshot); 0: at start only
    reconcile_interval_s: float = 300.0
    secret_file: str | None = None  # shared secret every AdapterStore call must carry (adapter_store/auth.py)

    def __post_init__(self) -> None:
        if self.blob_backend not in BLOB_BACKENDS:
            raise ValueError(f"blob backend must be one of {BLOB_BACKENDS}, got {self.blob_backend!r}")
        if self.index_backend not in INDEX_BACKENDS:
            raise ValueError(f"index backend must be one of {INDEX_BACKENDS}, got {self.index_backend!r}")
        if self.blob_backend == "s3" and self.s3 is None:
            raise ValueError("blob backend 's3' needs S3 settings (at least --s3-bucket)")
        if self.index_backend == "redis" and self.redis is None:
            raise ValueError("index backend 'redis' needs Redis settings (--redis-url)")
        if self.blob_backend == "local" and not self.local_dir:
            raise ValueError("blob backend 'local' needs a directory (--local-dir)")
        if self.cache_max_bytes < 0:
            raise ValueError(f"cache_max_bytes must be >= 0, got {self.cache_max_bytes}")
        if self.max_adapter_bytes <= 0:
            raise ValueError(f"max_adapter_bytes must be > 0, got {self.max_adapter_bytes}")
        if not 1 <= self.max_rank <= 4096:
            raise ValueError(f"max_rank must be in 1..4096, got {self.max_rank}")
        if not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be in 0..65535, got {self.metrics_port}")
        if not 4096 <= self.chunk_bytes <= 4 * MIB:
            raise ValueError(f"chunk_bytes must be in 4 KiB..4 MiB, got {self.chunk_bytes}")
        if self.maintain_interval_s <= 0:
            raise ValueError("maintain_interval_s must be > 0")
        if self.reconcile_interval_s < 0:
            raise ValueError(f"reconcile_interval_s must be >= 0 (0: at start only), got {self.reconcile_interval_s}")
        if ":" not in self.listen:
            raise ValueError(f"listen must be host:port, got {self.listen!r}")
