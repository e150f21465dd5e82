"""Read Dockerfiles, the Makefile's and .ci/run's install commands, and a .dockerignore'd
build context, so tests can hold the images to the commands CI runs."""

from __future__ import annotations

import fnmatch
import os
import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[2]


@dataclass
class Stage:
    """One FROM ... stage: its base, its name, and its instructions (keyword, argument)."""

    base: str
    name: str | None
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def args(self) -> dict[str, str]:
        """ARG defaults declared in this stage."""
        out = {}
        for key, rest in self.instructions:
            if key == "ARG":
                name, _, default = rest.partition("=")
                out[name.strip()] = default.strip()
        return out

    def runs(self) -> list[str]:
        return [rest for key, rest in self.instructions if key == "RUN"]


@dataclass
class Dockerfile:
    global_args: dict[str, str]
    stages: list[Stage]

    @property
    def final(self) -> Stage:
        return self.stages[-1]

    def stage(self, name: str) -> Stage:
        return next(s for s in self.stages if s.name == name)

    def resolve(self, image: str) -> str:
        """``image`` with ${ARG} references replaced by the global ARG defaults."""
        return re.sub(r"\$\{?(\w+)\}?", lambda m: self.global_args.get(m.group(1), m.group(0)), image)


def parse_dockerfile(path: Path) -> Dockerfile:
    """Instructions per stage (continuation lines joined, comments dropped, as Docker does)."""
    logical, current = [], ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        logical.append(current + line)
        current = ""
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for line in logical:
        key, _, rest = line.partition(" ")
        key = key.upper()
        if key == "FROM":
            parts = rest.split()
            name = parts[2] if len(parts) >= 3 and parts[1].upper() == "AS" else None
            stages.append(Stage(parts[0], name))
        elif not stages and key == "ARG":
            name, _, default = rest.partition("=")
            global_args[name.strip()] = default.strip()
        else:
            stages[-1].instructions.append((key, rest.strip()))
    return Dockerfile(global_args, stages)


def pip_argv_of_run(run: str, variables: dict[str, str]) -> list[list[str]]:
    """The argument lists ``pip`` gets from one RUN line, expanded by a POSIX shell with
    ``variables`` (the ARG values) set: `python -m pip ...` is replaced by a printer."""
    prelude = "".join(f"{k}={shlex.quote(v)}; " for k, v in variables.items())
    script = ('python() { shift 2; for a in "$@"; do printf "%s\\n" "$a"; done; echo "<end>"; }; '
              "python3() { python \"$@\"; }; " + prelude + run)
    out = subprocess.run(["sh", "-c", script], capture_output=True, text=True, check=True, timeout=30).stdout
    calls, argv = [], []
    for line in out.splitlines():
        if line == "<end>":
            calls.append(argv)
            argv = []
        else:
            argv.append(line)
    return calls


def pip_installs(stage: Stage, overrides: dict[str, str] | None = None) -> list[list[str]]:
    """Every `pip install` argv of ``stage`` in order, with its ARG defaults (or ``overrides``)."""
    variables = {**stage.args(), **(overrides or {})}
    calls = [argv for run in stage.runs() if " pip " in run for argv in pip_argv_of_run(run, variables)]
    return [argv for argv in calls if argv and argv[0] == "install"]


def make_setup_installs(**make_vars: str) -> list[list[str]]:
    """The `pip install` argv of the Makefile's `setup` recipe, as `make -n` expands it."""
    assignments = [f"{k}={v}" for k, v in {"VENV": "/nonexistent-venv", **make_vars}.items()]
    out = subprocess.run(["make", "-n", "-B", "-C", str(REPO), "setup", *assignments],
                         capture_output=True, text=True, check=True, timeout=30).stdout
    return [shlex.split(line)[3:] for line in out.splitlines() if " -m pip install " in line]


def ci_run_installs() -> list[list[str]]:
    """The `pip install` argv in .ci/run, in order (comments dropped)."""
    calls = []
    for line in (REPO / ".ci" / "run").read_text().splitlines():
        code = line.split("#", 1)[0]
        if " -m pip install " in code:
            calls.append(shlex.split(code)[3:])
    return calls


def dockerignore_patterns() -> list[str]:
    lines = (REPO / ".dockerignore").read_text().splitlines()
    return [ln.strip().lstrip("/") for ln in lines if ln.strip() and not ln.strip().startswith("#")]


def ignored(rel: str, patterns: list[str]) -> bool:
    """Docker's .dockerignore rule for the patterns used here: a pattern matches the path or
    one of its parent folders; `**/` matches any depth (no `!` exceptions are used)."""
    parts = rel.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    for pattern in patterns:
        for prefix in prefixes:
            if fnmatch.fnmatchcase(prefix, pattern) or (
                    pattern.startswith("**/") and fnmatch.fnmatchcase(prefix.rsplit("/", 1)[-1], pattern[3:])):
                return True
    return False


def build_context(dest: Path) -> list[str]:
    """Copy what `docker build .` would send from a clean clone (tracked files minus
    .dockerignore) into ``dest``; return the relative paths copied."""
    tracked = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z"], capture_output=True, check=True,
                             timeout=30).stdout.decode().split("\0")
    patterns = dockerignore_patterns()
    copied = []
    for rel in filter(None, tracked):
        src = REPO / rel
        if ignored(rel, patterns) or not (src.is_file() or src.is_symlink()):
            continue
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        if src.is_symlink():  # loraplex/kernels -> ../kernels: Docker sends links as links
            os.symlink(os.readlink(src), dest / rel)
        else:
            shutil.copy2(src, dest / rel)
        copied.append(rel)
    return copied


def store_image_requirements() -> list[Requirement]:
    """The packages docker/store.Dockerfile installs beside the wheel (its second pip install)."""
    wheel, packages = pip_installs(parse_dockerfile(REPO / "docker" / "store.Dockerfile").stage("venv"))
    assert wheel == ["install", "--no-deps", "/dist/loraplex-*.whl"], "the wheel, from stage 1, without its deps"
    return [Requirement(spec) for spec in packages[1:]]
