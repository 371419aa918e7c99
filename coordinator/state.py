"""What the round loop and the gRPC servicer share on the coordinator: the parameters, the
worker registry, the current round, the held round results and the Rounds streams' queues,
behind one lock (round protocol: docs/protocol.md)."""

from __future__ import annotations

import dataclasses
import json
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import Tensor

from geoloco.compression import Layout
from geoloco.compression.frame import encode_dense_buffer
from geoloco.coordinator.metrics import ClosePhases, RunTotals
from geoloco.coordinator.outer import Update, apply_update
from geoloco.coordinator.registry import RegistryError, WorkerRecord, WorkerRegistry
from geoloco.coordinator.roundlog import FrameSpool
from geoloco.coordinator.rounds import Arrival, ClosedRound, ClosePolicy, RoundError, RoundState
from geoloco.replica import DigestAsApplied, param_digest
from geoloco.run_dir import write_atomic

log = logging.getLogger(__name__)

HISTORY_ROUNDS = 8  # closed rounds kept for Rounds streams that reconnect behind
HISTORY_BYTES = 256 << 20  # ... and at most this many frame bytes of them (dense DiLoCo)
JOIN_POLL_S = 0.5  # how often a wait re-checks its timeout
FINISH_POLL_S = 0.1
CLOSE_POLL_S = 0.05  # an open round re-asks its policy this often: a quorum's grace window ends on time

Subscription = queue.Queue  # of ClosedRound, or None: the stream is to end


class StateSnapshot(NamedTuple):
    """The parameters at the start of ``round`` as one dense fp32 frame, with their digest."""

    round: int
    digest: str
    data: bytes | bytearray  # written in place (compression.frame.encode_dense_buffer), then only read


class Overview(NamedTuple):
    """What a monitor reads of the state at any moment (no secrets): the open round, when
    it opened (monotonic; None before it opens), its frames in so far, the rounds done, the
    live workers, those following the Rounds stream, and each worker's FetchState calls."""

    round: int
    opened_at: float | None
    arrived: int
    rounds_done: int
    initial_val_loss: float | None
    live: list[int]
    following: list[int]
    state_fetches: dict[int, int]


class CoordinatorState:
    """The coordinator's shared state; every method is thread-safe.

    ``lock`` guards the registry, the round state, the history and the subscribers;
    a second lock keeps FetchState off the parameters while a round is published and
    applied, so a snapshot is always one round's parameters with its digest.
    """

    def __init__(self, layout: Layout, params: list[Tensor], registry: WorkerRegistry,
                 totals: RunTotals, rs: RoundState, registry_file: Path | None = None,
                 liveness_s: float = 60.0, spool: FrameSpool | None = None) -> None:
        self.layout = layout
        self.registry_file = registry_file  # the registry, rewritten when a Join changes it
        self.liveness_s = liveness_s
        self.spool = spool  # the round log's frames, written as they are accepted
        # worker -> since when it has no Rounds stream (joined, restored from a checkpoint,
        # or its stream ended); gone liveness_s, it is marked dead
        self.unfollowed_since = dict.fromkeys(registry.records, time.monotonic())
        self.params = params
        self.registry = registry
        self.totals = totals
        self.rs = rs
        self.lock = threading.Condition()
        self.history: deque[ClosedRound] = deque(maxlen=HISTORY_ROUNDS)
        self.subscribers: dict[int, Subscription] = {}
        self.ready: set[int] = set()  # fetched the state or follow Rounds (this process)
        # workers whose Rounds stream ended and that have not followed since: their process
        # or connection is gone, so no round waits for them (liveness_s later they are dead)
        self.stream_lost: set[int] = set()
        self.delivered_finish: set[int] = set()
        self.stopping = False
        self._params_lock = threading.Lock()
        self._snapshot: StateSnapshot | None = None  # shared by the FetchState calls sending it
        self._snapshot_users = 0
        self._registry_write = threading.Lock()  # one registry.json write at a time
        self._registry_version = 0
        self._registry_written: tuple[int, dict[int, dict[str, Any]] | None] = (0, None)

    # ----- what the servicer calls ---------------------------------------------------

    def token_matches(self, token: str) -> bool:
        """Whether ``token`` is the run's token (the token never changes: no lock)."""
        return self.registry.token_matches(token)

    def join(self, token: str, hostname: str, device: str, reclaim_id: int | None,
             reclaim_session: str, cert: str | None = None, *,
             cert_slot: int | None = None) -> tuple[WorkerRecord, int]:
        """Register (or reclaim) a worker; returns a copy of its record holding the session
        secret for the reply (the registry keeps only its hash) and the current round, once
        the registry is saved (off the lock)."""
        with self.lock:
            self.check_liveness()
            record = self.registry.join(token, hostname, device, reclaim_id, reclaim_session, cert,
                                        cert_slot=cert_slot)
            self.unfollowed_since[record.worker_id] = time.monotonic()
            reply = dataclasses.replace(record)  # the one copy that holds the session secret:
            record.session = ""  # the registry keeps its hash only
            self._registry_version += 1
            saved = self._registry_version, self.registry.to_dict()
            self.lock.notify_all()
            current = self.rs.round
        self.save_registry(*saved)
        return reply, current

    def save_registry(self, version: int, workers: dict[int, dict[str, Any]]) -> None:
        """The registry as of ``version`` to ``registry_file``, durably (a coordinator killed
        right after a Join still knows the worker when it resumes), unless a newer version
        is written already or the file holds these very records; the state lock is not held."""
        if self.registry_file is None:
            return
        with self._registry_write:
            if version <= self._registry_written[0] or workers == self._registry_written[1]:
                return
            try:
                records = {str(i): d for i, d in workers.items()}
                write_atomic(self.registry_file, json.dumps(records, indent=2, sort_keys=True) + "\n")
            except OSError as exc:
                log.error("worker registry not saved to %s (%s); the next Join tries again",
                          self.registry_file, exc.strerror or exc)
                return
            self._registry_written = version, workers

    def authenticate(self, worker_id: int, session: str, cert: str | None = None) -> WorkerRecord:
        """The caller's record (registry.authenticate). A worker that has not joined this
        coordinator process is told UNAVAILABLE, so that it joins again: after a --resume
        its gRPC channel reconnects on its own, and its session, restored from
        registry.json, is still good, but the run went back to the checkpoint's round."""
        with self.lock:
            record = self.registry.authenticate(worker_id, session, cert)
            if not record.joined:
                raise RegistryError("UNAVAILABLE", f"worker {worker_id}: this coordinator was "
                                    "restarted since your Join; join again (reclaim_worker_id)")
            return record

    @property
    def snapshot_users(self) -> int:
        """FetchState calls sending the state frame now."""
        with self.lock:
            return self._snapshot_users

    @contextmanager
    def snapshot(self, record: WorkerRecord) -> Iterator[StateSnapshot]:
        """The parameters at the current round's start as one dense frame, while the block
        sends it (the worker counts as ready). FetchState calls at once share one (every
        worker fetches at round 0); the last to end lets it go, since it is a model's size
        and a later fetch is of a later round."""
        with self.lock:
            record.state_fetches += 1
            self.ready.add(record.worker_id)
            self.lock.notify_all()
            if record.state_fetches > 1:
                self.totals.extra_state_fetches += 1
        with self._params_lock:
            round = self.rs.round
            snap = self._snapshot
            if snap is None or snap.round != round:
                data = encode_dense_buffer(self.layout, self.params, round=round, sender=0, dtype="fp32")
                snap = self._snapshot = StateSnapshot(round, self.digest(), data)
        with self.lock:
            self._snapshot_users += 1
        try:
            yield snap
        finally:
            with self.lock:
                self._snapshot_users -= 1
                if not self._snapshot_users:
                    self._snapshot = None

    def check_push(self, worker: int, round: int) -> None:
        """RoundError (counted) if ``worker`` may not push for ``round`` now."""
        with self.lock:
            try:
                self.rs.check_push(worker, round)
            except RoundError:
                self.rs.count_refused(round, worker)
                raise

    def accept(self, arrival: Arrival) -> None:
        """Add a decoded frame to the current round (RoundError if it closed meanwhile)."""
        with self.lock:
            try:
                self.rs.accept(arrival)
            except RoundError:
                self.rs.count_refused(arrival.frame.round, arrival.worker)
                raise
            if self.spool is not None:
                self.spool.put(arrival.frame.round, arrival.data)
            self.lock.notify_all()

    def count_rejected(self, worker: int | None = None) -> None:
        """Count a push refused before its round was looked at (bad header or frame)."""
        with self.lock:
            self.rs.count_refused(worker=worker)

    @contextmanager
    def follow(self, worker: int, from_round: int,
               starting: bool = False) -> Iterator[tuple[Subscription, list[ClosedRound]]]:
        """A queue that receives every later round result, and the held results from
        ``from_round`` on (a gap before them makes the worker FetchState); a newer stream
        of the same worker ends this one. A ``starting`` worker (building its trainer or
        fetching the state after a Join) is live while it follows, but not yet ready."""
        sub: Subscription = queue.Queue()
        with self.lock:
            old = self.subscribers.get(worker)
            if old is not None:
                old.put(None)
            self.subscribers[worker] = sub
            self.unfollowed_since.pop(worker, None)
            record = self.registry.records.get(worker)
            if record is not None and record.dead:  # slow to start, or cut off: it is back
                record.live, record.dead = True, False
                log.warning("worker %d follows the rounds again: no longer dead", worker)
            if not starting:
                self.ready.add(worker)
                self.stream_lost.discard(worker)
            self.lock.notify_all()
            backlog = [] if starting else [c for c in self.history if c.round >= from_round]
        try:
            yield sub, backlog
        finally:
            with self.lock:
                if self.subscribers.get(worker) is sub:
                    del self.subscribers[worker]
                    self.unfollowed_since[worker] = time.monotonic()
                    over = self.stopping or bool(self.history and self.history[-1].finished)
                    if not starting and not over and worker not in self.stream_lost:
                        self.stream_lost.add(worker)
                        log.info("worker %d's Rounds stream ended: rounds do not wait for it until it "
                                 "follows them again", worker)
                    self.lock.notify_all()

    def check_liveness(self) -> None:
        """Mark dead every worker without a Rounds stream for liveness_s; lock held."""
        now = time.monotonic()
        for worker, since in list(self.unfollowed_since.items()):
            record = self.registry.records.get(worker)
            if record is not None and not record.dead and now - since >= self.liveness_s:
                self.registry.mark_dead(worker)
                del self.unfollowed_since[worker]
                log.warning("worker %d has had no Rounds stream for %.0f s: marked dead; rounds no "
                            "longer wait for it, and a new worker may take its slot", worker, now - since)
                self.lock.notify_all()

    def _waiting_for(self) -> set[int]:
        """The slots whose frame the open round still waits for: not in, not dead, and not
        without their Rounds stream since it ended (a killed or cut-off worker cannot push
        before it has rejoined and followed again: a restarted one is starting, fetching the
        state, and is waited for from its first real stream on)."""
        dead = {i for i, r in self.registry.records.items() if r.dead}
        return set(range(self.registry.n)) - dead - self.stream_lost - set(self.rs.arrivals)

    def mark_finish_delivered(self, worker: int) -> None:
        with self.lock:
            self.delivered_finish.add(worker)
            self.lock.notify_all()

    def open_round(self) -> int:
        """The current round's number (it may have closed and not yet been published)."""
        with self.lock:
            return self.rs.round

    # ----- what the round loop calls -------------------------------------------------

    def wait_for_joins(self, workers: int, timeout_s: float) -> bool:
        """Open the current round once ``workers`` are ready, or once ``timeout_s`` passed
        with at least one joined; False if stopped first. Round 0 waits for every worker
        to have fetched the state (or to follow the Rounds stream) too, so that a slow
        starter does not lose round 0 to the deadline; a resumed run waits for the joins."""
        waited_since = time.monotonic()
        with self.lock:
            while not self.stopping and self._ready_count() < workers:
                if time.monotonic() - waited_since >= timeout_s:
                    if self.registry.live_count:
                        break
                    log.warning("no worker joined in %.0f s; still waiting", timeout_s)
                    waited_since = time.monotonic()
                self.lock.wait(timeout=JOIN_POLL_S)
            if self.stopping:
                return False
            log.info("%d of %d workers joined (%d ready); opening round %d",
                     self.registry.live_count, workers, len(self.ready), self.rs.round)
            self.rs.open()
            return True

    def _ready_count(self) -> int:
        if self.rs.round > 0:
            return self.registry.live_count
        live = {i for i, r in self.registry.records.items() if r.live}
        return len(live & self.ready)

    def wait_for_close(self, policy: ClosePolicy) -> RoundState | None:
        """The current round once ``policy`` closed it; None if stopped first."""
        with self.lock:
            while not self.stopping:
                self.check_liveness()
                if self.rs.try_close(policy, others_dead=not self._waiting_for()) is not None:
                    return self.rs
                self.lock.wait(timeout=max(0.01, min(self.rs.seconds_left(), CLOSE_POLL_S)))
        return None

    @contextmanager
    def publishing(self, closed: ClosedRound) -> Iterator[None]:
        """Keep ``closed``, open the next round, wake every Rounds stream; FetchState
        waits until the block (the apply) ends."""
        with self._params_lock:
            with self.lock:
                self.history.append(closed)
                while len(self.history) > 1 and sum(c.nbytes for c in self.history) > HISTORY_BYTES:
                    self.history.popleft()
                self.rs = RoundState(closed.round + 1, self.rs.deadline_s)
                if not closed.finished:
                    self.rs.open()
                for sub in self.subscribers.values():
                    sub.put(closed)
                self.lock.notify_all()
            yield

    def apply(self, update: Update, closed: ClosedRound, phases: ClosePhases | None = None) -> None:
        """The outer step on the parameters; the digest it sets is what the Rounds streams
        send after the frames (an error ends them instead). ``phases`` times both; the
        digest hashes each tensor as soon as the apply has finished with it."""
        digest = DigestAsApplied(self.params)
        try:
            with torch.no_grad():
                apply_update(self.params, update, on_final=digest.final)
            if phases is not None:
                phases.end("apply")
            closed.digest.set_result(digest.result())
            if phases is not None:
                phases.end("digest")
        except BaseException as exc:
            digest.cancel()
            closed.digest.set_exception(exc)
            raise

    def wait_finish_delivered(self, limit_s: float, every: int | None = None) -> None:
        """Until every live worker has the finished run's last result, for ``limit_s``;
        with ``every``, until that many workers have it (a resumed run that replayed its
        last round: the workers that had it already do not come back). A worker without a
        Rounds stream for liveness_s is marked dead here too, not waited for."""
        deadline = time.monotonic() + limit_s
        with self.lock:
            while not self.stopping and time.monotonic() < deadline:
                self.check_liveness()
                live = {i for i, r in self.registry.records.items() if r.live}
                if (len(self.delivered_finish) >= every if every is not None
                        else live <= self.delivered_finish):
                    return
                self.lock.wait(timeout=FINISH_POLL_S)

    def take_refused(self) -> tuple[int, int]:
        """(rejected, late) frames counted on the current round so far, reset to 0."""
        with self.lock:
            counts = self.rs.rejected, self.rs.late
            self.rs.rejected = self.rs.late = 0
            return counts

    def overview(self) -> Overview:
        with self.lock:
            records = self.registry.records
            return Overview(self.rs.round, self.rs.opened_at, len(self.rs.arrivals),
                            self.totals.rounds, self.totals.initial_val_loss,
                            sorted(i for i, r in records.items() if r.live), sorted(self.subscribers),
                            {i: r.state_fetches for i, r in records.items()})

    def live_count(self) -> int:
        with self.lock:
            return self.registry.live_count

    def workers_dict(self) -> dict[int, dict[str, Any]]:
        """The registry as a checkpoint keeps it."""
        with self.lock:
            return self.registry.to_dict()

    @contextmanager
    def params_between_rounds(self) -> Iterator[list[Tensor]]:
        """The parameters themselves, never half applied: an apply (and FetchState) waits
        until the block ends. A checkpoint writes them from here, copying nothing."""
        with self._params_lock:
            yield self.params

    def digest(self) -> str:
        return param_digest(self.params)

    def stop(self) -> None:
        """End every wait and every Rounds stream."""
        with self.lock:
            self.stopping = True
            for sub in self.subscribers.values():
                sub.put(None)
            self.lock.notify_all()
