"""The import arrows point one way (docs/architecture.md): the codec and the wire stubs
import nothing of the project; worker and coordinator never import each other; the shared
modules import neither side; only the CLI and the local launcher know both sides, and
nothing imports them, but for the package root's lazy re-exports of the Python API. Every
import in every module counts, those inside functions too."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# import name of each fixed top-level folder (pyproject.toml, [tool.setuptools.package-dir])
FOLDERS = {"geoloco": "geoloco", "compression": "geoloco.compression", "coordinator": "geoloco.coordinator",
           "worker": "geoloco.worker", "protos": "geoloco.protos"}
SIDES = ("geoloco.worker", "geoloco.coordinator")
# geoloco.worker.__main__ is `python -m geoloco.worker`, what torchrun starts for an island of
# ranks: `geoloco worker` by another name, so an entry point like the CLI it calls
ENTRY_POINTS = ("geoloco.cli", "geoloco.launch", "geoloco.worker.__main__")
LIBRARIES = ("geoloco.compression", "geoloco.protos")  # a library on its own each
# geoloco/__init__.py's module __getattr__ imports these on first use of geoloco.run_local,
# geoloco.Coordinator, geoloco.Worker: the one exception to the arrows, and lazy, so the
# import-time graph has no edge from the root to them (a cycle through them is no cycle)
ROOT_FACADE = ("geoloco.launch", "geoloco.coordinator.app", "geoloco.worker.app")


def layer(module: str) -> str:
    """The layer a module belongs to: a side, an entry point, a library, or shared."""
    for name in (*ENTRY_POINTS, *SIDES, *LIBRARIES):
        if module == name or module.startswith(name + "."):
            return name
    return "shared"


def allowed(importer: str, imported: str) -> bool:
    """Whether ``importer`` may import ``imported`` (both geoloco modules)."""
    src, dst = layer(importer), layer(imported)
    if src == dst or imported == "geoloco":  # within a layer; the package root (__version__)
        return True
    if importer == "geoloco" and imported in ROOT_FACADE:
        return True
    if src in LIBRARIES:
        return False
    if dst in ENTRY_POINTS:
        return (src, dst) in (("geoloco.cli", "geoloco.launch"), ("geoloco.worker.__main__", "geoloco.cli"))
    # the entry points use anything; a side never imports the other, the shared modules
    # import neither; sides and shared modules use the shared modules and the libraries
    return src in ENTRY_POINTS or dst not in SIDES


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT)
    parts = [FOLDERS[rel.parts[0]], *rel.parts[1:]]
    parts[-1] = parts[-1].removesuffix(".py")
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path, module: str, known: set[str]) -> set[str]:
    """The project modules ``path`` imports (relative imports resolved; ``from X import y``
    counts as X.y when that is a module, else as X)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found |= {f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names}
    return {name for name in found if name in known}


def project_modules() -> dict[str, Path]:
    files = [p for folder in FOLDERS for p in (ROOT / folder).rglob("*.py") if "__pycache__" not in p.parts]
    return {module_name(p): p for p in files}


def violations(modules: dict[str, Path]) -> list[str]:
    known = set(modules)
    found = []
    for module, path in sorted(modules.items()):
        for target in sorted(imports_of(path, module, known)):
            if not allowed(module, target):
                found.append(f"{module} imports {target} ({layer(module)} -> {layer(target)})")
    return found


def test_every_arrow_points_the_allowed_way() -> None:
    modules = project_modules()
    assert len(modules) > 30
    assert violations(modules) == []


def test_the_cli_and_the_launcher_know_both_sides() -> None:
    modules = project_modules()
    known = set(modules)
    seen = imports_of(modules["geoloco.cli"], "geoloco.cli", known) | imports_of(
        modules["geoloco.launch"], "geoloco.launch", known)
    assert {layer(m) for m in seen} >= {"geoloco.launch", *SIDES}


def cycles(modules: dict[str, Path]) -> list[list[str]]:
    """Import cycles among the modules (depth-first search; each cycle once)."""
    known = set(modules)
    graph = {m: sorted(imports_of(p, m, known) - {m}) for m, p in modules.items()}
    if "geoloco" in graph:
        graph["geoloco"] = [m for m in graph["geoloco"] if m not in ROOT_FACADE]
    found, state = [], {}

    def visit(m: str, stack: list[str]) -> None:
        state[m] = "open"
        for n in graph[m]:
            if state.get(n) == "open":
                found.append(stack[stack.index(n):] + [n])
            elif n not in state:
                visit(n, stack + [n])
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    return found


@pytest.mark.slow
def test_there_is_no_import_cycle() -> None:
    assert cycles(project_modules()) == []


def test_a_cycle_is_found(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text("from geoloco.coordinator import b\n")
    (tmp_path / "b.py").write_text("import typing\nif typing.TYPE_CHECKING:\n    from geoloco.coordinator import a\n")
    modules = {"geoloco.coordinator.a": tmp_path / "a.py", "geoloco.coordinator.b": tmp_path / "b.py"}
    assert cycles(modules) == [["geoloco.coordinator.a", "geoloco.coordinator.b", "geoloco.coordinator.a"]]


@pytest.mark.parametrize(("importer", "imported", "ok"), [
    ("geoloco.worker.loop", "geoloco.coordinator.rounds", False),
    ("geoloco.coordinator.service", "geoloco.worker.session", False),
    ("geoloco.config", "geoloco.worker.stragglers", False),
    ("geoloco.compression.format", "geoloco.config", False),
    ("geoloco.protos.geoloco_pb2_grpc", "geoloco.transport", False),
    ("geoloco.worker.loop", "geoloco.cli", False),
    ("geoloco.coordinator.app", "geoloco.launch", False),
    ("geoloco.worker.loop", "geoloco.compression", True),
    ("geoloco.coordinator.service", "geoloco.transport", True),
    ("geoloco.cli", "geoloco.coordinator.app", True),
    ("geoloco.cli", "geoloco.launch", True),
    ("geoloco.links.tc", "geoloco.profiles", True),
    ("geoloco", "geoloco.launch", True),
    ("geoloco", "geoloco.worker.app", True),
    ("geoloco", "geoloco.worker.loop", False),
    ("geoloco.tasks", "geoloco.launch", False),
])
def test_the_rules_catch_a_new_arrow(importer: str, imported: str, ok: bool) -> None:
    assert allowed(importer, imported) is ok


def test_a_bad_import_in_a_file_is_reported(tmp_path: Path) -> None:
    bad = tmp_path / "probe.py"
    bad.write_text("from . import trainer\n\ndef later():\n    from geoloco.coordinator.rounds import RoundState\n")
    modules = {"geoloco.worker.probe": bad, "geoloco.worker.trainer": ROOT / "worker" / "trainer.py",
               "geoloco.coordinator.rounds": ROOT / "coordinator" / "rounds.py"}
    assert violations(modules) == [
        "geoloco.worker.probe imports geoloco.coordinator.rounds (geoloco.worker -> geoloco.coordinator)"]


def test_the_root_facade_imports_only_inside_functions() -> None:
    """The root's re-exports stay lazy: ``import geoloco`` loads none of them."""
    tree = ast.parse((ROOT / "geoloco" / "__init__.py").read_text())
    top_level = {node.module for node in tree.body if isinstance(node, ast.ImportFrom)}
    top_level |= {a.name for node in tree.body if isinstance(node, ast.Import) for a in node.names}
    assert not {m for m in top_level if m and m.startswith("geoloco")}
