"""Build hook: generate the gRPC code from protos/ at build and install time.

Everything else is in pyproject.toml. ``build_py`` runs protos/generate.py into the
source tree (``loraplex/v1``, git-ignored) and adds the generated packages to the
distribution, so a wheel, ``pip install .`` and ``pip install -e .`` all ship them.
"""

from __future__ import annotations

import runpy
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


class BuildPyWithProtos(build_py):
    """build_py that first compiles protos/*.proto into the ``loraplex.v1`` package."""

    def run(self) -> None:
        generator = runpy.run_path(str(ROOT / "protos" / "generate.py"))
        written = generator["generate"](ROOT)
        for pkg_dir in written:
            rel = pkg_dir.relative_to(ROOT)
            names = [".".join(rel.parts[: i + 1]) for i in range(len(rel.parts))]
            for name in names:
                if name not in (self.distribution.packages or []):
                    self.distribution.packages = [*(self.distribution.packages or []), name]
        self.packages = self.distribution.packages
        for pkg_dir in written:  # the generated packages ship their .pyi stubs too
            name = ".".join(pkg_dir.relative_to(ROOT).parts)
            self.package_data[name] = [*self.package_data.get(name, []), "*.pyi"]
        super().run()


setup(cmdclass={"build_py": BuildPyWithProtos})
