"""What one caller may hold of the coordinator's server: concurrent calls per worker and
RPC, unauthenticated calls per source and in total, failed Joins per source and per
certificate (token buckets), and how long a stream may sit idle before its next message
(docs/security.md, "Hostile clients")."""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field

STREAMS_PER_WORKER = 2  # concurrent calls of one worker per RPC (a reconnect overlaps one)
FAILED_JOIN_BURST = 5  # failed Joins a peer may make at once ...
FAILED_JOINS_PER_S = 0.2  # ... and then one every 5 s
FIRST_MESSAGE_S = 10.0  # a Push must send its header this soon after the call starts
IDLE_MESSAGE_S = 60.0  # ... and each later chunk this soon after the one before
LIMITER_PEERS = 10_000  # peers the Join limiter remembers (the oldest are forgotten)
# Join is the one call a caller makes before it is authenticated: what it may hold then
JOIN_REQUEST_BYTES = 16 << 10  # a JoinRequest's largest size (token, hostname, device, version)
JOIN_REQUEST_S = 10.0  # a Join must have sent its request this soon after the call starts
UNAUTHENTICATED_PER_SOURCE = 4  # Joins one source address may have open at once ...
UNAUTHENTICATED_AT_ONCE = 16  # ... and all sources together
RPCS = ("FetchState", "Push", "Rounds")


class LimitExceeded(Exception):
    """A call refused because its caller already holds its share; gRPC RESOURCE_EXHAUSTED."""


class StreamSlots:
    """At most ``per_worker`` concurrent calls of each worker for each RPC."""

    def __init__(self, per_worker: int = STREAMS_PER_WORKER) -> None:
        self.per_worker = per_worker
        self._held: dict[tuple[int, str], int] = defaultdict(int)
        self._lock = threading.Lock()

    def acquire(self, worker: int, rpc: str) -> AbstractContextManager[None]:
        """Take one of ``worker``'s slots for ``rpc`` now (LimitExceeded if none is
        free); leaving the returned context gives it back."""
        key = (worker, rpc)
        with self._lock:
            if self._held[key] >= self.per_worker:
                raise LimitExceeded(f"worker {worker} already has {self._held[key]} {rpc} calls open "
                                    f"(at most {self.per_worker})")
            self._held[key] += 1
        return self._release(key)

    @contextmanager
    def _release(self, key: tuple[int, str]) -> Iterator[None]:
        try:
            yield
        finally:
            with self._lock:
                self._held[key] -= 1

    def held(self) -> int:
        with self._lock:
            return sum(self._held.values())


@dataclass
class _Bucket:
    tokens: float
    at: float


class JoinLimiter:
    """Failed Joins per key (the source address, and the certificate when there is one):
    a token bucket of ``burst`` that refills at ``per_s``. Only a Join with a wrong token
    is ever checked against it, so a caller with the right token is never refused: an
    empty bucket turns a wrong token's PERMISSION_DENIED into a quiet RESOURCE_EXHAUSTED
    (no log line), which bounds the log and the work a guesser causes."""

    def __init__(self, burst: int = FAILED_JOIN_BURST, per_s: float = FAILED_JOINS_PER_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.burst, self.per_s, self.clock = burst, per_s, clock
        self._buckets: dict[str, _Bucket] = {}
        self._lock = threading.Lock()
        self.refused = 0

    def check(self, *keys: str) -> None:
        """LimitExceeded if any of ``keys`` has no failed Join left to spend."""
        with self._lock:
            for key in keys:
                bucket = self._refill(key)
                if bucket is not None and bucket.tokens < 1.0:
                    self.refused += 1
                    wait = (1.0 - bucket.tokens) / self.per_s
                    raise LimitExceeded(f"too many failed joins from {key}; try again in {wait:.0f}s")

    def failed(self, *keys: str) -> None:
        """Spend one failed Join of each of ``keys``."""
        with self._lock:
            for key in keys:
                bucket = self._refill(key)
                if bucket is None:
                    if len(self._buckets) >= LIMITER_PEERS:
                        self._buckets.pop(next(iter(self._buckets)))
                    bucket = self._buckets[key] = _Bucket(float(self.burst), self.clock())
                bucket.tokens -= 1.0

    def _refill(self, key: str) -> _Bucket | None:
        bucket = self._buckets.get(key)
        if bucket is not None:
            now = self.clock()
            bucket.tokens = min(float(self.burst), bucket.tokens + (now - bucket.at) * self.per_s)
            bucket.at = now
        return bucket


class SourceGate:
    """Calls not yet authenticated: at most ``per_source`` open at once from one source
    address and ``total`` from all, so what unauthenticated callers hold (threads, and
    the request bytes gRPC buffers for them) is bounded."""

    def __init__(self, per_source: int = UNAUTHENTICATED_PER_SOURCE,
                 total: int = UNAUTHENTICATED_AT_ONCE) -> None:
        self.per_source, self.total = per_source, total
        self._open: dict[str, int] = defaultdict(int)
        self._lock = threading.Lock()

    def enter(self, source: str) -> AbstractContextManager[None]:
        """Take a place for ``source`` now (LimitExceeded if none is free); leaving the
        returned context gives it back."""
        with self._lock:
            if sum(self._open.values()) >= self.total:
                raise LimitExceeded(f"{self.total} joins are open at once already; try again")
            if self._open[source] >= self.per_source:
                raise LimitExceeded(f"{self.per_source} joins from this address are open already; "
                                    "try again")
            self._open[source] += 1
        return self._leave(source)

    @contextmanager
    def _leave(self, source: str) -> Iterator[None]:
        try:
            yield
        finally:
            with self._lock:
                self._open[source] -= 1
                if not self._open[source]:
                    del self._open[source]

    def held(self) -> int:
        with self._lock:
            return sum(self._open.values())


@dataclass(order=True)
class _Deadline:
    at: float
    seq: int
    cancel: Callable[[], None] = field(compare=False)
    live: bool = field(default=True, compare=False)


def _never() -> None:
    """What a disarmed deadline calls: nothing."""


class Watchdog:
    """One thread that cancels calls whose next message is overdue (a blocked read of a
    request stream has no timeout of its own in gRPC's synchronous server)."""

    def __init__(self) -> None:
        self._heap: list[_Deadline] = []
        self._seq = itertools.count()
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="call-watchdog", daemon=True)
        self._thread.start()

    def arm(self, seconds: float, cancel: Callable[[], None]) -> _Deadline:
        """Call ``cancel`` in ``seconds`` unless ``disarm`` comes first."""
        deadline = _Deadline(time.monotonic() + seconds, next(self._seq), cancel)
        with self._cond:
            heapq.heappush(self._heap, deadline)
            self._cond.notify()
        return deadline

    @staticmethod
    def disarm(deadline: _Deadline) -> None:
        """Forget ``deadline``; it lets go of its call at once (the heap keeps the entry
        until its time, and a call held that long keeps its HTTP/2 stream open)."""
        deadline.live = False
        deadline.cancel = _never

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._heap or self._heap[0].at > time.monotonic():
                    self._cond.wait(timeout=self._heap[0].at - time.monotonic() if self._heap else None)
                due = heapq.heappop(self._heap)
            if due.live:
                due.cancel()


class IdleTimeout:
    """A request stream read with a deadline per message: ``first_s`` for the first one,
    ``idle_s`` for each next; an overdue message cancels the call (the read then raises
    grpc.RpcError), and ``expired`` tells the reason apart."""

    def __init__(self, watchdog: Watchdog, cancel: Callable[[], None],
                 first_s: float | None = None, idle_s: float | None = None) -> None:
        # the module's deadlines are read per call, not bound at import: a test can shorten
        # them for a real coordinator that runs in the test's own process
        self.watchdog, self._cancel = watchdog, cancel
        self.idle_s = IDLE_MESSAGE_S if idle_s is None else idle_s
        self.expired = False
        self._deadline = watchdog.arm(FIRST_MESSAGE_S if first_s is None else first_s, self._expire)

    def _expire(self) -> None:
        self.expired = True
        self._cancel()

    def fed(self) -> None:
        """A message came: the next one has ``idle_s``."""
        self.watchdog.disarm(self._deadline)
        self._deadline = self.watchdog.arm(self.idle_s, self._expire)

    def close(self) -> None:
        self.watchdog.disarm(self._deadline)
