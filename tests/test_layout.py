"""The package's layout is its architecture: the import graph has no cycle, the library folders never
reach up into the trainer, the benches or a command, and files and runtime functions stay small.

Read from the source with `ast` (nothing is imported), function-level imports included: a lazy import
is still a dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "dflash_ds"
# Folders of library code: single-device models, the loss, the data, the process groups and the wire.
LIBRARY = ("models", "components", "data", "distributed")
# What the library must never import: the trainer's roles, benchmarks and commands.
UPPER = ("runtime", "bench", "plan", "tools", "tiny", "eval", "cli", "train", "__main__")
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


def command_modules() -> set[str]:
    """Modules that are a command: they define both `add_arguments` and `run` at top level."""
    out = set()
    for name, path in MODULES.items():
        defs = {n.name for n in ast.parse(path.read_text()).body if isinstance(n, ast.FunctionDef)}
        if {"add_arguments", "run"} <= defs:
            out.add(name)
    return out


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


def test_no_import_cycle() -> None:
    assert find_cycle() is None, " -> ".join(find_cycle() or [])


@pytest.mark.parametrize("folder", LIBRARY)
def test_library_never_imports_the_trainer_benches_or_commands(folder: str) -> None:
    upper = {m for m in MODULES if m.split(".")[1:2] and m.split(".")[1] in UPPER} | command_modules()
    bad = sorted(f"{m} -> {dep}" for m in MODULES if m.split(".")[1:2] == [folder]
                 for dep in GRAPH[m] if dep in upper and dep != m)
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
