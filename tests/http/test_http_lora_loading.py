"""vLLM's runtime LoRA endpoints (#41 item 2) on the real engine (tiny Llama), through real
sockets: off unless enabled (404, as vLLM); ``lora_path`` a folder on the server or a stored
adapter id, and an ``s3://bucket/prefix`` refused without an adapter store even where this
process has S3 credentials and the files are there (moto's S3; test_http_lora_s3_import.py loads
one through a store); a relative path is an id, never a folder of the server's working directory;
the same validation and errors as an upload; ``/v1/models`` lists the
loaded adapter with ``parent`` = the base; unload drops it from the listing and from the pool, whose used bytes fall by its
footprint (measured); with tenants, only admins read server folders, a tenant writes only its
own namespace and another tenant's private adapter is not found as a lora_path (never copied)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import openai
import pytest

from loraplex.inference_server.auth.security import Security
from loraplex.inference_server.auth.tokens import TokenFile
from loraplex.inference_server.engine.async_engine import AsyncEngine
from loraplex.inference_server.build import build_engine
from loraplex.inference_server.engine.config import EngineConfig
from loraplex.inference_server.model.checkpoint import ModelSource
from loraplex.inference_server.server.app import ServerOptions
from lora_helpers import make_test_adapters
from server_helpers import ServerThread, write_fake_adapter
from store_services import MotoProcess
from tenant_tokens import TOKENS, write_tokens
from http_calls import _post

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def peft(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_test_adapters(tiny_llama_dir, tmp_path_factory.mktemp("peft"))


def _serve(tiny_llama_dir: Path, adapters: Path, enabled: bool, security: Security | None = None):
    srv = ServerThread(ServerOptions(port=0, default_max_new_tokens=4), security=security)
    url = srv.start_http(default_max_new_tokens=4, runtime_lora_updating=enabled)
    config = EngineConfig(num_kv_blocks=64, block_size=16, max_num_seqs=4, max_num_batched_tokens=256)
    srv.attach(build_engine(AsyncEngine, config, ModelSource(path=str(tiny_llama_dir)), adapters, progress=False))
    return srv, url.removesuffix("/v1")


def _used(srv: ServerThread) -> int:
    return srv.server.state.engine.pool_stats().used_bytes


def test_off_unless_enabled(tiny_llama_dir: Path, peft: Path, tmp_path: Path) -> None:
    srv, root = _serve(tiny_llama_dir, tmp_path / "adapters", enabled=False)
    try:
        assert _post(root, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(peft / "attn-r8")})[0] == 404
        assert _post(root, "/v1/unload_lora_adapter", {"lora_name": "x"})[0] == 404
    finally:
        srv.close()


def test_load_from_a_folder_and_the_store_then_unload_and_s3_needs_a_store(tiny_llama_dir: Path, peft: Path, tmp_path: Path) -> None:
    srv, root = _serve(tiny_llama_dir, tmp_path / "adapters", enabled=True)
    client = openai.OpenAI(base_url=root + "/v1", api_key="x", max_retries=0, timeout=60)
    base = srv.server.state.engine.info.model_name
    moto = MotoProcess().start()
    env = {"AWS_ENDPOINT_URL": moto.endpoint, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_DEFAULT_REGION": "us-east-1"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        before = _used(srv)
        status, text = _post(root, "/v1/load_lora_adapter", {"lora_name": "acme/r8", "lora_path": str(peft / "attn-r8")})
        assert (status, text) == (200, "Success: LoRA adapter 'acme/r8' added successfully.")
        loaded = _used(srv)
        assert loaded > before  # in the device pool at once
        cards = {m.id: m for m in client.models.list()}
        assert cards["acme/r8"].parent == base and cards["acme/r8"].root == "acme/r8"
        assert client.completions.create(model="acme/r8", prompt="Hi", max_tokens=3).usage.completion_tokens == 3

        s3 = moto.s3()
        s3.create_bucket(Bucket="loras")
        for f in ("adapter_config.json", "adapter_model.safetensors"):
            s3.upload_file(str(peft / "mlp-r64" / f), "loras", f"team/mlp/{f}")
        # no store: an s3:// path is refused, even with S3 credentials in this process's environment
        status, text = _post(root, "/v1/load_lora_adapter", {"lora_name": "mlp", "lora_path": "s3://loras/team/mlp"})
        error = json.loads(text)["error"]
        assert (status, error["param"]) == (400, "lora_path") and "--adapter-store" in error["message"], error
        assert "mlp" not in {m.id for m in client.models.list()}
        assert _post(root, "/v1/load_lora_adapter", {"lora_name": "mlp", "lora_path": str(peft / "mlp-r64")})[0] == 200
        assert _post(root, "/v1/load_lora_adapter", {"lora_name": "copy", "lora_path": "acme/r8"})[0] == 200
        assert _post(root, "/v1/load_lora_adapter", {"lora_name": "acme/r8", "lora_path": "acme/r8"})[0] == 200
        listed = {m.id for m in client.models.list()}
        assert {"acme/r8", "mlp", "copy"} <= listed
        with_all = _used(srv)

        status, text = _post(root, "/v1/unload_lora_adapter", {"lora_name": "mlp"})
        assert (status, text) == (200, "Success: LoRA adapter 'mlp' removed successfully.")
        freed = with_all - _used(srv)
        mlp_bytes = 3 * 64 * (64 + 128 + 64 + 128 + 128 + 64) * 4  # rank 64 on gate/up/down, float32
        assert mlp_bytes <= freed <= mlp_bytes + 6 * 64 * 4  # its footprint (A/B blocks aligned)
        assert "mlp" not in {m.id for m in client.models.list()}
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="mlp", prompt="Hi", max_tokens=2)
        status, text = _post(root, "/v1/unload_lora_adapter", {"lora_name": "mlp"})
        assert status == 404 and json.loads(text)["error"]["code"] == "model_not_found"
        assert json.loads(text)["error"]["param"] == "lora_name"  # the field that named it (was "model")
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
        moto.stop()
        srv.close()


@pytest.mark.parametrize("body, param, fragment", [
    ({"lora_name": "x", "lora_path": "/nonexistent/folder"}, "lora_path", "not a folder"),
    ({"lora_name": "x", "lora_path": "no-such-adapter"}, "lora_path", "no stored adapter 'no-such-adapter' exists"),
    ({"lora_name": "x", "lora_path": "./rnd"}, "lora_path", "must be an absolute folder path on the server"),
    ({"lora_name": "x", "lora_path": "a/b/c"}, "lora_path", "a stored adapter id"),
    ({"lora_name": "bad name!", "lora_path": "/tmp"}, "lora_name", ""),
    ({"lora_name": "x"}, "lora_path", "required"),
    ({"lora_name": "x", "lora_path": "s3://"}, "lora_path", "no bucket"),
])
def test_bad_loads_are_4xx_naming_the_field(tiny_llama_dir: Path, tmp_path: Path, body, param, fragment) -> None:
    srv, root = _serve(tiny_llama_dir, tmp_path / "adapters", enabled=True)
    try:
        status, text = _post(root, "/v1/load_lora_adapter", body)
        error = json.loads(text)["error"]
        assert status in (400, 404) and error["param"] == param and fragment in error["message"], error
    finally:
        srv.close()


def test_a_relative_path_is_a_stored_id_never_a_folder_of_the_working_directory(
        tiny_llama_dir: Path, peft: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shutil.copytree(peft / "attn-r8", tmp_path / "rnd")  # a PEFT folder named like an id, where the server runs
    monkeypatch.chdir(tmp_path)
    srv, root = _serve(tiny_llama_dir, tmp_path / "adapters", enabled=True)
    try:
        status, text = _post(root, "/v1/load_lora_adapter", {"lora_name": "copy3", "lora_path": "rnd"})
        assert status == 404, text  # not the folder ./rnd
        error = json.loads(text)["error"]
        assert (error["param"], error["code"]) == ("lora_path", "model_not_found"), error
        assert "no stored adapter 'rnd' exists" in error["message"] and "absolute path" in error["message"]
        assert _post(root, "/v1/load_lora_adapter", {"lora_name": "rnd", "lora_path": str(tmp_path / "rnd")})[0] == 200
        stored = _post(root, "/v1/load_lora_adapter", {"lora_name": "copy3", "lora_path": "rnd"})  # the stored rnd now
        assert stored[0] == 200, stored
    finally:
        srv.close()


def test_the_served_model_name_is_refused_as_an_adapter_name(tiny_llama_dir: Path, peft: Path, tmp_path: Path) -> None:
    srv, root = _serve(tiny_llama_dir, tmp_path / "adapters", enabled=True)
    try:
        client = openai.OpenAI(base_url=root + "/v1", api_key="x")
        base = client.models.list().data[0].id
        status, text = _post(root, "/v1/load_lora_adapter", {"lora_name": base, "lora_path": str(peft / "attn-r8")})
        error = json.loads(text)["error"]
        assert status == 400 and error["param"] == "lora_name" and "--served-model-name" in error["message"], text
        assert [m.id for m in client.models.list()] == [base]
    finally:
        srv.close()


def test_an_adapter_the_upload_refuses_is_refused_the_same(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """Shapes of another base model: the same validation error as an UploadAdapter call."""
    srv, root = _serve(tiny_llama_dir, tmp_path / "adapters", enabled=True)
    try:
        wrong = write_fake_adapter(tmp_path / "wrong-base")
        status, text = _post(root, "/v1/load_lora_adapter", {"lora_name": "w", "lora_path": str(wrong)})
        assert status == 400 and "shape" in json.loads(text)["error"]["message"]
        (tmp_path / "half").mkdir()
        shutil.copy(wrong / "adapter_config.json", tmp_path / "half")
        status, text = _post(root, "/v1/load_lora_adapter", {"lora_name": "w", "lora_path": str(tmp_path / "half")})
        assert status == 400 and "adapter_model.safetensors" in json.loads(text)["error"]["message"]
    finally:
        srv.close()


def test_tenants_load_only_their_own_and_only_admins_read_server_folders(tiny_llama_dir: Path, peft: Path,
                                                                         tmp_path: Path) -> None:
    tokens = tmp_path / "tokens.json"
    write_tokens(tokens, TOKENS)
    srv, root = _serve(tiny_llama_dir, tmp_path / "adapters", enabled=True,
                       security=Security(tokens=TokenFile(str(tokens))))
    folder = str(peft / "attn-r8")
    try:
        assert _post(root, "/v1/load_lora_adapter", {"lora_name": "a/x", "lora_path": folder})[0] == 401
        status, text = _post(root, "/v1/load_lora_adapter", {"lora_name": "a/x", "lora_path": folder}, TOKENS["a"])
        assert status == 403 and "only an admin" in text
        assert _post(root, "/v1/load_lora_adapter", {"lora_name": "a/x", "lora_path": folder}, TOKENS["admin"])[0] == 200
        assert _post(root, "/v1/load_lora_adapter", {"lora_name": "a/y", "lora_path": "a/x"}, TOKENS["a"])[0] == 200
        assert _post(root, "/v1/load_lora_adapter", {"lora_name": "b/y", "lora_path": "a/x"}, TOKENS["a"])[0] == 403
        # another tenant's private adapter is not found, as for generate and show: not copied, its existence unsaid
        stolen = _post(root, "/v1/load_lora_adapter", {"lora_name": "b/copy", "lora_path": "a/x"}, TOKENS["b"])
        missing = _post(root, "/v1/load_lora_adapter", {"lora_name": "b/copy", "lora_path": "a/none"}, TOKENS["b"])
        assert stolen[0] == missing[0] == 404
        assert json.loads(stolen[1])["error"]["param"] == "lora_path"
        assert json.loads(stolen[1])["error"]["message"] == json.loads(missing[1])["error"]["message"].replace("none", "x")
        assert _post(root, "/v1/load_lora_adapter", {"lora_name": "b/z", "lora_path": "b/copy"}, TOKENS["admin"])[0] == 404
        assert _post(root, "/v1/load_lora_adapter", {"lora_name": "a/z", "lora_path": "a/x"}, TOKENS["admin"])[0] == 200
        assert _post(root, "/v1/unload_lora_adapter", {"lora_name": "a/y"}, TOKENS["b"])[0] == 403
        assert _post(root, "/v1/unload_lora_adapter", {"lora_name": "a/y"}, TOKENS["a"])[0] == 200
    finally:
        srv.close()
