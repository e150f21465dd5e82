"""The edges are written against engine.api's Protocols: the real engine and the edge tests'
fake must both implement every member with the same parameters, or the fake tests something
the server does not run (a method the Protocol names, missing or with other parameters)."""

from __future__ import annotations

import inspect

import pytest
from server_helpers import FakeAdapters, FakeEngine

from benchmarks.serving.synthetic_engine import SyntheticEngine

from loraplex.inference_server.engine.api import EdgeAdapters, ServingEngine
from loraplex.inference_server.engine.async_engine import AsyncEngine
from loraplex.inference_server.lora.managed_adapters import ManagedAdapters


def _members(protocol: type) -> dict[str, object]:
    return {name: value for name, value in vars(protocol).items() if callable(value) and not name.startswith("_")}


def _params(fn: object) -> list[tuple[str, object]]:
    return [(p.name, p.default) for p in inspect.signature(fn).parameters.values()]


def _mismatches(protocol: type, implementation: type) -> list[str]:
    wrong = []
    for name, member in _members(protocol).items():
        found = getattr(implementation, name, None)
        if found is None:
            wrong.append(f"{name}: missing")
        elif _params(found) != _params(member):
            wrong.append(f"{name}: {_params(found)} != {_params(member)}")
        elif inspect.iscoroutinefunction(found) != inspect.iscoroutinefunction(member):
            wrong.append(f"{name}: async differs")
    return wrong


@pytest.mark.parametrize("implementation", [AsyncEngine, FakeEngine, SyntheticEngine])
def test_engines_implement_the_serving_protocol(implementation: type) -> None:
    assert _mismatches(ServingEngine, implementation) == []
    assert {"info", "tokenizer", "adapters"} <= set(ServingEngine.__annotations__)


@pytest.mark.parametrize("implementation", [ManagedAdapters, FakeAdapters])
def test_adapter_surfaces_implement_the_edge_protocol(implementation: type) -> None:
    assert _mismatches(EdgeAdapters, implementation) == []


def test_the_check_finds_a_missing_or_different_member() -> None:
    class Partial:
        def get(self, adapter_id: str) -> None: ...

        def list(self, prefix: str) -> None: ...

    wrong = _mismatches(EdgeAdapters, Partial)
    assert "put: missing" in wrong and any(w.startswith("list: ") for w in wrong)
