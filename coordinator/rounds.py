"""The state of one round on the coordinator, pure: open, accept validated frames, close by
a pluggable policy (all arrived, decodable under gradient coding, or the deadline), the
chosen frames with their coefficients, and the closed round's result as broadcast
(round protocol: docs/protocol.md)."""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import numpy as np

from geoloco.config import LATE_WORK, CodingConfig
from geoloco.coordinator.gradient_coding import GradientCode
from geoloco.protos import geoloco_pb2 as pb


@dataclass
class Arrival:
    """One accepted frame and what the worker reported with it."""

    worker: int
    data: bytes  # the frame bytes exactly as received (they are broadcast as they are)
    frame: Any  # compression.Frame, already validated against the layout
    compute_seconds: float = 0.0
    train_loss: float = float("nan")
    partitions: tuple[int, ...] = ()
    encode_seconds: float = 0.0  # the worker's compression time for this frame
    apply_seconds: float = 0.0  # the worker's time to apply the previous round result
    decode_seconds: float = 0.0  # the coordinator's time to check and decode the frame
    received_at: float = field(default_factory=time.monotonic)
    norm: float = 0.0  # L2 norm of the frame's values (geoloco.coordinator.bounds)
    max_abs: float = 0.0  # its largest absolute value
    digest_mismatches: int = 0  # the worker process's counts so far, as it reported them
    resyncs: int = 0
    density: float = 0.0  # the frame's top-k density (0: dense, or a version-1 worker)
    upload_rate: float = 0.0  # bytes/s of the worker's previous push, as it measured it


@dataclass(frozen=True)
class Decision:
    """Which frames a closing round uses.

    ``coefficients`` are the decoding coefficients a_i with sum_i a_i m_i equal to the sum
    of ``covered`` partitions' pseudo-gradients, so the mean is sum_i (a_i / covered) m_i.
    ``stale_overlap``: the chosen frames overlap
    and carry versions of different ages (``pgc-cr``), whose loss a per-coordinate mean
    over keepers made worse (``coordinator.outer.mean_weights``).
    """

    coefficients: dict[int, float]
    covered: int
    reason: str  # one of CLOSE_REASONS
    stale_overlap: bool = False

    @property
    def exact(self) -> bool:
        """The chosen frames decode the covered partitions exactly (not a deadline's best effort)."""
        return self.reason.removesuffix(BOUNDED) in ("all arrived", "decodable")


CLOSE_REASONS = ("all arrived", "decodable", "quorum", "deadline", "live arrived")
BOUNDED = ", bounded"  # appended to the reason when the frame bounds dropped a frame


@dataclass(frozen=True)
class ArrivalTimes:
    """When a round's frames came, in seconds since it opened, and the time it is now."""

    now: float
    arrived: dict[int, float]


class ClosePolicy(Protocol):
    """Decides when a round may close and with which coefficients."""

    def decide(self, arrived: list[int], deadline_passed: bool,
               times: ArrivalTimes | None = None) -> Decision | None:
        """A decision, or None to keep waiting (``times`` None: decide as at the deadline
        would on time alone)."""

    def settlement(self, decision: Decision, worker: int) -> pb.Settlement:
        """How ``worker`` settles the error feedback of its frame for the decided round."""

    def observe(self, times: ArrivalTimes) -> None:
        """A closed round's arrival times (a policy that learns from them keeps them)."""


class CodePolicy:
    """Close as soon as the gradient code can decode the arrived set (scheme ``none``: all
    n arrived). At the deadline, take whatever arrived with ``deadline_decoding``."""

    def __init__(self, code: GradientCode) -> None:
        self.code = code

    def observe(self, times: ArrivalTimes) -> None:
        pass  # a code decides on who arrived, not when

    def decide(self, arrived: list[int], deadline_passed: bool,
               times: ArrivalTimes | None = None) -> Decision | None:
        decoded = self.code.decode(arrived) if arrived else None
        if decoded is not None:
            reason = "all arrived" if len(arrived) == self.code.n else "decodable"
            kept = {i: a for i, a in decoded.items() if a != 0.0}
            return Decision(kept, self.code.n, reason, self.code.stale_overlap)
        if deadline_passed:
            coefficients, covered = deadline_decoding(self.code.B, arrived)
            return Decision(coefficients, covered, "deadline", self.code.stale_overlap)
        return None

    def settlement(self, decision: Decision, worker: int) -> pb.Settlement:
        return settlement(self.code, decision, worker)


SPREAD_ROUNDS = 8  # QuorumPolicy's adaptive grace: the median over this many recent rounds


class QuorumPolicy:
    """Close on a quorum once a grace window has passed: the baseline that drops late work
    (Decoupled DiLoCo's minimum quorum and grace window; hivemind and Psyche drop late peers
    at a timeout). Before the deadline a round closes with every worker in ("all
    arrived"), or once ``quorum`` frames are in and ``grace_s`` has passed since the
    quorum-th came ("quorum"); at the deadline with what arrived. The round's update is the
    mean of the arrived frames: each covers its worker's own partition and the same tokens
    (H inner steps of one batch size: no worker is cut short), so the token weights are
    equal. ``grace_s`` None: adaptive, ``grace_spread`` times the median arrival spread
    (first frame to last, in time) of the last SPREAD_ROUNDS rounds; until a round has
    been seen the round waits for every worker. A frame the round closed without settles
    by ``late``: "keep" adds it back into its worker's error feedback (ADD_BACK: sent
    later, as a deadline does), "drop" discards it (RESTORE: the round never touched that
    error feedback, and the pseudo-gradient is gone)."""

    def __init__(self, code: GradientCode, quorum: int, grace_s: float | None = None,
                 grace_spread: float = CodingConfig.grace_spread, late: str = CodingConfig.late) -> None:
        if not 1 <= quorum <= code.n:
            raise ValueError(f"quorum {quorum} is outside 1..{code.n}")
        if late not in LATE_WORK:
            raise ValueError(f"late work {late!r} is not one of {', '.join(LATE_WORK)}")
        self.code = code
        self.quorum = quorum
        self.grace_s = grace_s
        self.grace_spread = grace_spread
        self.late = late
        self.spreads: list[float] = []  # the recent rounds' arrival spreads, oldest first

    def grace(self) -> float | None:
        """Seconds to wait after the quorum; None: no figure yet, wait for all."""
        if self.grace_s is not None:
            return self.grace_s
        if not self.spreads:
            return None
        return self.grace_spread * float(np.median(self.spreads))

    def observe(self, times: ArrivalTimes) -> None:
        if times.arrived:
            self.spreads.append(max(times.arrived.values()) - min(times.arrived.values()))
            del self.spreads[:-SPREAD_ROUNDS]

    def decide(self, arrived: list[int], deadline_passed: bool,
               times: ArrivalTimes | None = None) -> Decision | None:
        if len(arrived) == self.code.n:
            return self.mean(arrived, "all arrived")
        if deadline_passed or times is None:
            return self.mean(arrived, "deadline") if arrived else Decision({}, 0, "deadline")
        grace = self.grace()
        if len(arrived) < self.quorum or grace is None:
            return None
        quorum_at = sorted(times.arrived[i] for i in arrived)[self.quorum - 1]
        return self.mean(arrived, "quorum") if times.now - quorum_at >= grace else None

    def settlement(self, decision: Decision, worker: int) -> pb.Settlement:
        kinds = pb.Settlement
        if worker in decision.coefficients:
            return kinds(kind=kinds.KEEP)
        return kinds(kind=kinds.ADD_BACK if self.late == "keep" else kinds.RESTORE)

    @staticmethod
    def mean(arrived: list[int], reason: str) -> Decision:
        """Every arrived frame with a_i = 1 over the |F| partitions they cover: their mean."""
        return Decision(dict.fromkeys(sorted(arrived), 1.0), len(arrived), reason)


def close_policy(code: GradientCode, coding: CodingConfig) -> ClosePolicy:
    """The run's close policy: QuorumPolicy for scheme ``quorum``, else the code's."""
    if code.name == "quorum":
        return QuorumPolicy(code, code.n - code.s, coding.grace_s, coding.grace_spread, coding.late)
    return CodePolicy(code)


def settlement(code: GradientCode, decision: Decision, worker: int) -> pb.Settlement:
    """What became of ``worker``'s frame (docs/gradient-coding.md, "Error feedback that
    loses nothing"): applied (KEEP); not applied but a chosen group-mate of a classic code
    sent the same message from the same parameters (CREDIT: its frame is this one's); not
    applied but the chosen frames delivered its content, by decoding exactly or a pipelined
    group-mate's version of it (RESTORE: the round never touched its error feedback);
    not applied and nothing stood in for it, at a deadline (ADD_BACK: send it later)."""
    kinds = pb.Settlement
    if worker in decision.coefficients:
        return kinds(kind=kinds.KEEP)
    mate = next((j for j in sorted(decision.coefficients)
                 if np.array_equal(code.B[j], code.B[worker])), None)
    if mate is not None and not code.pipelined:
        return kinds(kind=kinds.CREDIT, sender=mate)
    if mate is not None or decision.exact:
        return kinds(kind=kinds.RESTORE)
    return kinds(kind=kinds.ADD_BACK)


def worker_task(code: GradientCode, worker: int, round: int, rounds: int) -> pb.WorkerTask:
    """What ``worker`` trains and sends in ``round`` (nothing past the run's last round)."""
    if round >= rounds or worker >= code.n:
        return pb.WorkerTask(round=round)
    coeffs = code.coefficients(worker)
    return pb.WorkerTask(
        round=round, train_partitions=code.partition_at(worker, round),
        send_partitions=[j for j, _ in coeffs], send_coefficients=[c for _, c in coeffs],
    )


def deadline_decoding(B: np.ndarray, arrived: list[int]) -> tuple[dict[int, float], int]:
    """Coefficients for a set that cannot be decoded exactly, and how many partitions they
    cover: the least-squares a with sum_i a_i B[i] ~ 1 on the partitions some arrived
    worker holds (B = I: a_i = 1, so the update is the mean over the arrived frames; FR:
    the lowest-id arrival of each covered group, a = 1: a worker whose row repeats an
    earlier arrival's sends the same combination and is left out). Nobody arrived: an
    empty update."""
    workers: list[int] = []
    for i in sorted(arrived):
        if not any(np.array_equal(B[i], B[j]) for j in workers):
            workers.append(i)
    if not workers:
        return {}, 0
    rows = B[workers]
    covered = np.flatnonzero(np.abs(rows).sum(axis=0) > 0)
    a, *_ = np.linalg.lstsq(rows[:, covered].T, np.ones(len(covered)), rcond=None)
    kept = {i: float(x) for i, x in zip(workers, a, strict=True) if abs(x) > 1e-12}
    return kept, len(covered)


class RoundError(ValueError):
    """A push that the open round refuses (wrong round, duplicate, closed)."""


class RoundState:
    """One round: its number, its arrivals, its deadline, once closed its decision, and the
    frames refused while it was the coordinator's current round (late: for a round that
    had closed; rejected: anything else)."""

    def __init__(self, round: int, deadline_s: float) -> None:
        self.round = round
        self.deadline_s = deadline_s
        self.opened_at: float | None = None
        self.arrivals: dict[int, Arrival] = {}
        self.decision: Decision | None = None
        self.rejected = 0
        self.late = 0
        self.rejected_by: dict[int, int] = {}  # worker -> its frames refused (not late)
        self.clipped_by: dict[int, int] = {}  # worker -> its frames scaled down at close

    def open(self) -> None:
        """Start the deadline clock (pushes are accepted before it, e.g. while joining)."""
        self.opened_at = time.monotonic()

    @property
    def closed(self) -> bool:
        return self.decision is not None

    def seconds_left(self) -> float:
        if self.opened_at is None:
            return self.deadline_s
        return self.opened_at + self.deadline_s - time.monotonic()

    def check_push(self, worker: int, round: int) -> None:
        """Raise RoundError naming the problem when ``worker`` may not push for ``round``."""
        if round != self.round or self.closed:
            state = "closed" if self.closed else "open"
            raise RoundError(f"frame for round {round} but round {self.round} is {state}")
        if worker in self.arrivals:
            raise RoundError(f"worker {worker} already pushed a frame for round {round}")

    def accept(self, arrival: Arrival) -> None:
        self.check_push(arrival.worker, arrival.frame.round)
        self.arrivals[arrival.worker] = arrival

    def count_refused(self, round: int | None = None, worker: int | None = None) -> None:
        """Count a refused frame for ``round``: late if that round has closed, else
        rejected (``None``: a push too broken to name its round), by ``worker`` if known."""
        if round is not None and (round < self.round or (round == self.round and self.closed)):
            self.late += 1
        else:
            self.rejected += 1
            if worker is not None:
                self.rejected_by[worker] = self.rejected_by.get(worker, 0) + 1

    def bound(self, rejected: set[int], scale: dict[int, float], policy: ClosePolicy) -> None:
        """After the close: drop the ``rejected`` arrivals (the policy decides again on the
        rest, as at a deadline) and multiply the coefficients of ``scale``'s workers."""
        decision = self.decision
        if rejected:
            for worker in rejected:
                self.rejected_by[worker] = self.rejected_by.get(worker, 0) + 1
            self.rejected += len(rejected)
            kept = sorted(set(self.arrivals) - rejected)
            decision = policy.decide(kept, True)
            decision = replace(decision, reason=decision.reason + BOUNDED)
        if scale:  # a clipped frame still counts as one of the keepers, scaled down
            for worker in scale:
                self.clipped_by[worker] = self.clipped_by.get(worker, 0) + 1
            coefficients = {i: a * scale.get(i, 1.0) for i, a in decision.coefficients.items()}
            decision = replace(decision, coefficients=coefficients)
        self.decision = decision

    def try_close(self, policy: ClosePolicy, others_dead: bool = False) -> Decision | None:
        """Ask the policy; on a decision the round is closed and keeps it. ``others_dead``:
        every worker not in is dead, so an arrived set the policy would wait on closes as
        at the deadline ("live arrived")."""
        if self.closed:
            return self.decision
        if self.opened_at is None:
            return None
        deadline_passed = self.seconds_left() <= 0
        give_up = others_dead and bool(self.arrivals) and not deadline_passed
        decision = policy.decide(sorted(self.arrivals), deadline_passed or give_up, self.times())
        if decision is not None and give_up and decision.reason == "deadline":
            decision = replace(decision, reason="live arrived")
        self.decision = decision
        return decision

    def times(self) -> ArrivalTimes:
        """The arrivals' times and now, in seconds since the open."""
        now = time.monotonic()
        opened = self.opened_at if self.opened_at is not None else now
        return ArrivalTimes(now - opened, {i: a.received_at - opened for i, a in self.arrivals.items()})

    def chosen(self) -> list[tuple[Arrival, float]]:
        """The chosen arrivals with their coefficients, in worker order."""
        if self.decision is None:
            return []
        return [(self.arrivals[i], a) for i, a in sorted(self.decision.coefficients.items())]


@dataclass(frozen=True)
class ClosedRound:
    """A broadcast round result: the header (without the per-worker next task and
    settlement), the chosen frames' bytes in header order (the arrivals' own, not copied),
    each worker's settlement, and the digest of the parameters after the round, which the
    coordinator sets once it has applied the round (the broadcast does not wait)."""

    header: pb.RoundHeader
    parts: tuple[bytes, ...]
    settlements: dict[int, pb.Settlement] = field(default_factory=dict)
    digest: Future[str] = field(default_factory=Future)

    @property
    def nbytes(self) -> int:
        return sum(len(p) for p in self.parts)

    @property
    def data(self) -> bytes:
        """The frames back to back, as they go on the wire (a copy)."""
        return b"".join(self.parts)

    @property
    def round(self) -> int:
        return self.header.round

    @property
    def finished(self) -> bool:
        return self.header.finished
