"""A delete the adapter source answers with an error still drops the copy this server holds: a
store that finishes an interrupted delete, another server's delete in between (not found), or an
outcome unknown (unavailable: a copy still stored is fetched again). Before, a server kept
generating with a deleted adapter's old weights after the store had answered not found."""

from __future__ import annotations

import pytest

from loraplex.adapter_store.errors import AdapterNotFoundError, UnavailableError
from loraplex.inference_server.lora.managed_adapters import ManagedAdapters


class _FailingSource:
    def __init__(self, error: Exception) -> None:
        self.error = error

    def delete(self, adapter_id: str) -> None:
        raise self.error


class _HeldCopies:
    def __init__(self) -> None:
        self.invalidated: list[str] = []

    def invalidate(self, adapter_id: str) -> None:
        self.invalidated.append(adapter_id)


@pytest.mark.parametrize("error", [AdapterNotFoundError("acme/x"), UnavailableError("the adapter store is down")],
                         ids=["not-found", "unavailable"])
def test_a_delete_answered_with_an_error_drops_the_held_copy(error: Exception) -> None:
    held = _HeldCopies()
    adapters = ManagedAdapters(_FailingSource(error), held, base=None, max_rank=16)
    with pytest.raises(type(error)):
        adapters.delete("acme/x")
    assert held.invalidated == ["acme/x"]
