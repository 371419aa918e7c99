"""The coordinator's import rules, read from its source: it never imports the worker, the
CLI or the launcher, and its own modules import each other one way only (no cycle, no
import hidden behind TYPE_CHECKING)."""

from __future__ import annotations

import ast
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

PACKAGE = "geoloco.coordinator"
FOLDER = Path(__file__).resolve().parents[2] / "coordinator"
FORBIDDEN = ("geoloco.worker", "geoloco.cli", "geoloco.launch")


def imported_modules(path: Path) -> set[str]:
    """Every module ``path`` imports (``from X import y`` gives X and X.y)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def modules() -> dict[str, Path]:
    found = {f"{PACKAGE}.{p.stem}": p for p in FOLDER.glob("*.py") if p.stem != "__init__"}
    assert len(found) >= 8, f"coordinator modules not found under {FOLDER}"
    return found


def test_the_coordinator_never_imports_the_worker_cli_or_launcher() -> None:
    for name, path in modules().items():
        bad = sorted(m for m in imported_modules(path)
                     if any(m == f or m.startswith(f + ".") for f in FORBIDDEN))
        assert not bad, f"{name} imports {bad}"


def test_coordinator_modules_import_each_other_without_a_cycle() -> None:
    found = modules()
    graph = {name: {m for m in imported_modules(path) if m in found and m != name}
             for name, path in found.items()}
    try:
        list(TopologicalSorter(graph).static_order())
    except CycleError as exc:
        raise AssertionError(f"import cycle among coordinator modules: {exc.args[1]}") from None
    for name, path in found.items():
        assert "TYPE_CHECKING" not in path.read_text(), f"{name} hides an import behind TYPE_CHECKING"
