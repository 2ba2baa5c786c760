"""The package import graph WORKSPACE.md describes: every import of a module of ``nested``
points to its own package or to one beneath it, never up.

Every import statement counts, at module level or inside a function (a lazy import is still a
dependency). The deprecated paths (``DEPRECATED``) are the one exception: modules that warn and
hand over the module that moved, loaded only by code that still uses the old path.
"""

import ast
import importlib
import sys
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "nested"

# Lowest first: packages, and top-level modules (files.py). ``nested`` is the package's own
# __init__ (the public API) and launch.py.
LAYERS = (
    "files",
    "ops",
    "learn",
    "core",
    "levels",
    "data",
    "nested",
    "nn",
    "plasticity",
    "run",
    "companion",
)

DEPRECATED = {
    "nested.learn.recipes": "nested.levels.recipes",
    "nested.learn.optim": "nested.levels.optim",
}


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(name: str) -> bool:
    path = ROOT.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else "nested"


def _imports(path: Path, module: str) -> set[str]:
    """The modules of ``nested`` that ``path`` imports (relative imports resolved)."""
    found = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            names = [f"{base}.{alias.name}" for alias in node.names]
            # `from nested import files` imports the module files, not the public API.
            found.update(names if base == "nested" and all(map(_is_module, names)) else [base])
            found.update(names)
    return {name for name in found if name == "nested" or name.startswith("nested.")}


def graph() -> dict[str, set[str]]:
    """Module -> the modules of ``nested`` it imports (names that are not modules, such as
    ``nested.core.level.Level``, are kept: their layer is their module's)."""
    return {
        _module(path): _imports(path, _module(path))
        for path in sorted(ROOT.rglob("*.py"))
        if _module(path) not in DEPRECATED
    }


def upward(edges: dict[str, set[str]]) -> list[str]:
    """``importer -> imported`` for every import that points to a higher layer, or across to
    another package of the same rank."""
    rank = {name: i for i, name in enumerate(LAYERS)}
    bad = []
    for importer, imported in edges.items():
        for name in sorted(imported):
            low, high = _layer(importer), _layer(name)
            if low != high and rank[high] >= rank[low]:
                bad.append(f"{importer} ({low}) -> {name} ({high})")
    return bad


def test_every_import_points_down():
    assert upward(graph()) == []


def test_the_check_finds_an_upward_import():
    """The check on a graph with today's layering broken: ops reading a core declaration."""
    edges = graph()
    edges["nested.ops.chunked"] = edges["nested.ops.chunked"] | {"nested.core.level"}
    assert upward(edges) == ["nested.ops.chunked (ops) -> nested.core.level (core)"]


def test_every_package_has_a_layer():
    packages = {p.name for p in ROOT.iterdir() if (p / "__init__.py").exists()}
    assert packages == set(LAYERS) - {"nested", "files"}


def test_workspace_map_names_the_layers_in_order():
    """WORKSPACE.md's dependency line lists the packages from the top down, as LAYERS does."""
    text = (ROOT.parent / "WORKSPACE.md").read_text()
    line = next(row for row in text.splitlines() if row.startswith("Dependencies point down:"))
    named = [part.strip(" `.;") for part in line.split(":", 1)[1].split("->")]
    assert named == [name for name in reversed(LAYERS) if name not in ("nested", "files")]


@pytest.mark.parametrize("old,new", sorted(DEPRECATED.items()))
def test_a_deprecated_path_warns_and_gives_the_moved_module(old, new):
    sys.modules.pop(old, None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(old)
    assert module is importlib.import_module(new)
    assert any(issubclass(w.category, DeprecationWarning) and new in str(w.message) for w in caught)
