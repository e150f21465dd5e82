"""The packages depend on each other in one direction (clients -> protos; adapter_store ->
protos; inference_server -> the store's client side, kernels, protos; kernels -> nothing of
the project), inside the GPU process the edges -> the edge core -> engine -> lora -> model
(parallel above the engine, build.py above both; the gRPC edge and the HTTP edge import
neither each other, and the edge core no wire format), the GPU process no S3 client (the store
owns S3), the LoRA runtime's tiers only
downwards, no modules import each other in a circle, and every import of the project names it
under the one namespace (loraplex.kernels, not kernels). Read from the sources
(tests/support/import_graph.py), nothing imported."""

from __future__ import annotations

from pathlib import Path

import pytest

import import_graph as graph

ROOT = Path(__file__).resolve().parents[2]


def test_no_forbidden_import_edge() -> None:
    found = [f"{e.where}: {e.source} -> {e.target}: {why}"
             for e in graph.project_edges(ROOT) if (why := graph.violation(e))]
    assert not found, "forbidden imports:\n" + "\n".join(found)


def test_no_import_cycles() -> None:
    modules = graph.project_modules(ROOT)
    assert graph.cycles(graph.project_edges(ROOT), set(modules)) == []


def test_every_lora_module_has_a_tier() -> None:
    lora = [m for m in graph.project_modules(ROOT) if graph.within(m, "loraplex.inference_server.lora")]
    untiered = sorted(m for m in lora if m != "loraplex.inference_server.lora" and graph.lora_tier(m) is None)
    assert not untiered, f"LoRA runtime modules without a tier in import_graph.LORA_TIERS: {untiered}"


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for package in graph.PACKAGES:
        (tmp_path / package).mkdir(exist_ok=True)
    return tmp_path


@pytest.mark.parametrize(("rel", "text", "why"), [
    ("adapter_store/x.py", "from loraplex.inference_server.model.config import ModelConfig\n",
     "below inference_server"),
    ("kernels/x.py", "def f():\n    import loraplex.inference_server.engine\n", "kernels import nothing"),
    ("clients/x.py", "import torch\n", "clients need only"),
    ("clients/x.py", "from loraplex.adapter_store.errors import LoraplexError\n", "clients need only"),
    ("inference_server/x.py", "from loraplex.adapter_store.service import handler\n", "client side"),
    ("adapter_store/client.py", "from loraplex.adapter_store.server import serve\n", "does not import the sidecar"),
    ("inference_server/lora/batch.py", "from loraplex.inference_server.lora.pool.adapter_pool import AdapterPool\n",
     "imports the higher tier"),
    ("inference_server/model/x.py", "def f():\n    from loraplex.kernels.cuda.paged_decode import supported\n",
     "device-agnostic entry points"),
    ("inference_server/x.py", "import kernels\n", "installed as loraplex.kernels"),
    ("inference_server/engine/x.py", "def f():\n    from loraplex.inference_server.parallel import launch\n",
     "which is above it"),
    ("inference_server/model/x.py", "from loraplex.inference_server.lora.batch import LoraBatch\n",
     "which is above it"),
    ("inference_server/lora/layers.py", "from loraplex.inference_server.engine.config import EngineConfig\n",
     "which is above it"),
    ("inference_server/engine/x.py", "from loraplex.inference_server.server import convert\n", "which is above it"),
    ("clients/x.py", "from clients.errors import NotFoundError\n", "installed as loraplex.clients"),
    ("inference_server/http/x.py", "from loraplex.inference_server.server.convert import RequestLimits\n",
     "import neither each other"),
    ("inference_server/http/x.py", "def f():\n    from loraplex.inference_server.server import app\n",
     "import neither each other"),
    ("inference_server/server/x.py", "from loraplex.inference_server.http.errors import error_for\n",
     "import neither each other"),
    ("inference_server/edge/x.py", "from loraplex.inference_server.server.interceptor import status_for\n",
     "which is above it"),
    ("inference_server/edge/x.py", "from loraplex.inference_server.http import routes\n", "which is above it"),
    ("inference_server/http/x.py", "def f():\n    import boto3\n", "reads no S3"),
    ("inference_server/x.py", "from botocore.exceptions import ClientError\n", "reads no S3"),
    ("inference_server/edge/x.py", "import grpc\n", "speaks no wire format"),
    ("inference_server/edge/x.py", "from starlette.requests import Request\n", "speaks no wire format"),
    ("inference_server/edge/x.py", "from loraplex.v1 import inference_pb2\n", "speaks no wire format"),
])
def test_the_checker_flags_each_kind_of_forbidden_edge(tmp_path, rel, text, why) -> None:
    root = _tree(tmp_path, {rel: text})
    reasons = [graph.violation(e) for e in graph.project_edges(root)]
    assert any(r and why in r for r in reasons), reasons


def test_the_checker_allows_the_intended_directions(tmp_path) -> None:
    root = _tree(tmp_path, {
        "inference_server/x.py": "from loraplex.adapter_store.client import StoreClient\nfrom loraplex import kernels\n"
                                 "from loraplex.kernels import paged_decode\n"
                                 "from loraplex.inference_server.lora.pool import device_packing\n",
        "inference_server/lora/pool/copier.py": "from loraplex.inference_server.lora.resident import AdapterLayout\n",
        "adapter_store/store.py": "from loraplex.adapter_store.format.peft_format import parse_adapter_upload\n",
        "clients/x.py": "from loraplex.v1 import inference_pb2\n",
        "inference_server/server/x.py": "from loraplex.inference_server.edge.generation import generation\n",
        "inference_server/http/x.py": "from loraplex.inference_server.edge.state import ServingState\n",
        "inference_server/main.py": "from loraplex.inference_server.server.app import GrpcServer\n"
                                    "from loraplex.inference_server.http.app import HttpServer\n",
    })
    assert [e for e in graph.project_edges(root) if graph.violation(e)] == []


def test_the_checker_finds_a_circle(tmp_path) -> None:
    root = _tree(tmp_path, {"kernels/a.py": "from loraplex.kernels import b\n",
                            "kernels/b.py": "def f():\n    from loraplex.kernels.a import g\n",
                            "kernels/__init__.py": "", "kernels/c.py": "from loraplex.kernels import a\n"})
    found = graph.cycles(graph.project_edges(root), set(graph.project_modules(root)))
    assert found == [("loraplex.kernels.a", "loraplex.kernels.b")]
