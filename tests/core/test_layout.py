"""The package layout shows the data flow: which package may import which, and no cycles between them."""

from __future__ import annotations

import ast
from pathlib import Path

import pagedllm

ROOT = Path(pagedllm.__file__).parent

# package -> the pagedllm packages it may import (top-level modules such as
# pagedllm.config and pagedllm.sampling_params are plain data, and pagedllm.cache_dir
# a leaf that names a folder: open to all)
ALLOWED = {
    "kernels": set(),
    "layers": {"kernels", "distributed"},
    "distributed": {"loader", "kernels"},
    "models": {"layers", "loader"},
    "loader": set(),
    "engine": {"loader", "runner", "distributed"},
    "runner": {"kernels", "layers", "models", "loader", "distributed"},
    "entrypoints": {"engine", "loader", "runner", "kernels", "layers", "bench", "distributed"},
    "bench": {"entrypoints", "engine", "loader", "distributed"},
}
DATA_MODULES = {"config", "sampling_params", "outputs", "step_record", "block_table", "cache_dir"}


def _imports(path: Path) -> set[str]:
    """The pagedllm modules a file imports, as dotted names below ``pagedllm``."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("pagedllm"):
            names.add(node.module.removeprefix("pagedllm").lstrip("."))
        elif isinstance(node, ast.Import):
            names.update(a.name.removeprefix("pagedllm.") for a in node.names if a.name.startswith("pagedllm."))
    return names


def _package_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT).parts
        if len(parts) < 2:
            continue  # top-level modules
        deps = {name.split(".")[0] for name in _imports(path)} - {parts[0], ""} - DATA_MODULES
        graph.setdefault(parts[0], set()).update(deps)
    return graph


def test_every_package_imports_only_what_it_may() -> None:
    graph = _package_graph()
    assert set(graph) == set(ALLOWED), "a package was added or removed: say here what it may import"
    for package, deps in graph.items():
        assert deps <= ALLOWED[package], f"pagedllm.{package} imports {sorted(deps - ALLOWED[package])}"


def test_models_import_layers_and_their_config_only() -> None:
    """A model family is one file written from layers; only the registry knows them all."""
    for path in (ROOT / "models").glob("*.py"):
        for name in _imports(path):
            own_family = path.name == "registry.py" and name.startswith("models.")
            assert own_family or name.startswith("layers") or name == "loader.model_config", (
                f"{path.name} imports pagedllm.{name}"
            )


def test_no_import_cycles_between_packages() -> None:
    graph = _package_graph()
    state: dict[str, int] = {}

    def visit(node: str, trail: list[str]) -> None:
        if state.get(node) == 1:
            raise AssertionError("import cycle: " + " -> ".join([*trail, node]))
        if state.get(node) == 2:
            return
        state[node] = 1
        for dep in graph.get(node, ()):
            visit(dep, [*trail, node])
        state[node] = 2

    for package in graph:
        visit(package, [])
