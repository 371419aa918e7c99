"""The run directory: its file names, defined once; the one rule for a used one, shared by
``geoloco local`` and ``geoloco coordinator`` (a folder holding a previous run's files is
continued only with ``--resume`` and replaced only with ``--overwrite``; anything else is
refused before a file is touched); and ``write_atomic``, the one way every geoloco process
writes a file (a reader sees the old file or the whole new one, POSIX rename(2))."""

from __future__ import annotations

import os
import re
import shutil
import threading
from collections.abc import Iterable
from pathlib import Path

from geoloco.config import ConfigError

# The run directory's names (docs/protocol.md, "Stopping and restarting").
CONFIG_FILE = "config.json"  # the run config the coordinator serves
METRICS_FILE = "metrics.jsonl"  # one line per round
SUMMARY_FILE = "summary.json"
REGISTRY_FILE = "registry.json"  # the worker registry, rewritten at every Join
CHECKPOINT_DIR = "checkpoints"
ROUNDLOG_DIR = "roundlog"  # the close decisions since the newest checkpoint (coordinator.roundlog)
TENSORBOARD_DIR = "tensorboard"
PORT_FILE = "coordinator.port"
METRICS_PORT_FILE = "metrics.port"
LOGS_DIR = "logs"  # geoloco local: one log per process
WORKERS_DIR = "workers"  # geoloco local: the workers' reports and join gates
WORKER_STATE_DIR = "worker-state"  # geoloco local: each worker's --state-dir, one folder each
CERTS_DIR = "certs"  # geoloco local: the run's CA, certificates and token

# What marks a folder as a run directory with a previous run in it.
PREVIOUS_RUN = (CONFIG_FILE, METRICS_FILE, SUMMARY_FILE, REGISTRY_FILE, CHECKPOINT_DIR,
                LOGS_DIR, WORKERS_DIR, WORKER_STATE_DIR)
# What the coordinator writes there, and so what its --overwrite removes.
COORDINATOR_OUTPUTS = (METRICS_FILE, SUMMARY_FILE, REGISTRY_FILE, CHECKPOINT_DIR, ROUNDLOG_DIR,
                       TENSORBOARD_DIR, PORT_FILE, METRICS_PORT_FILE)

# write_atomic's temporary file beside its target: .NAME.tmpPID-THREAD (what a killed write
# leaves, and so what remove_stale takes away)
STALE_TEMP = re.compile(r"^\..+\.tmp\d+(-\d+)?$")
DEFAULT_MODE = 0o666  # as open() creates a file, less the umask; secrets use 0o600


def worker_state_dir(run_dir: str | Path, index: int) -> Path:
    """The --state-dir ``geoloco local`` gives its ``index``-th worker process."""
    return Path(run_dir) / WORKER_STATE_DIR / f"worker-{index}"


def temp_path(path: Path) -> Path:
    """The temporary file write_atomic fills before renaming it to ``path``."""
    return path.with_name(f".{path.name}.tmp{os.getpid()}-{threading.get_native_id()}")


def write_atomic(path: str | Path, data: bytes | bytearray | memoryview | str,
                 mode: int = DEFAULT_MODE, durable: bool = True) -> Path:
    """Write ``data`` (text is UTF-8) to ``path`` through a temporary file beside it,
    created with ``mode`` (0o600: readable by its owner only, from the first byte), then
    renamed into place; the temporary file is created anew and never through a link, so
    a link planted at its name redirects nothing. ``durable``: the file is fsynced before the rename and its folder
    after, so the new file survives a power cut as well as a kill. A failed write removes
    the temporary file and raises the OSError; the old file, if any, is untouched."""
    path = Path(path)
    tmp = temp_path(path)
    payload = data.encode() if isinstance(data, str) else data
    tmp.unlink(missing_ok=True)  # left by a cut-off write of this pid (a link is removed, not followed)
    try:
        # made anew (O_EXCL), never through a link planted at its name (O_NOFOLLOW)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
        with os.fdopen(fd, "wb") as f:
            view, written = memoryview(payload), 0
            while written < len(view):
                written += f.write(view[written:])
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        fsync_path(path.parent)
    return path


def fsync_path(path: Path) -> None:
    """Make a file's bytes, or a folder's renames and new files, durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_stale_temps(folder: Path) -> list[Path]:
    """Remove what write_atomic calls killed before their rename left in ``folder``."""
    found = [p for p in Path(folder).glob(".*") if STALE_TEMP.match(p.name) and p.is_file()]
    for path in found:
        path.unlink(missing_ok=True)
    return found


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
