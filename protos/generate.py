"""Generate the Python gRPC code for every .proto under protos/ (grpcio-tools, with .pyi stubs).

The output is the package ``loraplex`` (``loraplex.v1.inference_pb2``, ...) at the
repository root by default. It is never committed (see .gitignore): ``make protos``,
``pip install`` (setup.py's build_py hook) and ``pip install -e .`` run this.

Usage: python protos/generate.py [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from importlib import resources
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent
REPO_ROOT = PROTO_ROOT.parent
GENERATED_MARK = "# Generated from protos/ by protos/generate.py. Do not edit.\n"


def proto_files(root: Path = PROTO_ROOT) -> list[Path]:
    """Every .proto file under ``root``, sorted."""
    return sorted(root.rglob("*.proto"))


def generate(out_dir: Path = REPO_ROOT, root: Path = PROTO_ROOT) -> list[Path]:
    """Compile every proto under ``root`` into ``out_dir``; return the package folders written.

    Compiles into a temporary folder first, so a failing protoc leaves the old code in place.
    """
    from grpc_tools import protoc  # noqa: PLC0415  (build-time dependency only)

    files = proto_files(root)
    if not files:
        raise RuntimeError(f"no .proto files under {root}")
    include = resources.files("grpc_tools") / "_proto"
    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "grpc_tools.protoc",
            f"-I{root}",
            f"-I{include}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            *(str(f.relative_to(root)) for f in files),
        ]
        cwd = os.getcwd()
        os.chdir(root)  # protoc resolves relative proto paths against -I
        try:
            rc = protoc.main(args)
        finally:
            os.chdir(cwd)
        if rc != 0:
            raise RuntimeError(f"protoc failed (exit {rc}) on {[str(f) for f in files]}")
        return _install(Path(tmp), out_dir)


def _install(tmp: Path, out_dir: Path) -> list[Path]:
    """Move generated modules into ``out_dir``, adding ``__init__.py`` to each package."""
    packages = sorted({p.parent for p in tmp.rglob("*.py*")})
    written = []
    for pkg in packages:
        rel = pkg.relative_to(tmp)
        dest = out_dir / rel
        dest.mkdir(parents=True, exist_ok=True)
        for stale in dest.glob("*_pb2*.py*"):
            stale.unlink()
        for src in sorted(pkg.iterdir()):
            if src.is_file():
                shutil.copyfile(src, dest / src.name)
        for parent in [rel, *rel.parents][:-1]:
            init = out_dir / parent / "__init__.py"
            if not init.exists():
                init.write_text(GENERATED_MARK)
        written.append(dest)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO_ROOT, help="output root (default: the repository)")
    args = parser.parse_args(argv)
    for pkg in generate(args.out.resolve()):
        print(f"generated {pkg}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
