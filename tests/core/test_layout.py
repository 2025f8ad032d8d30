"""The package layout shows the data flow: which package may import which, layers in one order, no cycles."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator, Mapping, Set
from pathlib import Path

import pagedllm

ROOT = Path(pagedllm.__file__).parent

# package -> the pagedllm packages it may import (top-level modules such as
# pagedllm.config and pagedllm.sampling_params are plain data, pagedllm.cache_dir
# a leaf that names a folder and pagedllm.step_time a leaf fit of a step's time that
# the engine's prefill cap and spec_decode's drafting cost both read: open to all). The map is acyclic, so it orders the
# packages in layers: each may import only packages below it.
ALLOWED = {
    "kernels": set(),
    "layers": {"kernels", "distributed", "loader"},
    "distributed": {"loader", "kernels"},
    "models": {"layers", "loader"},  # loader: its config types only (test below)
    "loader": set(),
    "engine": {"loader", "runner", "distributed", "spec_decode", "structured_output", "harmony", "kv_disk", "pooling"},
    # pooling models' heads, prompts and outputs (embed / classify / score): below the engine, whose
    # pooling_methods.py (LLM.embed ...) and the server's pooling routes use them
    "pooling": {"loader"},
    # the prefix cache on disk: its store is plain Python the block manager asks; its fingerprint reads the
    # model's config types
    "kv_disk": {"loader"},
    # speculative decoding's proposers and policy: plain Python below the engine (the runner verifies)
    "spec_decode": set(),
    # constraint limits, compile workers and grammar state: used by the engine and the server; the runner
    # only applies the packed masks they produce, without importing it
    "structured_output": set(),
    "runner": {"kernels", "layers", "models", "loader", "distributed"},
    # engine clients (one engine thread, data-parallel replicas): above the engine, below the server
    "clients": {"engine", "loader", "distributed", "structured_output", "kv_disk"},
    # gpt-oss's harmony format (openai-harmony): its vocabulary, prompt rendering and detection; a leaf
    "harmony": set(),
    "entrypoints": {"clients", "engine", "loader", "structured_output", "kernels", "layers", "bench", "distributed",
                    "harmony", "pooling"},
    "bench": {"engine", "loader", "distributed"},
}
# config_record: how config records are declared (pydantic); resolved_config: the config's "auto"s resolved,
# the one top-level module that asks the machine (it imports kernels / layers / distributed inside functions);
# step_time: the fitted model of a step's time, a leaf both the engine and spec_decode read; expert_counts: a
# mixture of experts' routing counts, which the runner fills and the server's metrics and the bench read;
# thinking_budget: the rule that closes a reasoning block after N tokens (a pure function of the tokens), which
# the request's sampling spec carries to the runner's logits rules; pooler_config: a pooling model's
# pooling type, normalisation and dimensions, a field of the engine config; c_heap: the C allocator's
# process-wide settings (ctypes only), which the runner, the command and a data-parallel replica's process set
DATA_MODULES = {"config", "config_record", "resolved_config", "sampling_params", "outputs", "step_record",
                "step_result", "block_table", "cache_dir", "step_time", "device_memory", "expert_counts",
                "thinking_budget", "pooler_config", "kv_groups", "c_heap"}
# the packages a top-level data module may import: plain Python that itself imports only these (and data
# modules). Every package imports the data modules, so a data module importing anything higher (the runner,
# the engine) would be an import running back up the layers. resolved_config alone also reads the machine
# (kernels, layers, distributed, inside its functions), never the runner or the engine.
DATA_MODULE_PACKAGES = {"structured_output", "spec_decode", "distributed", "kernels", "loader"}


def _module_name(path: Path) -> str:
    """``pagedllm/engine/request.py`` -> ``pagedllm.engine.request``; a package's ``__init__`` is the package."""
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_module_name(path): path for path in ROOT.rglob("*.py")}


def _walk(node: ast.AST, into_functions: bool) -> Iterator[ast.AST]:
    """The nodes below ``node``; without ``into_functions``, those that run when the module is imported.

    ``if TYPE_CHECKING:`` blocks are kept: a type named across modules ties
    them as much as an import that runs.
    """
    for child in ast.iter_child_nodes(node):
        if not into_functions and isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        yield child
        yield from _walk(child, into_functions)


def _top_level_names() -> dict[str, str]:
    """Name -> module for what ``pagedllm/__init__.py`` takes from its modules (``LLM`` lazily, in ``__getattr__``).

    ``from pagedllm import LLM`` imports the module that defines ``LLM``; the
    graphs below must see that module, not only the top-level package.
    """
    names: dict[str, str] = {}
    for node in ast.walk(ast.parse((ROOT / "__init__.py").read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("pagedllm."):
            names.update({a.asname or a.name: node.module for a in node.names})
    return names


TOP_LEVEL_NAMES = _top_level_names()


def _imports(path: Path, *, into_functions: bool = True) -> set[str]:
    """The pagedllm modules a file imports, as full dotted names (``pagedllm.engine.request``)."""
    module = _module_name(path)
    return _imports_of(path.read_text(), module, path.name == "__init__.py", into_functions=into_functions)


def _imports_of(source: str, module: str, is_package: bool, *, into_functions: bool = True) -> set[str]:
    """The pagedllm modules that ``source``, the text of ``module``, imports.

    ``from pagedllm.x import y`` counts ``pagedllm.x`` and, when ``y`` is a
    module, ``pagedllm.x.y``; ``from pagedllm import LLM`` counts the module
    that defines ``LLM``.
    """
    package = module if is_package else module.rpartition(".")[0]
    names: set[str] = set()
    for node in _walk(ast.parse(source), into_functions):
        if isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolved against this file's package
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                source_module = f"{base}.{node.module}" if node.module else base
            else:
                source_module = node.module or ""
            if source_module != "pagedllm" and not source_module.startswith("pagedllm."):
                continue
            names.add(source_module)
            for alias in node.names:
                if f"{source_module}.{alias.name}" in MODULES:
                    names.add(f"{source_module}.{alias.name}")
                elif source_module == "pagedllm" and alias.name in TOP_LEVEL_NAMES:
                    names.add(TOP_LEVEL_NAMES[alias.name])
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names if a.name == "pagedllm" or a.name.startswith("pagedllm."))
    return names


def _package_of(module: str) -> str:
    """``pagedllm.engine.request`` -> ``engine``; the top-level package -> ``""``."""
    return module.removeprefix("pagedllm").lstrip(".").split(".")[0]


def _package_graph() -> dict[str, set[str]]:
    """Package -> the other packages its files import (anywhere in a file, lazy imports included)."""
    graph: dict[str, set[str]] = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT).parts
        if len(parts) < 2:
            continue  # top-level modules
        deps = {_package_of(name) for name in _imports(path)} - {parts[0], ""} - DATA_MODULES
        graph.setdefault(parts[0], set()).update(deps)
    return graph


def _module_graph() -> dict[str, set[str]]:
    """Module -> the pagedllm modules it imports when it is imported, or names under TYPE_CHECKING."""
    return {
        module: (_imports(path, into_functions=False) & MODULES.keys()) - {module}
        for module, path in MODULES.items()
    }


def _find_cycle(graph: Mapping[str, Set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as its nodes, first repeated last, or None when it has none."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done, no cycle through it

    def visit(node: str, trail: list[str]) -> list[str] | None:
        if state.get(node) == 1:
            return [*trail[trail.index(node):], node]
        if state.get(node) == 2:
            return None
        state[node] = 1
        for dep in sorted(graph.get(node, ())):
            cycle = visit(dep, [*trail, node])
            if cycle is not None:
                return cycle
        state[node] = 2
        return None

    for node in sorted(graph):
        cycle = visit(node, [])
        if cycle is not None:
            return cycle
    return None


def _layers() -> dict[str, int]:
    """Each package's layer in the order ALLOWED implies: 0 imports no package, else 1 + its highest import's."""
    cycle = _find_cycle(ALLOWED)
    assert cycle is None, "ALLOWED lets packages import each other in a circle: " + " -> ".join(cycle)
    layers: dict[str, int] = {}

    def layer(package: str) -> int:
        if package not in layers:
            layers[package] = 1 + max((layer(dep) for dep in ALLOWED[package]), default=-1)
        return layers[package]

    for package in ALLOWED:
        layer(package)
    return layers


def test_every_package_imports_only_what_it_may() -> None:
    """Each package imports only the packages ALLOWED names for it."""
    graph = _package_graph()
    assert set(graph) == set(ALLOWED), "a package was added or removed: say here what it may import"
    for package, deps in graph.items():
        assert deps <= ALLOWED[package], f"pagedllm.{package} imports {sorted(deps - ALLOWED[package])}"


def test_no_package_imports_one_above_it() -> None:
    """Imports go down the layers that ALLOWED implies (bench below entrypoints: the CLI runs the benchmarks)."""
    layers = _layers()
    order = " < ".join(sorted(layers, key=lambda p: (layers[p], p)))
    for package, deps in _package_graph().items():
        for dep in sorted(deps):
            assert layers.get(dep, -1) < layers[package], (
                f"pagedllm.{package} imports pagedllm.{dep}, which is not below it ({order})"
            )


def test_models_import_layers_and_their_config_only() -> None:
    """A model family is one file written from layers; only the registry knows them all."""
    for path in (ROOT / "models").glob("*.py"):
        for name in _imports(path):
            own_family = path.name == "registry.py" and name.startswith("pagedllm.models.")
            allowed = (
                own_family
                or name == "pagedllm.layers"
                or name.startswith("pagedllm.layers.")
                or name == "pagedllm.loader.model_config"
                or name.removeprefix("pagedllm.") in DATA_MODULES
            )
            assert allowed, f"{path.name} imports {name}"


def test_no_import_cycles_between_packages() -> None:
    """No package imports, even lazily, a package that imports it back."""
    cycle = _find_cycle(_package_graph())
    assert cycle is None, "import cycle between packages: " + " -> ".join(cycle)


def test_no_import_cycles_between_modules() -> None:
    """No module imports, when imported or under TYPE_CHECKING, a module that imports it back.

    A cycle inside a package passes the package checks above; it still means
    neither module can be read, tested or moved without the other.
    """
    cycle = _find_cycle(_module_graph())
    assert cycle is None, "import cycle between modules: " + " -> ".join(cycle)


def test_the_checks_see_what_an_import_reaches() -> None:
    """Imports through the top-level package, of submodules, relative, lazy or typing-only all count."""
    source = (
        "from typing import TYPE_CHECKING\n"
        "from pagedllm import LLM, kernels\n"
        "from pagedllm.loader import gguf_loader, iter_weights\n"
        "from .scheduler import Scheduler\n"
        "if TYPE_CHECKING:\n"
        "    from pagedllm.engine.request import Request\n"
        "def lazy() -> None:\n"
        "    import pagedllm.runner.sampler\n"
    )
    assert _imports_of(source, "pagedllm.engine.x", False) == {
        "pagedllm", "pagedllm.engine.llm", "pagedllm.kernels", "pagedllm.loader", "pagedllm.loader.gguf_loader",
        "pagedllm.engine.scheduler", "pagedllm.engine.request", "pagedllm.runner.sampler",
    }
    # the module graph leaves out what runs only when a function is called
    assert "pagedllm.runner.sampler" not in _imports_of(source, "pagedllm.engine.x", False, into_functions=False)
    assert "pagedllm.engine.request" in _imports_of(source, "pagedllm.engine.x", False, into_functions=False)


def _reachable(package: str) -> set[str]:
    """The packages ``package`` may import, directly or through others (ALLOWED's transitive closure)."""
    seen: set[str] = set()
    todo = [package]
    while todo:
        for dep in ALLOWED[todo.pop()]:
            if dep not in seen:
                seen.add(dep)
                todo.append(dep)
    return seen


def test_no_data_module_imports_back_up() -> None:
    """The top-level data modules (config, sampling parameters, step records) import only plain packages below
    the runner, and those only each other: ``config.py`` once imported the runner for ``GrammarLimits``."""
    for package in DATA_MODULE_PACKAGES:
        assert _reachable(package) <= DATA_MODULE_PACKAGES, f"pagedllm.{package} reaches above the data modules"
    for name in sorted(DATA_MODULES):
        deps = {_package_of(module) for module in _imports(ROOT / f"{name}.py")} - {""} - DATA_MODULES
        may = DATA_MODULE_PACKAGES | ({"layers"} if name == "resolved_config" else set())
        assert deps <= may, f"pagedllm.{name} imports {sorted(deps - may)}"
        assert "runner" not in deps and "engine" not in deps


def test_structured_output_imports_without_runner_or_torch() -> None:
    """``pagedllm.structured_output`` (and ``pagedllm.config``, which holds its limits) import neither the runner
    nor torch nor xgrammar: the engine's bookkeeping and the server's request checks use them torch-free."""
    code = (
        "import sys\n"
        "import pagedllm.structured_output, pagedllm.structured_output.compile_workers, pagedllm.config\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'xgrammar', 'triton')"
        " or m.startswith('pagedllm.runner')))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_runner_does_not_import_structured_output() -> None:
    """The runner applies the masks a step carries as bytes; the grammars themselves stay above it."""
    for path in (ROOT / "runner").rglob("*.py"):
        names = {name for name in _imports(path) if _package_of(name) == "structured_output"}
        assert not names, f"runner/{path.name} imports {sorted(names)}"
