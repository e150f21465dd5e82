"""ServerSettings: flags over LORAPLEX_* variables over defaults, validated with messages that
name the setting, its flag and its variable; and how settings become engine objects."""

from __future__ import annotations

import pytest

from loraplex.inference_server.main import engine_config, model_source
from loraplex.inference_server.settings import ServerSettings


def test_defaults_are_the_embedded_setup() -> None:
    s = ServerSettings.from_sources([], {})
    assert (s.host, s.port, s.model, s.model_format, s.device) == ("127.0.0.1", 50051, None, "auto", "auto")
    assert s.adapter_path.endswith("/.cache/loraplex/adapters") and not s.adapter_path.startswith("~")


def test_flag_beats_environment_beats_default() -> None:
    env = {"LORAPLEX_PORT": "6000", "LORAPLEX_GRACE_PERIOD_S": "2.5", "LORAPLEX_LOG_LEVEL": "debug",
           "LORAPLEX_MAX_MODEL_LEN": "512"}
    s = ServerSettings.from_sources(["--port", "7000", "--model", "/m"], env)
    assert s.port == 7000 and s.grace_period_s == 2.5 and s.log_level == "DEBUG" and s.model == "/m"
    assert s.max_model_len == 512
    assert ServerSettings.from_sources(["--max-model-len", "none"], env).max_model_len is None


@pytest.mark.parametrize("argv, env, words", [
    (["--port", "70000"], {}, ["port", "--port", "LORAPLEX_PORT", "65535"]),
    ([], {"LORAPLEX_PORT": "abc"}, ["LORAPLEX_PORT", "'abc'"]),
    (["--device", "tpu"], {}, ["device", "cuda:N"]),
    (["--dtype", "int4"], {}, ["dtype", "bfloat16"]),
    (["--model-format", "dummy"], {}, ["preset name"]),
    (["--default-max-new-tokens", "9000"], {}, ["max_new_tokens_limit"]),
    (["--max-message-bytes", "10"], {}, ["max_message_bytes", "65536"]),
    (["--grace-period-s", "-1"], {}, ["grace_period_s"]),
    (["--adapter-store-wait-s", "-1"], {}, ["adapter_store_wait_s", ">= 0"]),
    (["--max-num-seqs", "0"], {}, ["max_num_seqs", ">= 1"]),
    (["--log-format", "xml"], {}, ["log_format", "json"]),
    (["--device", "cpu", "--cuda-graphs", "on"], {}, ["cuda_graphs", "needs a GPU"]),  # before the model loads
    (["--device", "cpu"], {"LORAPLEX_LAUNCH_AHEAD": "on"}, ["launch_ahead", "needs a GPU"]),
    (["--http-head-timeout-s", "0"], {}, ["http_head_timeout_s", "--http-head-timeout-s", "> 0"]),
    ([], {"LORAPLEX_HTTP_BODY_TIMEOUT_S": "-2"}, ["http_body_timeout_s", "> 0"]),
    (["--http-max-connections", "0"], {}, ["http_max_connections", ">= 1"]),
    (["--http-max-head-bytes", "100"], {}, ["http_max_head_bytes", ">= 1024"]),
    (["--grpc-max-connection-age-s", "-1"], {}, ["grpc_max_connection_age_s", ">= 0"]),
    (["--grpc-permit-keepalive-without-calls", "yes"], {}, ["grpc_permit_keepalive_without_calls", "on"]),
])
def test_invalid_values_name_the_setting(argv, env, words) -> None:
    with pytest.raises(ValueError) as info:
        ServerSettings.from_sources(argv, env)
    for word in words:
        assert word in str(info.value)


def test_unknown_flag_exits_with_usage(capsys) -> None:
    with pytest.raises(SystemExit) as info:
        ServerSettings.from_sources(["--no-such-flag"], {})
    assert info.value.code == 2
    assert "unrecognized arguments" in capsys.readouterr().err


def test_help_lists_every_choice_and_every_dummy_preset() -> None:
    """`--model-format`'s choices (and every other setting's) used to be missing from --help."""
    from dataclasses import fields

    from loraplex.adapter_store.main import _parser as store_parser
    from loraplex.inference_server.model.dummy import PRESETS
    from loraplex.inference_server.settings import DUMMY_PRESETS, build_parser

    text = " ".join(build_parser().format_help().split())
    for f in fields(ServerSettings):
        for choice in f.metadata.get("choices") or ():
            assert choice in text.split(f"--{f.name.replace('_', '-')} ", 1)[1].split(" --", 1)[0], (f.name, choice)
    assert "--model-format {auto,hf,gguf,dummy}" in text and "(one of auto, hf, gguf, dummy;" in text
    assert tuple(PRESETS) == DUMMY_PRESETS and "llama-7b, smollm2-135m, tiny" in text
    store_help = " ".join(store_parser({}).format_help().split())
    for words in ("--log-level {DEBUG,INFO,WARNING,ERROR}", "--blob-backend {local,s3}", "(default: 127.0.0.1:50061)",
                  "the bucket must exist"):
        assert words in store_help, words


def test_engine_config_and_model_source_follow_settings() -> None:
    s = ServerSettings.from_sources(["--device", "cpu", "--max-num-seqs", "8", "--max-num-batched-tokens", "64",
                                     "--num-kv-blocks", "99", "--max-lora-rank", "32"], {})
    config = engine_config(s)
    assert (config.device, config.dtype, config.max_num_seqs, config.max_num_batched_tokens) == ("cpu", "float32", 8, 64)
    assert config.num_kv_blocks == 99 and config.max_lora_rank == 32
    assert config.launch_ahead and not config.enforce_eager
    one_at_a_time = engine_config(ServerSettings.from_sources(["--launch-ahead", "off", "--cuda-graphs", "off"], {}))
    assert not one_at_a_time.launch_ahead and one_at_a_time.enforce_eager
    assert not (config.require_cuda_graphs or config.require_launch_ahead)  # auto: used where they apply
    by_name = engine_config(ServerSettings.from_sources(["--launch-ahead", "on", "--cuda-graphs", "on"], {}))
    assert by_name.launch_ahead and by_name.require_launch_ahead and by_name.require_cuda_graphs
    assert config.prefix_caching
    assert not engine_config(ServerSettings.from_sources(["--prefix-caching", "off"], {})).prefix_caching
    assert config.admission_headroom_tokens == 64
    assert engine_config(ServerSettings.from_sources([], {"LORAPLEX_ADMISSION_HEADROOM_TOKENS": "0"})
                         ).admission_headroom_tokens == 0
    with pytest.raises(ValueError, match="admission_headroom_tokens.*>= 0"):
        ServerSettings.from_sources(["--admission-headroom-tokens", "-1"], {})
    dummy = model_source(ServerSettings.from_sources(["--model-format", "dummy", "--model", "tiny"], {}))
    assert dummy.format == "dummy" and dummy.dummy == "tiny" and dummy.path is None
    assert model_source(s).path is None and model_source(s).format == "auto"  # the embedded SmolLM2


def test_batch_size_is_256_on_a_gpu_and_32_on_the_cpu_unless_set() -> None:
    from loraplex.inference_server.main import max_num_seqs

    auto = ServerSettings.from_sources([], {})
    assert auto.max_num_seqs is None
    assert max_num_seqs(auto, "cuda") == 256 and max_num_seqs(auto, "cuda:1") == 256
    assert max_num_seqs(auto, "cpu") == 32
    assert engine_config(ServerSettings.from_sources(["--device", "cpu"], {})).max_num_seqs == 32
    small_budget = ServerSettings.from_sources(["--max-num-batched-tokens", "128"], {})
    assert max_num_seqs(small_budget, "cuda") == 128  # every running sequence's token fits a step
    assert max_num_seqs(ServerSettings.from_sources(["--max-num-seqs", "64"], {}), "cuda") == 64
    assert ServerSettings.from_sources([], {"LORAPLEX_MAX_NUM_SEQS": "auto"}).max_num_seqs is None


def test_the_adapter_pool_is_sized_from_gpu_memory_unless_set() -> None:
    """auto: on a GPU a share of what the weights and KV cache leave (a fixed 256 MiB there held 3
    adapters of a 7B model); 256 MiB on the CPU; a size given is used on either."""
    auto = ServerSettings.from_sources([], {})
    assert auto.adapter_pool_bytes is None and auto.adapter_pool_memory_fraction == 0.5
    gpu = engine_config(ServerSettings.from_sources(["--device", "cuda"], {}))
    assert gpu.adapter_pool_memory_fraction == 0.5
    tuned = engine_config(ServerSettings.from_sources(["--device", "cuda", "--adapter-pool-memory-fraction", "0.3"],
                                                      {}))
    assert tuned.adapter_pool_memory_fraction == 0.3
    cpu = engine_config(ServerSettings.from_sources(["--device", "cpu"], {}))
    assert cpu.adapter_pool_memory_fraction is None and cpu.adapter_pool_bytes == 256 * 2**20
    for device in ("cpu", "cuda"):
        given = engine_config(ServerSettings.from_sources(["--device", device, "--adapter-pool-bytes", "4096"], {}))
        assert given.adapter_pool_bytes == 4096 and given.adapter_pool_memory_fraction is None
    env = ServerSettings.from_sources([], {"LORAPLEX_ADAPTER_POOL_BYTES": "auto"})
    assert env.adapter_pool_bytes is None
    for bad in ("0", "0.95", "-1"):
        with pytest.raises(ValueError, match="adapter_pool_memory_fraction"):
            ServerSettings.from_sources(["--adapter-pool-memory-fraction", bad], {})
    with pytest.raises(ValueError, match="adapter_pool_bytes"):
        ServerSettings.from_sources(["--adapter-pool-bytes", "0"], {})


def test_host_tier_size_reaches_the_engine() -> None:
    s = ServerSettings.from_sources(["--device", "cpu", "--adapter-host-cache-bytes", "12345678"], {})
    assert engine_config(s).adapter_host_cache_bytes == 12345678
    with pytest.raises(ValueError, match="adapter_host_cache_bytes"):
        ServerSettings.from_sources(["--adapter-host-cache-bytes", "0"], {})


def test_connection_settings_become_uvicorn_and_grpc_options() -> None:
    from loraplex.inference_server.http.app import HttpOptions  # noqa: PLC0415
    from loraplex.inference_server.server.app import ServerOptions  # noqa: PLC0415

    s = ServerSettings.from_sources(["--http-head-timeout-s", "3", "--http-body-timeout-s", "4",
                                     "--http-max-connections", "10", "--grpc-max-connection-age-s", "0",
                                     "--grpc-permit-keepalive-without-calls", "on"],
                                    {"LORAPLEX_GRPC_MAX_CONNECTION_IDLE_S": "1.5"})
    http = HttpOptions.from_settings(s)
    config = http.connections.uvicorn_config(http.routes.body_timeout_s, lambda phase: None)
    assert (config["timeout_keep_alive"], config["h11_max_incomplete_event_size"]) == (5.0, 16384)
    assert http.connections.max_connections == 10  # the app's ConnectionCap (uvicorn's limit_concurrency is off)
    assert "limit_concurrency" not in config
    assert http.routes.body_timeout_s == 4 and http.connections.head_timeout_s == 3
    grpc_options = dict(ServerOptions.from_settings(s).connections.channel_options())
    assert grpc_options["grpc.max_connection_idle_ms"] == 1500 and "grpc.max_connection_age_ms" not in grpc_options
    assert grpc_options["grpc.keepalive_permit_without_calls"] == 1
    assert grpc_options["grpc.max_concurrent_streams"] == 1024 and grpc_options["grpc.http2.max_ping_strikes"] == 2
    assert grpc_options["grpc.http2.min_ping_interval_without_data_ms"] == 10_000
