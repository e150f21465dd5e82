"""``POST /v1/load_lora_adapter`` with an ``s3://`` path goes through the adapter store sidecar
(#41): a real store process over moto's S3 (a real HTTP endpoint) and a real Redis, the engine
(tiny Llama) reading its adapters from that store. The store imports the PEFT files under the
prefix with its own S3 client and the upload's checks; the loaded adapter generates what the
same adapter uploaded normally generates; a missing prefix or bucket, and files an upload would
refuse, get the store's named error (400 naming ``lora_path``) and store nothing; a tenant may
not have the store read S3 with its credentials."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import openai
import pytest

from loraplex.adapter_store.client import StoreClient
from loraplex.adapter_store.errors import AdapterNotFoundError, InvalidRequestError, PermissionDeniedError
from loraplex.adapter_store.tenants.principal import Principal, Role
from loraplex.clients import LoraplexClient
from loraplex.inference_server.build import build_engine
from loraplex.inference_server.engine.async_engine import AsyncEngine
from loraplex.inference_server.engine.config import EngineConfig
from loraplex.inference_server.model.checkpoint import ModelSource
from loraplex.inference_server.server.app import ServerOptions
from lora_helpers import make_test_adapters
from server_helpers import ServerThread, write_fake_adapter
from store_services import MotoProcess, RedisProcess, StoreProcess, redis_binary
from http_calls import _post

pytestmark = pytest.mark.slow

PEFT_FILES = ("adapter_config.json", "adapter_model.safetensors")


@pytest.fixture(scope="module")
def stack(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """(inference server, HTTP root, moto, store target, PEFT adapters folder)."""
    binary = redis_binary()
    if binary is None:
        pytest.skip("redis-server is not installed (scripts/ci_services.sh installs it)")
    tmp = tmp_path_factory.mktemp("s3-import")
    peft = make_test_adapters(tiny_llama_dir, tmp / "peft")
    redis, moto = RedisProcess(binary).start(), MotoProcess().start()
    store = srv = None
    try:
        for bucket in ("blobs", "loras"):
            moto.s3().create_bucket(Bucket=bucket)
        store = StoreProcess(["--s3-bucket", "blobs", "--s3-endpoint-url", moto.endpoint, "--s3-region", "us-east-1",
                              "--redis-url", redis.url, "--redis-namespace", "s3import", "--metrics-port", "0"],
                             tmp / "store.log")
        srv = ServerThread(ServerOptions(port=0, default_max_new_tokens=8))
        url = srv.start_http(default_max_new_tokens=8, runtime_lora_updating=True)
        config = EngineConfig(num_kv_blocks=64, block_size=16, max_num_seqs=4, max_num_batched_tokens=256)
        target = store.target
        srv.attach(build_engine(AsyncEngine, config, ModelSource(path=str(tiny_llama_dir)),
                                lambda base: StoreClient(target, base=base), progress=False))
        yield srv, url.removesuffix("/v1"), moto, store.target, peft
    finally:
        if srv is not None:
            srv.close()
        if store is not None:
            store.stop()
        moto.stop()
        redis.kill()


def _put_prefix(moto: MotoProcess, prefix: str, folder: Path, names: tuple[str, ...] = PEFT_FILES) -> None:
    for name in names:
        moto.s3().upload_file(str(folder / name), "loras", f"{prefix}/{name}")


def _answer(root: str, model: str) -> str:
    with openai.OpenAI(base_url=root + "/v1", api_key="x", max_retries=0, timeout=60) as client:
        return client.completions.create(model=model, prompt="Tell me about the sea", max_tokens=8, temperature=0,
                                         extra_body={"ignore_eos": True}).choices[0].text


def test_an_s3_load_serves_what_an_upload_serves(stack) -> None:
    srv, root, moto, target, peft = stack
    (peft / "attn-r8" / "README.md").write_text("# a model card: imported along, not kept\n")
    _put_prefix(moto, "team/r8", peft / "attn-r8", (*PEFT_FILES, "README.md"))
    status, text = _post(root, "/v1/load_lora_adapter", {"lora_name": "acme/from-s3", "lora_path": "s3://loras/team/r8/"})
    assert (status, text) == (200, "Success: LoRA adapter 'acme/from-s3' added successfully.")
    with LoraplexClient(srv.address, timeout=60) as client:
        client.upload_adapter("acme/uploaded", peft / "attn-r8")
    with StoreClient(target) as store:
        imported, uploaded = store.stat("acme/from-s3"), store.stat("acme/uploaded")
    assert imported.info.sha256 == uploaded.info.sha256 and imported.info.version == uploaded.info.version
    assert [f.name for f in imported.files] == sorted(PEFT_FILES)  # README.md not kept
    base = srv.server.state.engine.info.model_name
    assert _answer(root, "acme/from-s3") == _answer(root, "acme/uploaded") != _answer(root, base)


@pytest.mark.parametrize("prefix, files, fragment", [
    ("nothing/here", (), "no files under 's3://loras/nothing/here'"),
    ("half", ("adapter_config.json",), "adapter_model.safetensors"),
    ("pickle", ("adapter_config.json", "adapter_model.bin"), "pickle"),
    ("other-base", PEFT_FILES, "shape"),
])
def test_what_an_upload_refuses_is_refused_naming_lora_path(stack, tmp_path: Path, prefix: str,
                                                           files: tuple[str, ...], fragment: str) -> None:
    _, root, moto, target, peft = stack
    folder = write_fake_adapter(tmp_path / "fake") if prefix == "other-base" else peft / "attn-r8"
    shutil.copy(folder / "adapter_model.safetensors", tmp_path / "adapter_model.bin")
    for name in files:
        moto.s3().upload_file(str(tmp_path / name if name.endswith(".bin") else folder / name), "loras",
                              f"{prefix}/{name}")
    status, text = _post(root, "/v1/load_lora_adapter", {"lora_name": f"bad-{prefix}", "lora_path": f"s3://loras/{prefix}"})
    error = json.loads(text)["error"]
    assert status == 400 and fragment in error["message"], error
    # where the source is at fault it is named; a file's fault is the upload's own message (no field)
    assert error["param"] == ("lora_path" if prefix == "nothing/here" else None), error
    with StoreClient(target) as store, pytest.raises(AdapterNotFoundError):
        store.stat(f"bad-{prefix}")  # nothing stored


def test_a_misfit_import_over_a_stored_adapter_keeps_the_stored_one(stack, tmp_path: Path) -> None:
    """Another base model's adapter imported under a name already stored is refused before the
    store writes anything: the stored version stays, and still serves."""
    srv, root, moto, target, peft = stack
    with LoraplexClient(srv.address, timeout=60) as client:
        client.upload_adapter("acme/keep", peft / "attn-r8")
    with StoreClient(target) as store:
        before = store.stat("acme/keep").info
    answer = _answer(root, "acme/keep")
    _put_prefix(moto, "misfit", write_fake_adapter(tmp_path / "fake"))
    status, text = _post(root, "/v1/load_lora_adapter", {"lora_name": "acme/keep", "lora_path": "s3://loras/misfit"})
    assert status == 400 and "shape" in json.loads(text)["error"]["message"], text
    with StoreClient(target) as store:
        assert store.stat("acme/keep").info == before
    assert _answer(root, "acme/keep") == answer


def test_a_missing_bucket_is_the_stores_named_error(stack) -> None:
    _, root, _, _, _ = stack
    status, text = _post(root, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "s3://no-such-bucket/a"})
    error = json.loads(text)["error"]
    assert (status, error["param"]) == (400, "lora_path") and "NoSuchBucket" in error["message"], error


def test_a_tenant_may_not_have_the_store_read_s3(stack) -> None:
    _, _, moto, target, peft = stack
    _put_prefix(moto, "tenant/r8", peft / "attn-r8")
    with StoreClient(target) as store:
        tenant = store.for_caller(Principal("acme", Role.TENANT))
        with pytest.raises(PermissionDeniedError, match="admins only"):
            tenant.import_record("acme/mine", "s3://loras/tenant/r8")
        admin = store.for_caller(Principal("ops", Role.ADMIN))
        assert admin.import_record("acme/mine", "s3://loras/tenant/r8").info.adapter_id == "acme/mine"


def test_a_store_without_s3_refuses_import_naming_the_flag(tmp_path: Path) -> None:
    store = StoreProcess(["--local-dir", str(tmp_path / "blobs"), "--metrics-port", "0"], tmp_path / "store.log")
    try:
        with StoreClient(store.target) as client, pytest.raises(InvalidRequestError) as refused:
            client.import_record("x", "s3://loras/team/r8")
        assert refused.value.field == "source" and "--s3-bucket" in str(refused.value)
    finally:
        store.stop()
