"""The quorum baseline (coding.scheme "quorum"; coordinator/rounds.py QuorumPolicy), pure:
a round closes with every worker in, or once the quorum is in and the grace window has
passed since the quorum-th frame, never before; at the deadline with what arrived. The
grace is fixed or a multiple of the recent median arrival spread, and until a round has
been seen an adaptive quorum waits for all. The update is the plain mean of the arrived
frames (equal token weights); a frame the round closed without is kept in its worker's
error feedback or dropped, as configured."""

from __future__ import annotations

import time

import pytest

from geoloco.config import ConfigError, RunConfig, validate
from geoloco.coordinator.gradient_coding import make_code
from geoloco.coordinator.outer import mean_weights
from geoloco.coordinator.rounds import (
    Arrival,
    ArrivalTimes,
    CodePolicy,
    QuorumPolicy,
    RoundState,
    close_policy,
)
from geoloco.protos import geoloco_pb2 as pb

N = 4


def policy(quorum: int = 3, grace_s: float | None = 1.0, **kw) -> QuorumPolicy:
    return QuorumPolicy(make_code("quorum", N, N - quorum), quorum, grace_s, **kw)


def times(now: float, **arrived: float) -> ArrivalTimes:
    return ArrivalTimes(now, {int(k[1:]): t for k, t in arrived.items()})


def test_the_quorum_closes_once_the_grace_window_has_passed_not_before() -> None:
    p = policy(quorum=3, grace_s=1.0)
    t = times(1.49, w0=0.1, w1=0.2, w2=0.5)  # the quorum-th frame came at 0.5
    assert p.decide([0, 1, 2], False, t) is None
    decision = p.decide([0, 1, 2], False, times(1.5, w0=0.1, w1=0.2, w2=0.5))
    assert decision is not None and decision.reason == "quorum"
    assert decision.coefficients == {0: 1.0, 1: 1.0, 2: 1.0} and decision.covered == 3
    # the window counts from the quorum-th frame, not from the last one
    assert p.decide([0, 1, 2, 3][:3], False, times(1.5, w0=0.1, w1=0.5, w2=1.4)) is None


def test_below_the_quorum_it_waits_until_the_deadline_and_all_in_closes_at_once() -> None:
    p = policy(quorum=3, grace_s=0.0)
    assert p.decide([0, 1], False, times(100.0, w0=0.1, w1=0.2)) is None
    late = p.decide([0, 1], True, times(100.0, w0=0.1, w1=0.2))
    assert late.reason == "deadline" and late.coefficients == {0: 1.0, 1: 1.0} and late.covered == 2
    assert p.decide([], True, times(100.0)).coefficients == {}
    everyone = policy(quorum=3, grace_s=60.0).decide(list(range(N)), False, times(0.3, w0=0, w1=0, w2=0, w3=0.3))
    assert everyone.reason == "all arrived" and everyone.covered == N


def test_the_adaptive_grace_waits_for_all_until_a_round_was_seen_then_follows_the_median_spread() -> None:
    p = policy(quorum=3, grace_s=None, grace_spread=2.0)
    assert p.grace() is None
    assert p.decide([0, 1, 2], False, times(1e6, w0=0.0, w1=0.0, w2=0.0)) is None  # nothing learnt yet
    for spread in (0.4, 1.0, 0.6):  # first frame to last, per round
        p.observe(times(5.0, w0=1.0, w1=1.0 + spread / 2, w2=1.0 + spread))
    assert p.grace() == pytest.approx(2.0 * 0.6)
    assert p.decide([0, 1, 2], False, times(2.19, w0=0.5, w1=0.9, w2=1.0)) is None
    assert p.decide([0, 1, 2], False, times(2.21, w0=0.5, w1=0.9, w2=1.0)).reason == "quorum"
    for _ in range(20):  # only the recent rounds count
        p.observe(times(5.0, w0=0.0, w1=0.1))
    assert p.grace() == pytest.approx(2.0 * 0.1)


@pytest.mark.parametrize(("late", "kind"), [("keep", pb.Settlement.ADD_BACK), ("drop", pb.Settlement.RESTORE)])
def test_late_work_is_kept_in_the_error_feedback_or_dropped(late: str, kind: int) -> None:
    p = policy(quorum=3, grace_s=0.0, late=late)
    decision = p.decide([0, 2, 3], False, times(1.0, w0=0.1, w2=0.2, w3=0.3))
    assert p.settlement(decision, 1).kind == kind
    assert {p.settlement(decision, i).kind for i in (0, 2, 3)} == {pb.Settlement.KEEP}


def test_the_update_is_the_mean_of_the_arrived_frames() -> None:
    decision = policy(quorum=2, grace_s=0.0).decide([1, 3], False, times(1.0, w1=0.1, w3=0.2))
    assert mean_weights(decision, "mean_kept") == ([1.0, 1.0], "mean_kept")  # each frame 1 of 2: the mean over keepers
    assert mean_weights(decision, "mean") == ([0.5, 0.5], "sum")


def test_a_round_state_closes_by_the_clock() -> None:
    """RoundState hands the policy its arrivals' times since the open (no sleeping: the
    times are set as if the round had opened 10 s ago)."""
    p = policy(quorum=2, grace_s=3.0)
    rs = RoundState(0, deadline_s=600.0)
    rs.open()
    rs.opened_at = time.monotonic() - 10.0
    for worker, at in ((0, 1.0), (1, 2.0)):
        frame = type("F", (), {"round": 0})()
        rs.accept(Arrival(worker, b"", frame, received_at=rs.opened_at + at))
    decision = rs.try_close(p)
    assert decision is not None and decision.reason == "quorum"
    p.observe(rs.times())
    assert p.spreads == [pytest.approx(1.0)]


def test_the_config_names_the_quorum_and_the_run_gets_its_policy() -> None:
    cfg = RunConfig()
    cfg.workers, cfg.coding.scheme, cfg.coding.quorum = 5, "quorum", 3
    validate(cfg)
    assert cfg.coding.tolerance(5) == 2
    code = make_code("quorum", 5, cfg.coding.tolerance(5))
    built = close_policy(code, cfg.coding)
    assert isinstance(built, QuorumPolicy) and built.quorum == 3 and built.late == "drop" and built.grace_s is None
    assert built.grace_spread == 0.0  # close at the quorum: the tuned default (docs/decisions.md)
    assert isinstance(close_policy(make_code("ignore", 5, 1), cfg.coding), CodePolicy)
    cfg.coding.quorum, cfg.coding.stragglers = None, 1
    assert close_policy(make_code("quorum", 5, cfg.coding.tolerance(5)), cfg.coding).quorum == 4


@pytest.mark.parametrize(("fields", "message"), [
    ({"quorum": 6}, "coding.quorum"),
    ({"quorum": 2.5}, "whole number"),
    ({"quorum": 3, "stragglers": 1}, "disagree"),
    ({"scheme": "ignore", "quorum": 3, "stragglers": 2}, "for coding.scheme 'quorum'"),
    ({"grace_s": -1.0}, "coding.grace_s"),
    ({"grace_spread": -0.5}, "coding.grace_spread"),
    ({"late": "later"}, "coding.late"),
])
def test_bad_quorum_settings_name_the_field(fields: dict, message: str) -> None:
    cfg = RunConfig()
    cfg.workers, cfg.coding.scheme = 5, "quorum"
    for name, value in fields.items():
        setattr(cfg.coding, name, value)
    with pytest.raises(ConfigError, match=message):
        validate(cfg)
