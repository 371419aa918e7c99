"""The coordinator's defences without a server: frame norms against a reference median
(geoloco.coordinator.bounds), the finite proof before a commit, and the per-caller limits
(geoloco.coordinator.limits)."""

from __future__ import annotations

import math
import threading

import pytest
import torch

from geoloco.compression import Compressor, Layout, decode_frame, encode_dense
from geoloco.config import GuardConfig
from geoloco.coordinator.bounds import FINITE_LIMIT, FrameBounds, judge, lower_median
from geoloco.coordinator.gradient_coding import make_code
from geoloco.coordinator.limits import (
    IdleTimeout,
    JoinLimiter,
    LimitExceeded,
    StreamSlots,
    Watchdog,
)
from geoloco.coordinator.outer import Update, UpdateFrame
from geoloco.coordinator.rounds import Arrival, CodePolicy, RoundState

GUARD = GuardConfig(clip_ratio=2.0, reject_ratio=100.0)
LAYOUT = Layout.from_named_tensors([("w", torch.zeros(64, 64)), ("b", torch.zeros(64))])


def sparse(worker: int, scale: float = 1.0):
    gen = torch.Generator().manual_seed(worker)
    deltas = [torch.randn(s.shape, generator=gen) * 1e-2 * scale for s in LAYOUT.specs]
    data = Compressor(LAYOUT).compress(deltas, round=0, sender=worker)
    return data, decode_frame(data, LAYOUT)


@pytest.mark.slow
def test_frame_magnitudes_are_the_norm_and_largest_value_of_its_values() -> None:
    _, frame = sparse(1)
    values = torch.cat([t.reshape(-1) for t in frame.to_dense()]).double()
    norm, largest = frame.magnitudes()
    assert norm == pytest.approx(float(values.norm()), rel=1e-9)
    assert largest == pytest.approx(float(values.abs().max()))
    dense = decode_frame(encode_dense(LAYOUT, [torch.full(s.shape, -3.0) for s in LAYOUT.specs],
                                      round=0, sender=0), LAYOUT)
    assert dense.magnitudes() == pytest.approx((3.0 * math.sqrt(LAYOUT.numel), 3.0))


def test_the_lower_median_stays_honest_while_fewer_than_half_are_large() -> None:
    assert lower_median([1.0, 1.2, 1e6, 1e40]) == 1.2
    assert lower_median([1.0, 1e6]) == 1.0
    assert lower_median([]) == 0.0


def test_judge_clips_above_c_and_rejects_far_above_or_non_finite() -> None:
    verdict = judge({0: 1.0, 1: 1.1, 2: 3.0, 3: 1e6, 4: math.inf}, GUARD)
    assert verdict.reference == 1.1
    assert verdict.scale == {2: pytest.approx(2.2 / 3.0)}
    assert set(verdict.rejected) == {3, 4} and "above 100 x" in verdict.rejected[3]
    assert judge({0: 0.0, 1: 0.0, 2: 0.5}, GUARD).rejected == {}  # no reference, no verdict


def test_a_pool_too_small_to_tell_honest_from_hostile_only_clips() -> None:
    """n = 2, one worker sends tiny frames: the honest frame is clipped, never dropped
    (remove the min_reference_workers check and it is rejected)."""
    verdict = judge({0: 1e-6, 1: 1.0}, GUARD)
    assert verdict.pool == 2 and verdict.rejected == {}
    assert verdict.scale == {1: pytest.approx(2e-6)}
    assert set(judge({0: 1e-6, 1: math.nan}, GUARD).rejected) == {1}  # non-finite: always dropped
    three = GuardConfig(clip_ratio=2.0, reject_ratio=100.0, min_reference_workers=2)
    assert set(judge({0: 1e-6, 1: 1.0}, three).rejected) == {1}  # the old rule, asked for


def test_the_recent_rounds_norms_keep_a_round_that_closed_on_few_frames_honest() -> None:
    """A round closes on the tiny frame and one honest frame: the other workers' latest
    counted norms keep the reference honest, so nothing honest is clipped or dropped."""
    history = {2: 1.1, 3: 0.9}
    verdict = judge({0: 1e-6, 1: 1.0}, GUARD, history)
    assert verdict.pool == 4 and verdict.reference == 0.9
    assert verdict.rejected == {} and verdict.scale == {}
    assert judge({0: 1e-6, 1: 1.0}, GUARD, {0: 5.0, 2: 1.1}).pool == 3  # this round's norm wins


def test_frame_bounds_remember_the_counted_frames_of_the_last_rounds() -> None:
    guard = GuardConfig(reference_rounds=2)
    bounds = FrameBounds(guard, [torch.zeros(s.shape) for s in LAYOUT.specs])
    frames = [sparse(w) for w in range(3)]
    bounds.remember(4, Update([UpdateFrame(w, 0.5, d, f) for w, (d, f) in enumerate(frames[:2])], "sum", -1.0))
    bounds.remember(5, Update([UpdateFrame(2, 1.0, *frames[2])], "sum", -1.0))
    norms = [f.magnitudes()[0] for _, f in frames]
    assert bounds.history(6) == {0: norms[0], 1: norms[1], 2: norms[2]}  # unscaled by the weight
    assert bounds.history(7) == {2: norms[2]}  # round 4 is more than 2 rounds back


def test_a_bounded_round_drops_the_rejected_and_scales_the_clipped() -> None:
    policy = CodePolicy(make_code("none", 4, 0, 0))
    rs = RoundState(0, 60.0)
    rs.open()
    frames = {w: sparse(w, scale) for w, scale in enumerate([1.0, 1.0, 5.0, 1e6])}
    for w, (data, frame) in frames.items():
        norm, largest = frame.magnitudes()
        rs.accept(Arrival(w, data, frame, norm=norm, max_abs=largest))
    assert rs.try_close(policy).reason == "all arrived"
    bounds = FrameBounds(GUARD, [torch.zeros(s.shape) for s in LAYOUT.specs])
    verdict = bounds.bound_round(rs, policy)
    assert set(verdict.rejected) == {3} and set(verdict.scale) == {2}
    assert sorted(rs.decision.coefficients) == [0, 1, 2] and rs.decision.covered == 3
    assert rs.decision.coefficients[2] == pytest.approx(verdict.scale[2])
    assert rs.rejected_by == {3: 1} and rs.clipped_by == {2: 1}


def test_an_update_that_could_overflow_is_not_safe() -> None:
    params = [torch.ones(s.shape) for s in LAYOUT.specs]
    bounds = FrameBounds(GUARD, params)
    data, frame = sparse(0)
    small = Update([UpdateFrame(0, 0.5, data, frame)], "sum", -1.0)
    assert bounds.safe(small) and bounds.theta_bound == pytest.approx(1.0 + 0.5 * frame.magnitudes()[1])
    huge = encode_dense(LAYOUT, [torch.full(s.shape, 3e38) for s in LAYOUT.specs], round=0, sender=0)
    big = Update([UpdateFrame(0, 1.0, huge, decode_frame(huge, LAYOUT))] * 2, "sum", 1.0)
    assert not bounds.safe(big)
    bounds.theta_bound = FINITE_LIMIT  # a loose running bound is measured again, not trusted
    assert bounds.safe(small)


def test_stream_slots_cap_each_worker_and_rpc() -> None:
    slots = StreamSlots(per_worker=2)
    with slots.acquire(0, "Push"), slots.acquire(0, "Push"):
        with pytest.raises(LimitExceeded, match="worker 0 already has 2 Push calls open"):
            slots.acquire(0, "Push")
        with slots.acquire(1, "Push"), slots.acquire(0, "Rounds"):
            assert slots.held() == 4
    assert slots.held() == 0


def test_failed_joins_empty_a_bucket_that_refills() -> None:
    now = [0.0]
    limiter = JoinLimiter(burst=3, per_s=0.5, clock=lambda: now[0])
    for _ in range(3):
        limiter.check("peer-a")
        limiter.failed("peer-a")
    with pytest.raises(LimitExceeded, match="too many failed joins from peer-a"):
        limiter.check("peer-a")
    limiter.check("peer-b")  # others are not affected
    now[0] = 2.0  # one more try after 1 / per_s seconds
    limiter.check("peer-a")
    assert limiter.refused == 1


def test_an_overdue_message_cancels_the_call() -> None:
    watchdog = Watchdog()
    # a message in time disarms the first deadline, and so does close(): a later deadline
    # of the same watchdog fires, theirs do not (1 s of margin for the two calls)
    in_time, closed, later = threading.Event(), threading.Event(), threading.Event()
    fed = IdleTimeout(watchdog, in_time.set, first_s=1.0, idle_s=600)
    done = IdleTimeout(watchdog, closed.set, first_s=1.0)
    fed.fed()
    done.close()
    watchdog.arm(1.2, later.set)
    assert later.wait(30)
    assert not in_time.is_set() and not closed.is_set() and not fed.expired
    # after a message the next one has idle_s, not what was left of first_s
    cancelled = threading.Event()
    overdue = IdleTimeout(watchdog, cancelled.set, first_s=600, idle_s=0.2)
    overdue.fed()
    assert cancelled.wait(30) and overdue.expired
