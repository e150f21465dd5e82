"""benchmarks/ is one package by subject: every folder a package, every script run as a module
without touching sys.path (benchmarks/__init__.py alone puts the checkout root last), every entry
point listed in benchmarks/README.md with its command, and tests reaching benchmarks only through
their package names and public API (no sys.path entry for benchmarks/, no underscore names)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "benchmarks"
PATCH = re.compile(r"sys\.path(?:\.(?:insert|append|extend|remove)\(|\[[^\]]*\]\s*=|\s*=)")  # code, not prose


def _modules() -> list[Path]:
    return sorted(p for p in BENCH.rglob("*.py") if "history" not in p.parts)


def _entry_points() -> list[str]:
    return [".".join(p.relative_to(REPO).with_suffix("").parts) for p in _modules()
            if 'if __name__ == "__main__":' in p.read_text()]


def test_every_folder_is_a_package_and_only_the_package_touches_sys_path() -> None:
    folders = {p.parent for p in _modules()}
    assert {f.name for f in folders} == {"benchmarks", "common", "kernels", "engine", "serving", "store"}
    assert all((f / "__init__.py").is_file() for f in folders)
    patching = [p.relative_to(REPO).as_posix() for p in _modules()
                if PATCH.search(p.read_text()) and p != BENCH / "__init__.py"]
    assert not patching, patching
    assert not list(BENCH.glob("bench_*.py")), "scripts live in a subject folder"


def test_every_entry_point_has_a_row_and_a_module_command_in_the_readme() -> None:
    readme = (BENCH / "README.md").read_text()
    entries = _entry_points()
    assert len(entries) >= 18
    for module in entries:
        assert f"| `{module}` |" in readme, f"{module}: no row in benchmarks/README.md"
        assert f"python -m {module}" in readme, f"{module}: no command in benchmarks/README.md"
    named = {line.split("|")[2].strip(" `") for line in readme.splitlines() if line.startswith("| ")}
    named -= {"module", "---"}
    assert named <= set(entries), f"rows for modules that are not entry points: {named - set(entries)}"
    assert "history/RESULTS-2026.md" in readme and "git" in readme


def _benchmark_imports(tree: ast.AST) -> list[tuple[str, str]]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "benchmarks":
            out += [(node.module, alias.name) for alias in node.names]
        elif isinstance(node, ast.Import):
            out += [(alias.name, "") for alias in node.names if alias.name.split(".")[0] == "benchmarks"]
    return out


def test_tests_import_benchmarks_by_package_and_public_names_only() -> None:
    bad = []
    for path in sorted((REPO / "tests").rglob("*.py")):
        text = path.read_text()
        where = path.relative_to(REPO).as_posix()
        if re.search(r"sys\.path\.(?:insert|append)\(.*benchmarks", text):
            bad.append(f"{where}: puts benchmarks/ on sys.path")
        for module, name in _benchmark_imports(ast.parse(text)):
            if name.startswith("_") or any(part.startswith("_") for part in module.split(".")):
                bad.append(f"{where}: imports {module}.{name}")
    assert not bad, "\n".join(bad)


def test_benchmarks_import_nothing_from_tests() -> None:
    test_modules = {p.stem for p in (REPO / "tests").glob("*.py")}
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            for name in names:
                assert name.split(".")[0] not in test_modules, f"{path.relative_to(REPO)} imports {name}"


def test_a_benchmark_process_from_the_checkout_root_imports_transformers_models() -> None:
    """``python -m benchmarks...`` puts the root first, where its kernels/ would shadow Hugging
    Face's kernels (transformers' modeling code imports it): the package puts the root last."""
    import subprocess
    import sys

    code = "import benchmarks, kernels; from transformers import LlamaForCausalLM; print(kernels.__file__)"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert Path(out.stdout.strip()).parent != REPO / "kernels"
