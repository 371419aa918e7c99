"""Bounds on every frame before it counts, against one worker holding the token: a frame
whose norm is far above a reference (the lower median of the arrived frames' norms and
the recent rounds' counted ones) is scaled down or dropped, and no update that
could leave a parameter non-finite is committed (docs/security.md, "Poisoned updates";
norm clipping against the median as SparseLoCo's validators do, arXiv 2508.15706)."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from geoloco.config import GuardConfig
from geoloco.coordinator.outer import Update
from geoloco.coordinator.rounds import ClosePolicy, RoundState

log = logging.getLogger(__name__)

FINITE_LIMIT = 1e30  # |θ| above this could overflow fp32 (3.4e38) in later arithmetic


@dataclass(frozen=True)
class Verdict:
    """What the bounds decided for one closed round."""

    reference: float  # the lower median of the reference pool's norms
    scale: dict[int, float] = field(default_factory=dict)  # worker -> factor < 1 (clipped)
    rejected: dict[int, str] = field(default_factory=dict)  # worker -> why it was dropped
    pool: int = 0  # workers whose norms made the reference


def lower_median(values: list[float]) -> float:
    """The ⌈n/2⌉-th smallest: an honest value while fewer than half are too large."""
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 2] if ordered else 0.0


def judge(norms: dict[int, float], guard: GuardConfig, history: dict[int, float] | None = None) -> Verdict:
    """Clip each frame whose norm exceeds clip_ratio x the reference to it; drop a
    frame above reject_ratio x the reference, or one whose norm is not finite.

    The reference is the lower median of a pool: each arrived frame's finite norm, and
    for a worker without a frame this round the norm of its latest frame that counted
    (``history``). A pool of fewer than guard.min_reference_workers workers only clips:
    too few to tell an honest frame from a hostile one, so a worker sending tiny frames
    cannot have an honest frame dropped (a non-finite norm is dropped whatever the pool)."""
    finite = {w: n for w, n in norms.items() if math.isfinite(n)}
    pool = {**(history or {}), **finite}
    reference = lower_median(list(pool.values()))
    few = len(pool) < guard.min_reference_workers
    scale, rejected = {}, {}
    for worker, norm in sorted(norms.items()):
        if reference <= 0.0 and math.isfinite(norm):
            continue  # most frames are empty: nothing to compare with
        if not math.isfinite(norm) or (not few and norm > guard.reject_ratio * reference):
            rejected[worker] = (f"norm {norm:.3g} is above {guard.reject_ratio:g} x the reference "
                                f"frame norm {reference:.3g} (lower median of {len(pool)} workers' "
                                "recent frames)" if math.isfinite(norm) else f"norm {norm} is not finite")
        elif norm > guard.clip_ratio * reference:
            scale[worker] = guard.clip_ratio * reference / norm
    return Verdict(reference, scale, rejected, len(pool))


class FrameBounds:
    """Applies the verdict to each closed round, and keeps a running bound on max|θ|
    that proves an update leaves every parameter finite before it is committed."""

    def __init__(self, guard: GuardConfig, params: list[Tensor]) -> None:
        self.guard = guard
        self.params = params
        self.theta_bound = _max_abs(params)
        # worker -> (round, L2 norm) of its latest frame that counted: the reference pool's
        # memory, saved in checkpoints (a resumed run judges as the undisturbed one)
        self.recent: dict[int, tuple[int, float]] = {}

    def history(self, round_: int) -> dict[int, float]:
        """The norms of each worker's latest counted frame of the last
        guard.reference_rounds rounds before ``round_``."""
        return {w: norm for w, (r, norm) in self.recent.items() if round_ - r <= self.guard.reference_rounds}

    def remember(self, round_: int, update: Update) -> None:
        """The norms of the workers' frames a committed update of ``round_`` applied (their
        own norms, before any clipping weight; those an aggregated result was made of)."""
        for f in update.sources or update.frames:
            self.recent[f.sender] = (round_, f.frame.magnitudes()[0])

    def bound_round(self, rs: RoundState, policy: ClosePolicy) -> Verdict:
        """Judge the round's arrived frames and restrict its decision accordingly; the
        offenders are named in the log (and counted in the round's metrics)."""
        verdict = judge({w: a.norm for w, a in rs.arrivals.items()}, self.guard, self.history(rs.round))
        for worker, reason in verdict.rejected.items():
            log.warning("round %d: frame from worker %d rejected: %s", rs.round, worker, reason)
        for worker, factor in verdict.scale.items():
            log.warning("round %d: frame from worker %d clipped to %g x the reference frame norm "
                        "(scaled by %.3g)", rs.round, worker, self.guard.clip_ratio, factor)
        if verdict.rejected or verdict.scale:
            rs.bound(set(verdict.rejected), verdict.scale, policy)
        return verdict

    def admits(self, move: float) -> bool:
        """``safe``'s test for a move known only as a bound (before the step that makes it;
        ``OuterOptimizer.worst_move``), remembering nothing: ``safe`` of the update follows."""
        if not math.isfinite(move):
            return False
        if self.theta_bound + move >= FINITE_LIMIT:
            self.theta_bound = _max_abs(self.params)  # the running bound only grows: measure
        return self.theta_bound + move < FINITE_LIMIT

    def safe(self, update: Update) -> bool:
        """True when ``update`` cannot make a parameter non-finite: max|θ| plus the most
        any coordinate can move, |alpha| x sum |w_i| x max|v_i|, stays below FINITE_LIMIT.
        Remembers the new bound when it returns True."""
        move = abs(update.alpha) * sum(abs(f.weight) * f.frame.magnitudes()[1] for f in update.frames)
        if not math.isfinite(move):
            return False
        if self.theta_bound + move >= FINITE_LIMIT:
            self.theta_bound = _max_abs(self.params)  # the running bound only grows: measure
        if self.theta_bound + move >= FINITE_LIMIT:
            return False
        self.theta_bound += move
        return True


def _max_abs(params: list[Tensor]) -> float:
    """max|θ| without a temporary copy of any tensor."""
    with torch.no_grad():
        return max((max(float(p.max()), -float(p.min())) for p in params if p.numel()), default=0.0)
