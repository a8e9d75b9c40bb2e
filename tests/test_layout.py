"""The package's layout is its architecture: the import graph has no cycle, no module imports a layer above its
own (LAYERS), no library module imports a command, and files and runtime functions stay small.

Read from the source with `ast` (nothing is imported), function-level imports included: a lazy import
is still a dependency.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "dflash_ds"
# The package's layers, bottom first: a module imports its own layer and those below, never one above. A unit is a
# folder of dflash_ds/ or a top-level module; units of one layer may import each other (the cycle test still holds).
LAYERS = (
    # library: models, loss, data, process groups and wire, the vLLM client, config, errors: what the rest builds on
    ("library", ("models", "components", "data", "distributed", "serving", "config", "config_kinds", "config_parse",
                 "config_recipe", "config_rules", "errors", "hardware", "process_exit", "redact", "dflash_ds")),
    # memory: the memory model, counted from the library's code (a kind's MemoryTerms, anchor quotas, the pool)
    ("memory", ("memory",)),
    # runtime: the trainer's roles; it sizes activation checkpointing by the memory model
    ("runtime", ("runtime",)),
    # commands: eval, plan, tools and tiny, on the library and the trainer (plan prices by its checkpointing rule)
    ("commands", ("eval", "plan", "tools", "tiny")),
    # bench: the benchmarks measure everything below, commands included; nothing but the CLI imports one
    ("bench", ("bench",)),
    # entry points: the dflash-ds command and the trainer's
    ("entry", ("cli", "train", "__main__")),
)
LAYER_OF = {unit: (i, layer) for i, (layer, units) in enumerate(LAYERS) for unit in units}
LIBRARY = LAYERS[0][1]
MAX_FILE_LINES = 400
MAX_RUNTIME_FUNCTION_LINES = 80
MAX_RUN_DRAFTER_LINES = 60


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports_of(name: str) -> set[str]:
    """The dflash_ds modules `name` imports (an imported name that is a module counts as that module)."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        for target in targets:
            while target and target not in MODULES:
                target = target.rpartition(".")[0]
            if target.startswith("dflash_ds.") and target != name:
                found.add(target)
    return found


GRAPH = {name: imports_of(name) for name in MODULES}


def unit(name: str) -> str:
    """The folder of dflash_ds/ a module is in, or a top-level module's own name (the package: "dflash_ds")."""
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def upward_imports(graph: dict[str, set[str]] = GRAPH) -> list[str]:
    """Every import of `graph` from a layer to a higher one, as "module (layer) -> module (layer)"."""
    return sorted(f"{m} ({LAYER_OF[unit(m)][1]}) -> {dep} ({LAYER_OF[unit(dep)][1]})"
                  for m, deps in graph.items() for dep in deps if LAYER_OF[unit(dep)][0] > LAYER_OF[unit(m)][0])


@functools.cache
def command_modules() -> frozenset[str]:
    """Modules that are a command: they define both `add_arguments` and `run` at top level."""
    out = set()
    for name, path in MODULES.items():
        defs = {n.name for n in ast.parse(path.read_text()).body if isinstance(n, ast.FunctionDef)}
        if {"add_arguments", "run"} <= defs:
            out.add(name)
    return frozenset(out)


def find_cycle(graph: dict[str, set[str]] = GRAPH) -> list[str] | None:
    """One import cycle of `graph` as a path of module names, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for dep in sorted(graph[m]):
            if state.get(dep) == 1:
                return path[path.index(dep):] + [dep]
            if dep not in state and (cycle := visit(dep)):
                return cycle
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (cycle := visit(m)):
            return cycle
    return None


def test_the_walk_sees_the_package() -> None:
    # The walk must find the known edges, or every assertion below would pass on an empty graph.
    assert "dflash_ds.distributed.bridge" in GRAPH["dflash_ds.distributed.wire"]
    assert "dflash_ds.runtime.launch" in GRAPH["dflash_ds.train"]  # a function-level import
    assert {"dflash_ds.tools.init_drafter", "dflash_ds.data.prepare", "dflash_ds.bench.memory"} <= command_modules()
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None
    assert "dflash_ds.memory.model" in GRAPH["dflash_ds.runtime.checkpointing"]  # a function-level import
    assert upward_imports({"dflash_ds.memory.model": {"dflash_ds.models.kinds", "dflash_ds.bench.memory"},
                           "dflash_ds.cli": {"dflash_ds.bench.cli"}}) == [
        "dflash_ds.memory.model (memory) -> dflash_ds.bench.memory (bench)"]


def test_no_import_cycle() -> None:
    assert find_cycle() is None, " -> ".join(find_cycle() or [])


def test_every_unit_has_one_layer() -> None:
    named = [u for _, units in LAYERS for u in units]
    assert len(named) == len(set(named)), named
    present = {unit(m) for m in MODULES}
    assert present == set(named), {"without a layer": sorted(present - set(named)),
                                   "in LAYERS, not in dflash_ds/": sorted(set(named) - present)}


def test_no_import_goes_up_the_layers() -> None:
    up = upward_imports()
    assert not up, f"{len(up)} import(s) up the layers (LAYERS, bottom first):\n" + "\n".join(up)


@pytest.mark.parametrize("library", LIBRARY)
def test_library_never_imports_a_command(library: str) -> None:
    # beyond the layers: a command that lives in a library folder (data's prepare) is no library to import
    commands = command_modules()
    bad = sorted(f"{m} -> {dep}" for m in MODULES if unit(m) == library for dep in GRAPH[m] if dep in commands)
    assert not bad, bad


def test_files_stay_small() -> None:
    long = {str(p.relative_to(PACKAGE)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES}
    assert not long, long


def test_runtime_functions_read_in_one_sitting() -> None:
    lengths = {}
    for p in sorted((PACKAGE / "runtime").glob("*.py")):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lengths[f"{p.name}:{node.name}"] = node.end_lineno - node.lineno + 1
    long = {k: n for k, n in lengths.items() if n > MAX_RUNTIME_FUNCTION_LINES}
    assert not long, long
    assert lengths["drafter_worker.py:run_drafter"] <= MAX_RUN_DRAFTER_LINES
