"""The coordinator's worker registry: token check at Join, ids and session secrets (kept
only as hashes, and bound to the certificate a worker joined with), reclaim after a
reconnect or a coordinator restart (docs/protocol.md, "A worker's life")."""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from dataclasses import dataclass, field
from typing import Any

CERT_NAME = re.compile(r"worker-(\d{1,9})")  # the common name `geoloco certs` gives worker i


def slot_of_name(name: str | None) -> int | None:
    """The slot a certificate's common name binds (``worker-3``: 3); None for another name."""
    match = CERT_NAME.fullmatch(name or "")
    return int(match.group(1)) if match else None


class RegistryError(Exception):
    """A Join or a call the registry refuses; ``code`` is the gRPC status name to use."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def session_hash(session: str) -> str:
    return hashlib.sha256(session.encode()).hexdigest()


@dataclass
class WorkerRecord:
    worker_id: int
    session_hash: str  # sha256 of the session secret; the secret itself is not kept
    hostname: str = ""
    device: str = ""
    live: bool = False  # joined (or reclaimed) since this coordinator process started
    # joined (or reclaimed) in this process, dead or not: a call from a worker that has not
    # is refused, so that it joins again (its channel reconnected to a resumed coordinator
    # on its own, and it would go on from a round the resumed run has not reached)
    joined: bool = False
    dead: bool = False  # its Rounds stream was gone for coordinator.liveness_s: the slot is free
    state_fetches: int = 0
    cert: str | None = None  # sha256 of the certificate it joined with (mutual TLS)
    session: str = field(default="", repr=False)  # the secret, only for the Join reply

    def to_dict(self) -> dict[str, Any]:
        return {"session_sha256": self.session_hash, "cert_sha256": self.cert,
                "hostname": self.hostname, "device": self.device}


class WorkerRegistry:
    """Worker slots 0..n-1; not thread-safe (the coordinator holds its lock around it)."""

    def __init__(self, n: int, token: str, worker_tokens: dict[int, str] | None = None) -> None:
        self.n = n
        self._token = token.encode()
        # coordinator.worker_tokens_file: worker i's own token, which binds slot i; with
        # them the shared token admits nobody
        self._worker_tokens = {i: t.encode() for i, t in (worker_tokens or {}).items()}
        self.records: dict[int, WorkerRecord] = {}

    def join(self, token: str, hostname: str, device: str, reclaim_id: int | None,
             reclaim_session: str, cert: str | None = None, *,
             cert_slot: int | None = None) -> WorkerRecord:
        """Check the token, then reclaim the given id or hand out the lowest free one;
        ``cert``: the caller's certificate, which the id's later calls must present too;
        ``cert_slot``: the slot its name binds (`slot_of_name`). A certificate holds one
        slot at most: a second Join over it gets the same slot with a new session."""
        if not self.token_matches(token):
            raise RegistryError(
                "PERMISSION_DENIED",
                "wrong token: the run's token (coordinator.token) does not match; "
                "start the worker with the coordinator's token",
            )
        token_slot = self.token_slot(token)
        if token_slot is not None:  # a per-worker token: its slot, whatever else is asked
            for asked, what in ((cert_slot, "certificate's name"), (reclaim_id, "reclaimed id")):
                if asked is not None and asked != token_slot:
                    raise RegistryError("PERMISSION_DENIED", f"this token is worker {token_slot}'s, but the "
                                        f"{what} is worker {asked}")
            cert_slot = token_slot
        if reclaim_id is not None:
            record = self.authenticate(reclaim_id, reclaim_session, cert)
            record.session = reclaim_session
        else:
            record = (self._record_of_certificate(cert) or self._record_of_token(token_slot, cert)
                      or self._new_record(cert_slot))
        record.hostname, record.device, record.live, record.dead = hostname, device, True, False
        record.cert, record.joined = record.cert or cert, True
        return record

    def token_matches(self, token: str) -> bool:
        """Whether ``token`` admits a worker (constant time): the run's token, or with
        per-worker tokens one of them."""
        if self._worker_tokens:
            return self.token_slot(token) is not None
        return hmac.compare_digest(token.encode(), self._token)

    def token_slot(self, token: str) -> int | None:
        """The slot whose per-worker token ``token`` is (every token compared, in constant
        time each), else None."""
        given, found = token.encode(), None
        for i, t in self._worker_tokens.items():
            if hmac.compare_digest(given, t):
                found = i
        return found

    def authenticate(self, worker_id: int, session: str, cert: str | None = None) -> WorkerRecord:
        """The record of ``worker_id`` if ``session`` is its secret and, once the worker
        joined with a certificate, ``cert`` is that certificate; else RegistryError."""
        record = self.records.get(worker_id)
        if record is None:
            raise RegistryError(
                "UNAUTHENTICATED",
                f"unknown worker {worker_id}: join first",
            )
        if not hmac.compare_digest(session_hash(session), record.session_hash):
            raise RegistryError(
                "UNAUTHENTICATED",
                f"bad session for worker {worker_id}: join again without reclaim_worker_id",
            )
        if record.cert is not None and cert != record.cert:
            raise RegistryError(
                "UNAUTHENTICATED",
                f"the session of worker {worker_id} was presented over another certificate than "
                "the one it joined with",
            )
        return record

    def _record_of_certificate(self, cert: str | None) -> WorkerRecord | None:
        """The slot bound to ``cert``, with a new session (the old one no longer counts):
        under mutual TLS the certificate is the worker's identity, as the session is, and
        it holds one slot at most."""
        record = next((r for r in self.records.values() if cert and r.cert == cert and not r.dead), None)
        if record is not None:
            record.session = secrets.token_hex(16)
            record.session_hash = session_hash(record.session)
        return record

    def _record_of_token(self, slot: int | None, cert: str | None) -> WorkerRecord | None:
        """With a per-worker token, the slot it binds if a worker holds it, with a new
        session (the old one no longer counts): the token is that worker's identity, and
        it holds one slot. Under mutual TLS the slot's certificate must be the caller's."""
        record = self.records.get(slot) if slot is not None else None
        if record is None or record.dead:
            return None
        if record.cert is not None and record.cert != cert:
            raise RegistryError("PERMISSION_DENIED", f"worker {slot} joined with another certificate; "
                                "its token alone does not take the slot from it")
        record.session = secrets.token_hex(16)
        record.session_hash = session_hash(record.session)
        return record

    def _new_record(self, slot: int | None = None) -> WorkerRecord:
        """A free slot, else the lowest dead one (a replacement takes its id and so its
        partitions; the dead worker's session and certificate no longer count); ``slot``:
        that slot only (a certificate's name binds it), unless another live worker holds it."""
        if slot is not None:
            free = self._bound_slot(slot)
        else:
            free = [i for i in range(self.n) if i not in self.records]
            free += [i for i, r in sorted(self.records.items()) if r.dead]
        if not free:
            raise RegistryError(
                "RESOURCE_EXHAUSTED",
                f"all {self.n} worker slots are taken; a restarted worker must reclaim its id "
                "(reclaim_worker_id + reclaim_session), a new one waits until a worker has been "
                "gone coordinator.liveness_s, or raise `workers` in the run config",
            )
        session = secrets.token_hex(16)
        record = WorkerRecord(free[0], session_hash(session), session=session)
        self.records[record.worker_id] = record
        return record

    def _bound_slot(self, slot: int) -> list[int]:
        if slot >= self.n:
            raise RegistryError("PERMISSION_DENIED", f"this certificate is for worker {slot}, but the "
                                f"run has {self.n} worker slots (0..{self.n - 1})")
        held = self.records.get(slot)
        if held is not None and held.live:
            raise RegistryError("RESOURCE_EXHAUSTED", f"slot {slot}, which this certificate's name "
                                "binds, is held by another certificate's worker; it is free once that "
                                "worker has been gone coordinator.liveness_s")
        return [slot]

    def mark_dead(self, worker_id: int) -> None:
        """The worker is gone: nobody waits for it, and a new worker may take its slot."""
        record = self.records[worker_id]
        record.live, record.dead = False, True

    @property
    def live_count(self) -> int:
        return sum(r.live for r in self.records.values())

    def to_dict(self) -> dict[int, dict[str, Any]]:
        return {i: r.to_dict() for i, r in self.records.items()}

    def load_dict(self, data: dict[int, dict[str, Any]]) -> None:
        """Restore ids, session hashes and certificates from a checkpoint (an older one
        with the sessions in clear is hashed); nobody is live until they reclaim."""
        self.records = {
            int(i): WorkerRecord(int(i), d.get("session_sha256") or session_hash(d["session"]),
                                 d.get("hostname", ""), d.get("device", ""), cert=d.get("cert_sha256"))
            for i, d in data.items()
        }
