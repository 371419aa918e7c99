"""Bounds on every frame before it counts, against one worker holding the token: a frame
whose norm is far above the round's median is scaled down or dropped, and no update that
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

    reference: float  # the lower median of the arrived frames' norms
    scale: dict[int, float] = field(default_factory=dict)  # worker -> factor < 1 (clipped)
    rejected: dict[int, str] = field(default_factory=dict)  # worker -> why it was dropped


def lower_median(values: list[float]) -> float:
    """The ⌈n/2⌉-th smallest: an honest value while fewer than half are too large."""
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 2] if ordered else 0.0


def judge(norms: dict[int, float], guard: GuardConfig) -> Verdict:
    """Clip each frame whose norm exceeds clip_ratio x the reference to it; drop a
    frame above reject_ratio x the reference, or one whose norm is not finite."""
    reference = lower_median([n for n in norms.values() if math.isfinite(n)])
    scale, rejected = {}, {}
    for worker, norm in sorted(norms.items()):
        if reference <= 0.0 and math.isfinite(norm):
            continue  # most frames are empty: nothing to compare with
        if not math.isfinite(norm) or norm > guard.reject_ratio * reference:
            rejected[worker] = (f"norm {norm:.3g} is above {guard.reject_ratio:g} x the round's "
                                f"median frame norm {reference:.3g}")
        elif norm > guard.clip_ratio * reference:
            scale[worker] = guard.clip_ratio * reference / norm
    return Verdict(reference, scale, rejected)


class FrameBounds:
    """Applies the verdict to each closed round, and keeps a running bound on max|θ|
    that proves an update leaves every parameter finite before it is committed."""

    def __init__(self, guard: GuardConfig, params: list[Tensor]) -> None:
        self.guard = guard
        self.params = params
        self.theta_bound = _max_abs(params)

    def bound_round(self, rs: RoundState, policy: ClosePolicy) -> Verdict:
        """Judge the round's arrived frames and restrict its decision accordingly; the
        offenders are named in the log (and counted in the round's metrics)."""
        verdict = judge({w: a.norm for w, a in rs.arrivals.items()}, self.guard)
        for worker, reason in verdict.rejected.items():
            log.warning("round %d: frame from worker %d rejected: %s", rs.round, worker, reason)
        for worker, factor in verdict.scale.items():
            log.warning("round %d: frame from worker %d clipped to %g x the median frame norm "
                        "(scaled by %.3g)", rs.round, worker, self.guard.clip_ratio, factor)
        if verdict.rejected or verdict.scale:
            rs.bound(set(verdict.rejected), verdict.scale, policy)
        return verdict

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
