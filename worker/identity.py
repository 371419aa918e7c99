"""A worker's identity in its --state-dir, so that a restarted worker proves it is the same
worker and gets its slot back at once: its id and its session secret (the coordinator keeps
only the secret's sha256), one file per id, written 0600 through write_atomic, and held by
an flock(2) on a lock file beside it while its process runs (docs/protocol.md, "Stopping
and restarting"). A folder shared by several workers works too: a restarted process takes
the identity whose lock no running process holds."""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
from pathlib import Path

from geoloco.run_dir import write_atomic

log = logging.getLogger(__name__)

PRIVATE_MODE = 0o600  # the secret is the worker's own
_IDENTITY = re.compile(r"^worker-(\d+)\.identity\.json$")


def identity_path(state_dir: Path, worker_id: int) -> Path:
    return Path(state_dir) / f"worker-{worker_id}.identity.json"


def lock_path(state_dir: Path, worker_id: int) -> Path:
    return Path(state_dir) / f".worker-{worker_id}.lock"


class IdentityStore:
    """The identities saved in ``state_dir``; this process holds the lock of at most one."""

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = Path(state_dir)
        self.held: int | None = None  # the id whose lock this process holds
        self._fd: int | None = None

    def claim(self) -> tuple[int, str] | None:
        """The saved (id, session) of a worker process that is gone (no process holds its
        lock), now held by this one; None when there is none."""
        if not self.state_dir.is_dir():
            return None
        for path in sorted(self.state_dir.iterdir()):
            match = _IDENTITY.match(path.name)
            if match is None or not self._lock(int(match.group(1))):
                continue
            try:
                data = json.loads(path.read_text())
                return int(data["worker_id"]), str(data["session"])
            except (OSError, ValueError, KeyError, TypeError) as exc:
                log.warning("identity file %s is unreadable (%s); ignored", path, exc)
                self.release()
        return None

    def save(self, worker_id: int, session: str) -> None:
        """Keep ``worker_id`` and ``session`` (what the last Join gave) for a restart; a
        failed write is logged: the worker then waits for its slot like a new one."""
        self.state_dir.mkdir(parents=True, exist_ok=True)
        if self.held != worker_id:
            self.release()
            if not self._lock(worker_id):
                log.warning("another running process holds the identity of worker %d in %s",
                            worker_id, self.state_dir)
        try:
            write_atomic(identity_path(self.state_dir, worker_id),
                         json.dumps({"worker_id": worker_id, "session": session}) + "\n",
                         mode=PRIVATE_MODE)
        except OSError as exc:
            log.error("identity of worker %d not saved in %s (%s)", worker_id, self.state_dir,
                      exc.strerror or exc)

    def forget(self, worker_id: int) -> None:
        """The coordinator no longer knows this identity (its slot went to another worker,
        or this is another run): remove it."""
        identity_path(self.state_dir, worker_id).unlink(missing_ok=True)
        if self.held == worker_id:
            self.release()

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # the lock goes with the descriptor
        self._fd = self.held = None

    def _lock(self, worker_id: int) -> bool:
        fd = os.open(lock_path(self.state_dir, worker_id), os.O_RDWR | os.O_CREAT, PRIVATE_MODE)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            return False
        self.release()
        self._fd, self.held = fd, worker_id
        return True
