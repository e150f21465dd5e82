"""Our top-level import names (inference_server, adapter_store, kernels, clients) belong to
loraplex alone in the environment it is installed into. A dependency that ships another
distribution under one of them (transformers >= 5.25 requires Hugging Face's `kernels`) would
overwrite our files in site-packages, or be shadowed by them and fail at import."""

from __future__ import annotations

import importlib.metadata
import tomllib

from dockerfile_helpers import REPO

TOP_LEVEL = ("inference_server", "adapter_store", "kernels", "clients")


def test_the_project_installs_the_cards_top_level_packages() -> None:
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    include = pyproject["tool"]["setuptools"]["packages"]["find"]["include"]
    assert sorted(name.rstrip("*") for name in include) == sorted(TOP_LEVEL)


def test_no_installed_distribution_but_loraplex_provides_our_import_names() -> None:
    owners = importlib.metadata.packages_distributions()
    clashes = {name: sorted(set(owners[name]) - {"loraplex"}) for name in TOP_LEVEL
               if set(owners.get(name, ())) - {"loraplex"}}
    assert not clashes, (
        f"installed distributions share loraplex's import names: {clashes}; "
        "constrain the dependency that pulls them in (pyproject.toml)")
