"""The run directory: its file names, defined once; the one rule for a used one, shared by
``geoloco local``, ``geoloco coordinator`` and the Python API (a run is recognised only by
the marker ``geoloco-run.json`` that GeoLoCo writes when a run claims the folder; a marked
folder is continued only with ``resume`` and replaced only with ``overwrite``, which removes
only what GeoLoCo wrote; a folder GeoLoCo did not mark that holds its file names is never
written over; all of it decided before a file is touched); the default ``runs/latest``, a
link to a new timestamped folder per run; and ``write_atomic``, the one way every geoloco
process writes a file (a reader sees the old file or the whole new one, POSIX rename(2))."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from geoloco.config import DEFAULT_RUN_DIR, ConfigError

log = logging.getLogger(__name__)

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

MARKER_FILE = "geoloco-run.json"  # written when a run claims the folder: what makes it a run
MARKER_KIND = "geoloco run directory"
MARKER_VERSION = 1
# What the coordinator writes there.
COORDINATOR_WRITES = (CONFIG_FILE, METRICS_FILE, SUMMARY_FILE, REGISTRY_FILE, CHECKPOINT_DIR,
                      ROUNDLOG_DIR, TENSORBOARD_DIR, PORT_FILE, METRICS_PORT_FILE)
# What `geoloco local` writes there: the coordinator's files and its own.
LOCAL_WRITES = (*COORDINATOR_WRITES, LOGS_DIR, WORKERS_DIR, WORKER_STATE_DIR, CERTS_DIR)
# The names GeoLoCo writes at a run dir's root: in a folder without the marker, any of them
# (a file, or a folder with something in it) means the folder is someone else's.
KNOWN_NAMES = LOCAL_WRITES
# Inside GeoLoCo's folders, the names GeoLoCo gives what it writes: overwrite removes these
# and leaves anything else (and then the folder) where it is.
OWN_ENTRIES = {
    CHECKPOINT_DIR: re.compile(r"^round_\d{8}(\.pt)?(\.(tmp|old)\d+)?$"),
    ROUNDLOG_DIR: re.compile(r"^round_\d{8}\.(json|frames|[0-9a-f]{64}\.frame)$"),
    TENSORBOARD_DIR: re.compile(r"^events\.out\.tfevents\..+$"),
    LOGS_DIR: re.compile(r"^(coordinator|warmup|worker-\d+)\.log$"),
    WORKERS_DIR: re.compile(r"^(gate-\d+|worker-\d+\.json)$"),
    WORKER_STATE_DIR: re.compile(r"^worker-\d+$"),
    CERTS_DIR: re.compile(r"^(ca\.(pem|key)|coordinator\.(pem|key)|token|worker-tokens|"
                          r"worker-\d+\.(pem|key|token))$"),
}
NEW_RUN_NAME = "%Y%m%d-%H%M%S"  # the default's new folder per run, beside runs/latest
# The API's words in RunDirError messages, and the CLI's for them (cli_wording).
CLI_WORDS = {"resume_or_start=True": "--resume-or-start", "resume=True": "--resume",
             "overwrite=True": "--overwrite", "another run_dir": "another --run-dir"}

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
    renamed into place (``open_atomic``). A failed write removes the temporary file and
    raises the OSError; the old file, if any, is untouched."""
    payload = data.encode() if isinstance(data, str) else data
    with open_atomic(path, mode, durable) as f:
        view, written = memoryview(payload), 0
        while written < len(view):
            written += f.write(view[written:])
    return Path(path)


@contextlib.contextmanager
def open_atomic(path: str | Path, mode: int = DEFAULT_MODE, durable: bool = True) -> Iterator[BinaryIO]:
    """A binary file to write ``path``'s new content into, streamed (torch.save, say):
    a temporary file beside ``path``, created anew with ``mode`` and never through a link
    (a link planted at its name redirects nothing), renamed into place when the block ends.
    ``durable``: the file is fsynced before the rename and its folder after, so the new
    file survives a power cut as well as a kill. An exception in the block or an OSError
    removes the temporary file and propagates; the old file, if any, is untouched."""
    path = Path(path)
    tmp = temp_path(path)
    tmp.unlink(missing_ok=True)  # left by a cut-off write of this pid (a link is removed, not followed)
    try:
        # made anew (O_EXCL), never through a link planted at its name (O_NOFOLLOW)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        fsync_path(path.parent)


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


class RunDirError(ConfigError):
    """A run dir that may not be used as asked; the message names the way out in the API's
    words (``resume=True``, ``overwrite=True``); the CLI says them as flags (cli_wording)."""


def cli_wording(message: str) -> str:
    """A RunDirError's message with the CLI's flags for the API's arguments."""
    for api, flag in CLI_WORDS.items():
        message = message.replace(api, flag)
    return message


@dataclass(frozen=True)
class RunDirPlan:
    """What claim_run_dir will do, decided by plan_run_dir before anything is written:
    ``path`` (None: a new timestamped folder in ``parent``), whether the run there is
    continued (``resume``) or GeoLoCo's files in it are removed first (``overwrite``), and
    the ``link`` to point at the folder once it is made (the default runs/latest)."""

    path: Path | None
    resume: bool = False
    overwrite: bool = False
    parent: Path | None = None
    link: Path | None = None


def is_run(run_dir: Path) -> bool:
    """Whether GeoLoCo marked ``run_dir`` as a run's (its MARKER_FILE)."""
    return (Path(run_dir) / MARKER_FILE).is_file()


def foreign_names(run_dir: Path) -> list[str]:
    """GeoLoCo's names that a folder holds (a file, or a folder with something in it); in a
    folder without the marker they are someone else's files."""
    found = []
    for name in KNOWN_NAMES:
        path = Path(run_dir) / name
        if path.is_symlink() or path.is_file() or (path.is_dir() and any(path.iterdir())):
            found.append(name)
    return found


def plan_run_dir(run_dir: str | Path, resume: bool = False, overwrite: bool = False,
                 resume_or_start: bool = False) -> RunDirPlan:
    """Check ``run_dir`` against the rule, writing nothing; RunDirError names the way out.

    - a marked run: refused, unless ``resume`` (continue it), ``resume_or_start``, or
      ``overwrite`` (remove what GeoLoCo wrote there, then start);
    - a folder without the marker that holds GeoLoCo's names (foreign_names): refused
      whatever the arguments, and nothing in it is touched;
    - anything else (missing, empty, other files only): a new run starts there; ``resume``
      refuses it (nothing to resume), ``resume_or_start`` starts.
    The default ``runs/latest``: a resume continues the link's target; a new run gets a new
    folder beside it (runs/YYYYmmdd-HHMMSS) and the link is moved to it."""
    if sum((resume, overwrite, resume_or_start)) > 1:
        raise RunDirError("resume=True, overwrite=True and resume_or_start=True exclude each "
                          f"other: continue the run in {str(run_dir)!r}, replace it, or continue it "
                          "only if there is one")
    path = Path(run_dir)
    # (a real folder there, from before the link: resumed as it is; a new run goes beside it)
    if path == Path(DEFAULT_RUN_DIR) and (path.is_symlink() or not path.exists()
                                          or not (resume or resume_or_start)):
        return _plan_latest(path, resume, resume_or_start)
    if path.exists() and not path.is_dir():
        raise RunDirError(f"run_dir: {str(path)!r} exists and is not a directory")
    if path.is_dir() and is_run(path):
        if resume or resume_or_start:
            return RunDirPlan(path, resume=True)
        if overwrite:
            return RunDirPlan(path, overwrite=True)
        raise RunDirError(f"run_dir: {str(path)!r} holds a GeoLoCo run ({MARKER_FILE}); give "
                          "resume=True to continue it, overwrite=True to replace it (only the "
                          "files GeoLoCo wrote go), or another run_dir")
    foreign = foreign_names(path) if path.is_dir() else []
    if foreign:
        raise RunDirError(f"run_dir: {str(path)!r} holds {', '.join(foreign)} but no {MARKER_FILE}: "
                          "these files are not a GeoLoCo run's, so GeoLoCo neither resumes, writes "
                          "over nor deletes them (not even with overwrite=True); give another "
                          "run_dir (a new or empty folder)")
    if resume:
        raise RunDirError(f"run_dir: nothing to resume in {str(path)!r}: "
                          + ("it does not exist" if not path.exists() else f"it holds no {MARKER_FILE}")
                          + "; check the path, or start a run there without resume=True "
                          "(resume_or_start=True: resume a run if there is one, else start)")
    return RunDirPlan(path)


def _plan_latest(link: Path, resume: bool, resume_or_start: bool) -> RunDirPlan:
    """The default run dir, a link to the newest run (absent before the first)."""
    if link.is_symlink():
        target = link.resolve()
        if (resume or resume_or_start) and target.is_dir() and is_run(target):
            return RunDirPlan(target, resume=True)
        if resume:
            raise RunDirError(f"run_dir: nothing to resume: {link} points to {str(target)!r}, "
                              f"which holds no GeoLoCo run ({MARKER_FILE}); give run_dir the run "
                              "to resume")
    elif resume:
        raise RunDirError(f"run_dir: nothing to resume: {link} does not exist (no run used the "
                          "default run dir yet); give run_dir the run to resume")
    return RunDirPlan(None, parent=link.parent, link=link)


def claim_run_dir(plan: RunDirPlan, writes: Iterable[str] = COORDINATOR_WRITES) -> Path:
    """Do what ``plan`` says: make the folder (a new timestamped one for the default, and
    move the link to it), remove GeoLoCo's files for an overwrite, and write the marker
    listing ``writes`` (a resume adds them to the run's). Returns the run dir."""
    if plan.path is None:
        path = new_run_folder(plan.parent or Path(DEFAULT_RUN_DIR).parent)
    else:
        path = plan.path
        path.mkdir(parents=True, exist_ok=True)
    before = read_marker(path)
    if plan.overwrite:
        for kept in remove_run_files(path, before.get("writes", [])):
            log.warning("overwrite: kept %s, which GeoLoCo did not write", kept)
    listed = set(writes) | (set(before.get("writes", [])) & set(KNOWN_NAMES) if plan.resume else set())
    marker = {"kind": MARKER_KIND, "version": MARKER_VERSION,
              "created": before.get("created") if plan.resume and before.get("created") else _now(),
              "writes": sorted(listed)}
    write_atomic(path / MARKER_FILE, json.dumps(marker, indent=2, sort_keys=True) + "\n")
    if plan.link is not None:
        point_link(plan.link, path)
    return path


def read_marker(run_dir: Path) -> dict[str, Any]:
    """The marker's fields ({} when there is none, or it cannot be read)."""
    try:
        data = json.loads((Path(run_dir) / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def remove_run_files(run_dir: Path, listed: Iterable[str]) -> list[Path]:
    """Remove what GeoLoCo wrote in a marked ``run_dir``: of the names its marker ``listed``
    (only those GeoLoCo knows), a file, or in a folder the entries GeoLoCo names so
    (OWN_ENTRIES) and then the folder once empty. Returns what was kept."""
    kept = []
    for name in sorted(set(listed) & set(KNOWN_NAMES)):
        target = Path(run_dir) / name
        if target.is_symlink() or target.is_file():
            target.unlink()
        elif target.is_dir():
            kept += _remove_own_entries(target, OWN_ENTRIES.get(name))
    return kept


def _remove_own_entries(folder: Path, own: re.Pattern[str] | None) -> list[Path]:
    kept = []
    for entry in sorted(folder.iterdir()):
        if own is None or not (own.match(entry.name) or STALE_TEMP.match(entry.name)):
            kept.append(entry)
        elif entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()
    if not kept:
        folder.rmdir()
    return kept


def new_run_folder(parent: Path) -> Path:
    """A new folder in ``parent`` named after the time (NEW_RUN_NAME), made here and by no
    other process (mkdir fails on a name taken: -2, -3, ... follow within one second)."""
    parent.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime(NEW_RUN_NAME)
    for n in range(1, 10_000):
        path = parent / (stamp if n == 1 else f"{stamp}-{n}")
        try:
            path.mkdir()
        except FileExistsError:
            continue
        return path
    raise RunDirError(f"run_dir: no free name for a new run in {parent} ({stamp}-N)")


def point_link(link: Path, target: Path) -> None:
    """Point ``link`` at ``target`` (relative, so the folder can move) in one rename: a reader
    sees the old link or the new one. A real folder at ``link`` is left as it is."""
    if link.exists() and not link.is_symlink():
        log.warning("%s is a folder, not the link to the newest run: left as it is", link)
        return
    tmp = temp_path(link)
    tmp.unlink(missing_ok=True)
    os.symlink(os.path.relpath(target, link.parent), tmp)
    os.replace(tmp, link)


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")
