"""The project's import graph, read from the sources with ``ast`` (nothing is imported), and
the direction rules it must follow (tests/project/test_import_direction.py checks them).

Every ``import`` and ``from ... import`` counts, at module level or inside a function: a
deferred import is still a dependency."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

PACKAGES = ("protos", "inference_server", "adapter_store", "kernels", "clients")
# The folders the distribution installs under one namespace: kernels/x.py is loraplex.kernels.x.
NAMESPACE = "loraplex"
NAMESPACED = ("inference_server", "adapter_store", "kernels", "clients")


@dataclass(frozen=True, slots=True)
class Edge:
    source: str  # importing module
    target: str  # imported module (or module.name for ``from module import name``)
    where: str  # path:line


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    if parts and parts[0] in NAMESPACED:
        parts.insert(0, NAMESPACE)
    return ".".join(parts)


def package_of(name: str) -> str:
    """The project package a module belongs to (``loraplex.kernels.cuda`` -> ``kernels``), or
    the top-level name of anything else (``torch.nn`` -> ``torch``, ``loraplex.v1`` -> ``loraplex``)."""
    parts = name.split(".")
    if parts[0] == NAMESPACE and len(parts) > 1 and parts[1] in NAMESPACED:
        return parts[1]
    return parts[0]


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def edges_of(root: Path, path: Path, modules: frozenset[str] = frozenset()) -> Iterator[Edge]:
    """The imports of one file. ``from package import submodule`` is an edge to the submodule
    only (``modules``: the project's module names), not to the package's ``__init__``."""
    module = module_name(root, path)
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    rel = path.relative_to(root)
    for node in ast.walk(tree):
        where = f"{rel}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Edge(module, alias.name, where)
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(module, path.name == "__init__.py", node)
            names = [f"{target}.{alias.name}" for alias in node.names]
            if not all(name in modules for name in names):
                yield Edge(module, target, where)
            for name in names:
                yield Edge(module, name, where)


def project_modules(root: Path, packages: tuple[str, ...] = PACKAGES) -> frozenset[str]:
    return frozenset(module_name(root, p) for package in packages for p in (root / package).rglob("*.py"))


def project_edges(root: Path, packages: tuple[str, ...] = PACKAGES) -> list[Edge]:
    modules = project_modules(root, packages)
    out: list[Edge] = []
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            out.extend(edges_of(root, path, modules))
    return out


def within(name: str, prefix: str) -> bool:
    """Is module ``name`` the module or package ``prefix`` or inside it?"""
    return name == prefix or name.startswith(prefix + ".")


# The store's side that the inference server may use: the store client and what it is built
# from (the adapter format, the shared errors, tenancy, wire constants). Everything else in
# adapter_store is the sidecar (service, store, backends, settings, main...).
STORE_CLIENT_SIDE = (
    *(f"loraplex.adapter_store.{name}" for name in (
        "errors", "protocol", "decoding", "secret", "client", "put_stream", "watcher", "records", "convert", "assembly",
        "backends.base", "format", "tenants")),
)

# The LoRA runtime's tiers, lowest first: a module may import its own tier and lower ones only.
LORA_TIERS = (
    ("loraplex.inference_server.lora.retired_versions",),  # the local directory's old versions
    ("loraplex.inference_server.lora.local_directory",),
    ("loraplex.inference_server.lora.resident",),
    ("loraplex.inference_server.lora.batch",),
    ("loraplex.inference_server.lora.layers",),
    ("loraplex.inference_server.lora.pool",),
    ("loraplex.inference_server.lora.folder_watcher",),  # the local directory's hand edits -> the pool
    ("loraplex.inference_server.lora.managed_adapters",),
)


# Inside the GPU process, from the model up to the edges: a module may import its own tier and
# lower ones only (the edges -> the edge core -> engine -> lora -> model, with the kernels below
# all of them; tensor parallelism above the engine, and build.py, which picks one or the other,
# above both).
_IS = "loraplex.inference_server"
SERVER_TIERS = (
    (f"{_IS}.model",),
    (f"{_IS}.lora",),
    (f"{_IS}.engine",),
    (f"{_IS}.parallel",),
    (f"{_IS}.build",),
    (f"{_IS}.edge", f"{_IS}.auth"),
    (f"{_IS}.server", f"{_IS}.http", f"{_IS}.main", f"{_IS}.settings", f"{_IS}.store_check"),
)
# The two protocol edges: each converts its own wire format over the edge core, and neither
# imports the other (what both need lives in the edge core).
PROTOCOL_EDGES = (f"{_IS}.server", f"{_IS}.http")
# What only a protocol edge may import: the edge core speaks no wire format.
S3_CLIENTS = ("boto3", "botocore", "s3transfer")
WIRE_FORMATS = ("grpc", "grpc_health", "grpc_reflection", "loraplex.v1", "starlette", "uvicorn", "h11")


def server_tier(name: str) -> int | None:
    for rank, members in enumerate(SERVER_TIERS):
        if any(within(name, m) for m in members):
            return rank
    return None


def protocol_edge(name: str) -> str | None:
    """The protocol edge (server/ or http/) module ``name`` belongs to, if any."""
    return next((e for e in PROTOCOL_EDGES if within(name, e)), None)


def lora_tier(name: str) -> int | None:
    for rank, members in enumerate(LORA_TIERS):
        if any(within(name, m) for m in members):
            return rank
    return None


def violation(edge: Edge) -> str | None:
    """Why ``edge`` is forbidden, or None."""
    src, dst = edge.source, edge.target
    top_src, top_dst = package_of(src), package_of(dst)
    if dst.split(".")[0] in NAMESPACED:
        return f"{dst.split('.')[0]} is installed as {NAMESPACE}.{dst.split('.')[0]}: import it by that name"
    if top_src == "kernels" and top_dst in ("inference_server", "adapter_store", "clients"):
        return "kernels import nothing of the project"
    if top_src == "adapter_store" and top_dst in ("inference_server", "kernels", "clients"):
        return "adapter_store is below inference_server and imports none of it"
    if top_src == "clients" and top_dst in ("inference_server", "kernels", "adapter_store", "torch"):
        return "clients need only the generated protos (no server code, no torch)"
    if top_src == "inference_server" and dst.split(".")[0] in S3_CLIENTS:
        return "inference_server reads no S3: the adapter store owns it (an s3:// load is the store's Import)"
    if top_src == "inference_server" and within(dst, "loraplex.kernels.cuda"):
        return "inference_server reaches the kernels through their device-agnostic entry points"
    if top_src == "inference_server" and top_dst == "adapter_store" and dst != "loraplex.adapter_store":
        if not any(within(dst, m) for m in STORE_CLIENT_SIDE):
            return "inference_server uses only the store's client side"
    if any(within(src, m) for m in STORE_CLIENT_SIDE) and top_dst == "adapter_store" \
            and dst != "loraplex.adapter_store":
        if not any(within(dst, m) for m in STORE_CLIENT_SIDE):
            return "the store's client side does not import the sidecar"
    low, high = lora_tier(dst), lora_tier(src)
    if low is not None and high is not None and low > high:
        return f"LoRA tier {high} ({LORA_TIERS[high][0]}) imports the higher tier {low}"
    src_edge, dst_edge = protocol_edge(src), protocol_edge(dst)
    if src_edge is not None and dst_edge is not None and src_edge != dst_edge:
        return f"{src} imports {dst}: the gRPC edge (server/) and the HTTP edge (http/) import neither each other"
    if within(src, f"{_IS}.edge") and any(within(dst, w) for w in WIRE_FORMATS):
        return f"the edge core imports {dst}: it speaks no wire format (that is server/'s and http/'s)"
    low, high = server_tier(dst), server_tier(src)
    if low is not None and high is not None and low > high:
        return f"{SERVER_TIERS[high][0]} imports {dst}, which is above it (edge -> engine -> lora -> model)"
    return None


def cycles(edges: list[Edge], modules: set[str]) -> list[tuple[str, ...]]:
    """Groups of ``modules`` that import each other in a circle (strongly connected
    components of more than one module, Tarjan's algorithm), each sorted."""
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for e in edges:
        if e.source in modules and e.target in modules and e.target != e.source:
            graph[e.source].add(e.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[tuple[str, ...]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                out.append(tuple(sorted(group)))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(out)
