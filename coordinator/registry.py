"""The coordinator's worker registry: token check at Join, ids and session secrets, reclaim
after a reconnect or a coordinator restart (docs/protocol.md, "A worker's life")."""

from __future__ import annotations

import hmac
import secrets
from dataclasses import dataclass
from typing import Any


class RegistryError(Exception):
    """A Join or a call the registry refuses; ``code`` is the gRPC status name to use."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class WorkerRecord:
    worker_id: int
    session: str
    hostname: str = ""
    device: str = ""
    live: bool = False  # joined (or reclaimed) since this coordinator process started
    state_fetches: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {"session": self.session, "hostname": self.hostname, "device": self.device}


class WorkerRegistry:
    """Worker slots 0..n-1; not thread-safe (the coordinator holds its lock around it)."""

    def __init__(self, n: int, token: str) -> None:
        self.n = n
        self._token = token.encode()
        self.records: dict[int, WorkerRecord] = {}

    def join(self, token: str, hostname: str, device: str, reclaim_id: int | None,
             reclaim_session: str) -> WorkerRecord:
        """Check the token, then reclaim the given id or hand out the lowest free one."""
        if not hmac.compare_digest(token.encode(), self._token):
            raise RegistryError(
                "PERMISSION_DENIED",
                "wrong token: the run's token (coordinator.token) does not match; "
                "start the worker with the coordinator's token",
            )
        if reclaim_id is not None:
            record = self.authenticate(reclaim_id, reclaim_session)
        else:
            record = self._new_record()
        record.hostname, record.device, record.live = hostname, device, True
        return record

    def authenticate(self, worker_id: int, session: str) -> WorkerRecord:
        """The record of ``worker_id`` if ``session`` is its secret, else RegistryError."""
        record = self.records.get(worker_id)
        if record is None:
            raise RegistryError(
                "UNAUTHENTICATED",
                f"unknown worker {worker_id}: join first (known ids: {sorted(self.records)})",
            )
        if not hmac.compare_digest(session.encode(), record.session.encode()):
            raise RegistryError(
                "UNAUTHENTICATED",
                f"bad session for worker {worker_id}: join again without reclaim_worker_id",
            )
        return record

    def _new_record(self) -> WorkerRecord:
        free = [i for i in range(self.n) if i not in self.records]
        if not free:
            raise RegistryError(
                "RESOURCE_EXHAUSTED",
                f"all {self.n} worker slots are taken; a restarted worker must reclaim its id "
                "(reclaim_worker_id + reclaim_session), or raise `workers` in the run config",
            )
        record = WorkerRecord(free[0], secrets.token_hex(16))
        self.records[record.worker_id] = record
        return record

    @property
    def live_count(self) -> int:
        return sum(r.live for r in self.records.values())

    def to_dict(self) -> dict[int, dict[str, Any]]:
        return {i: r.to_dict() for i, r in self.records.items()}

    def load_dict(self, data: dict[int, dict[str, Any]]) -> None:
        """Restore ids and sessions from a checkpoint; nobody is live until they reclaim."""
        self.records = {
            int(i): WorkerRecord(int(i), d["session"], d.get("hostname", ""), d.get("device", ""))
            for i, d in data.items()
        }
