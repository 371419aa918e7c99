"""The run directory's one rule, shared by ``geoloco local`` and ``geoloco coordinator``:
a folder holding a previous run's files is continued only with ``--resume`` and replaced
only with ``--overwrite``; anything else is refused before a file is touched."""

from __future__ import annotations

import shutil
from collections.abc import Iterable
from pathlib import Path

from geoloco.config import ConfigError

# What marks a folder as a run directory with a previous run in it.
PREVIOUS_RUN = ("config.json", "metrics.jsonl", "summary.json", "registry.json", "checkpoints",
                "logs", "workers")
# What the coordinator writes there, and so what its --overwrite removes.
COORDINATOR_OUTPUTS = ("metrics.jsonl", "summary.json", "registry.json", "checkpoints",
                       "tensorboard", "coordinator.port", "metrics.port")


def previous_run(run_dir: Path) -> list[str]:
    """The names in ``run_dir`` that a previous run left (an empty folder is no sign)."""
    found = []
    for name in PREVIOUS_RUN:
        path = run_dir / name
        if path.is_file() or (path.is_dir() and any(path.iterdir())):
            found.append(name)
    return found


def claim_run_dir(run_dir: str | Path, resume: bool, overwrite: bool,
                  outputs: Iterable[str] = COORDINATOR_OUTPUTS) -> Path:
    """Check ``run_dir`` against the rule and create it; with ``overwrite``, first remove
    ``outputs`` (what this command writes there). ConfigError names the way out."""
    path = Path(run_dir)
    if resume and overwrite:
        raise ConfigError("--resume and --overwrite exclude each other: continue the run in "
                          f"{path}, or replace it")
    if path.exists() and not path.is_dir():
        raise ConfigError(f"run_dir: {str(path)!r} exists and is not a directory")
    found = previous_run(path) if path.is_dir() else []
    if found and not (resume or overwrite):
        raise ConfigError(f"run_dir: {str(path)!r} holds a previous run ({', '.join(found)}); "
                          "give --resume to continue it, --overwrite to replace it, or another "
                          "--run-dir")
    if overwrite:
        for name in outputs:
            target = path / name
            if target.is_dir() and not target.is_symlink():
                shutil.rmtree(target)
            else:
                target.unlink(missing_ok=True)
    path.mkdir(parents=True, exist_ok=True)
    return path
