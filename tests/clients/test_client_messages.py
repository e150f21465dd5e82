"""What the client and CLI say (#29 item 5): the upload names the visibility the list will show,
and a request the client refuses locally names the field at fault."""

from __future__ import annotations

from pathlib import Path

import pytest

from loraplex.clients.cli import main
from loraplex.clients.requests import generate_request
from server_helpers import fake_server_address, write_fake_adapter


@pytest.fixture
def address(tmp_path: Path):
    yield from fake_server_address(tmp_path)


def _run(capsys, address: str, *argv: str) -> tuple[int, str]:
    code = main(["--address", address, *argv])
    return code, capsys.readouterr().out


@pytest.mark.parametrize("adapter_id, flags, expected", [
    ("pirate", (), "shared"),
    ("pirate", ("--public",), "public"),
    ("acme/pirate", (), "private"),
    ("acme/pirate", ("--public",), "public"),
])
def test_upload_says_the_visibility_the_list_shows(capsys, address: str, tmp_path: Path, adapter_id: str,
                                                   flags: tuple[str, ...], expected: str) -> None:
    folder = write_fake_adapter(tmp_path / "a")
    code, out = _run(capsys, address, "adapters", "upload", *flags, adapter_id, str(folder))
    assert code == 0 and out.rstrip().endswith(f"{expected})"), out
    code, out = _run(capsys, address, "adapters", "list")
    row = next(line for line in out.splitlines() if line.split()[0] == adapter_id)
    assert row.split()[1] == expected


@pytest.mark.parametrize("ids", [[2**40], [-1], [5, "x"], [1.5]])
def test_a_token_id_the_client_refuses_names_the_field(ids: list) -> None:
    with pytest.raises(ValueError, match=r"^token_ids: "):
        generate_request(token_ids=ids)


@pytest.mark.parametrize("kwargs, message", [
    ({"prompt": 123}, r"^prompt: "),
    ({"prompt": ["a", "b"]}, r"^prompt: "),
    ({"prompt": "x", "adapter": 5}, r"^adapter: must be a non-empty id"),
    ({"prompt": "x", "stop": [1]}, r"^stop: "),
    ({"prompt": "x", "n": "2"}, r"^n: "),
    ({"prompt": "x", "ignore_eos": "yes"}, r"^ignore_eos: "),
    ({"prompt": "x", "request_id": 5}, r"^request_id: "),
])
def test_an_argument_of_the_wrong_type_is_named(kwargs: dict, message: str) -> None:
    """They raised protobuf's TypeError "bad argument type for built-in operation" naming no argument,
    or AttributeError ('int' object has no attribute 'strip') for a non-string adapter."""
    with pytest.raises(ValueError, match=message):
        generate_request(**kwargs)


@pytest.mark.parametrize("timeout", [0, -1, float("nan"), float("inf"), "5"])
def test_a_client_timeout_that_is_no_number_of_seconds_is_refused(timeout: object) -> None:
    """timeout=0 meant no deadline on unary calls but an expired one on generate; -1 and nan made
    every call DEADLINE_EXCEEDED, naming no argument."""
    from loraplex.clients import AsyncLoraplexClient, LoraplexClient

    for client in (LoraplexClient, AsyncLoraplexClient):
        with pytest.raises(ValueError, match="^timeout must be a number of seconds > 0"):
            client("127.0.0.1:50051", timeout=timeout)
