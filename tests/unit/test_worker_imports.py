"""The worker's import arrows (docs/architecture.md): geoloco.worker uses the codec, the
protos and the shared modules, never the coordinator nor the entry points that know both
sides (geoloco.cli, geoloco.launch)."""

from __future__ import annotations

import ast
from pathlib import Path

WORKER = Path(__file__).resolve().parents[2] / "worker"
ALLOWED = ("geoloco.compression", "geoloco.protos", "geoloco.config", "geoloco.tasks",
           "geoloco.profiles", "geoloco.transport", "geoloco.tls", "geoloco.replica", "geoloco.links",
           "geoloco.schedule", "geoloco.metrics_server", "geoloco.stopping", "geoloco.run_dir", "geoloco.worker")
ROOT_NAMES = {"__version__"}  # what the worker may take from the geoloco package itself


def project_imports(path: Path) -> set[str]:
    """Every geoloco module a file imports, at any depth (``from geoloco import x`` names
    ``geoloco.x`` unless x is a plain attribute of the package such as ``__version__``)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "geoloco"}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "geoloco":
                found |= {f"geoloco.{a.name}" for a in node.names if a.name not in ROOT_NAMES}
            elif node.module.split(".")[0] == "geoloco":
                found.add(node.module)
    return found


def test_worker_imports_only_the_codec_protos_and_shared_modules() -> None:
    # __main__.py is `python -m geoloco.worker`: an entry point onto `geoloco worker` (test_layers)
    files = sorted(p for p in WORKER.glob("*.py") if p.name != "__main__.py")
    assert len(files) > 5
    wrong = {f"{p.name}: {m}" for p in files for m in project_imports(p)
             if not any(m == a or m.startswith(a + ".") for a in ALLOWED)}
    assert not wrong, sorted(wrong)


def test_the_arrow_check_sees_a_forbidden_import(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from geoloco.coordinator.server import Coordinator\n"
                   "from geoloco import cli, __version__\n")
    assert project_imports(bad) == {"geoloco.coordinator.server", "geoloco.cli"}
