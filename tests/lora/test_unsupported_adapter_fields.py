"""An upload that turns on an adapter feature loraplex cannot serve is INVALID_ARGUMENT naming the
config field that turns it on, as every other INVALID_ARGUMENT names its field: in the message's
start and in the loraplex-field trailer (the client's ``InvalidArgumentError.field``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loraplex.clients import LoraplexClient
from loraplex.clients.errors import InvalidArgumentError
from loraplex.inference_server.server.app import ServerOptions
from server_helpers import FakeEngine, ServerThread, write_fake_adapter


@pytest.fixture
def client(tmp_path: Path):
    srv = ServerThread(ServerOptions(port=0, max_upload_bytes=100_000))
    srv.attach(FakeEngine(tmp_path / "store"))
    with LoraplexClient(srv.address, timeout=10) as c:
        yield c
    srv.close()


@pytest.mark.parametrize("field, value, words", [
    ("use_dora", True, "DoRA (use_dora=true)"),
    ("modules_to_save", ["lm_head"], "fully trained extra modules"),
    ("init_lora_weights", "pissa", "changes the base model's weights"),
    ("alora_invocation_tokens", [5, 6], "Activated LoRA"),
])
def test_an_unsupported_feature_is_refused_naming_its_config_field(client, tmp_path, field, value, words) -> None:
    folder = write_fake_adapter(tmp_path / "src", rank=4)
    config = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**config, field: value}))
    with pytest.raises(InvalidArgumentError) as info:
        client.upload_adapter("acme/variant", folder)
    assert info.value.field == field
    assert info.value.details.startswith(f"{field}: ") and words in info.value.details
    assert client.list_adapters() == []
