"""The house's floors, read from the source: `ladder/` (the model and what every stage shares)
never names a stage or the commands, not even in an import string, and no modules import each
other in a circle."""

from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path

import pytest

REPOSITORY = Path(__file__).resolve().parents[1]
# Source folder -> the package it installs as (setup.cfg's package_dir).
PACKAGES = {
    "ladder": "ladder",
    "convert": "ladder.convert",
    "adapt": "ladder.adapt",
    "eval": "ladder.eval",
    "cli": "ladder.cli",
}
UPPER_FLOORS = ("ladder.convert", "ladder.adapt", "ladder.eval", "ladder.cli")
SECOND_NAMES = ("convert", "adapt", "eval", "cli", "benchmarks")


def modules() -> dict[str, Path]:
    found = {}
    for folder, package in PACKAGES.items():
        for path in (REPOSITORY / folder).rglob("*.py"):
            parts = path.relative_to(REPOSITORY / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join((package, *parts))] = path
    return found


def named_modules(path: Path, module: str, known: set[str]) -> set[str]:
    """Project modules that `path` imports (at any depth, relative imports resolved) or names in a string."""
    names = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    [*package.split(".")[: len(package.split(".")) - node.level + 1], *filter(None, [base])]
                )
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("ladder."):
            names.add(node.value.split(":")[0])
    return {name for name in names if name in known and name != module}


def import_graph() -> dict[str, set[str]]:
    found = modules()
    return {module: named_modules(path, module, set(found)) for module, path in found.items()}


def upper(module: str) -> bool:
    """A stage or the commands: `ladder.cli.plan`, not `ladder.cli_types` (a name that only starts alike)."""
    return any(module == floor or module.startswith(floor + ".") for floor in UPPER_FLOORS)


def test_the_ground_floor_names_no_stage_and_no_command():
    upward = {
        (module, name) for module, names in import_graph().items() if not upper(module) for name in names if upper(name)
    }
    assert not upward


def test_no_modules_import_each_other_in_a_circle():
    graph = import_graph()
    # A package's __init__ that imports its own submodules is not a circle: drop parent edges.
    graph = {m: {n for n in names if not m.startswith(n + ".")} for m, names in graph.items()}
    visiting, done, circles = set(), set(), []

    def visit(module: str, path: list[str]) -> None:
        visiting.add(module)
        for name in sorted(graph[module]):
            if name in visiting:
                circles.append(path[path.index(name) :] + [name])
            elif name not in done:
                visit(name, [*path, name])
        visiting.discard(module)
        done.add(module)

    for module in sorted(graph):
        if module not in done:
            visit(module, [module])
    assert not circles


@pytest.mark.parametrize("folder", SECOND_NAMES)
def test_no_stage_imports_under_its_folder_name(folder):
    """`adapt.recipe` beside `ladder.adapt.recipe` was a second copy of one module in one process
    (`python -m pytest` puts the working folder, the checkout, on sys.path); tests import `ladder.*`."""
    assert importlib.util.find_spec(folder) is None
    assert not [name for name in sys.modules if name.partition(".")[0] == folder]
