"""The simulated clock's event loop (benchmarks.simclock.SimClock) with the coordinator's
real close policies: a quorum closes a grace window after its quorum-th frame, a code at its
first decodable arrival, anything at the deadline; a worker's frame takes its bytes over its
link plus the delay; a worker that holds a round's result when it would start the round
skips it, and one whose result comes while it computes does not push. The workers' training
is the seam: ``play`` hands back a frame of known size, so every time below is exact."""

from __future__ import annotations

import pytest

from benchmarks.simclock import SimClock, known_scheme, scheme_overrides, transfer_s
from geoloco.config import load_config
from geoloco.coordinator.gradient_coding import make_code
from geoloco.coordinator.outer import Update
from geoloco.coordinator.rounds import close_policy
from geoloco.profiles import LinkProfile

EMPTY = Update([], "sum", 1.0)  # a round result of no frames: it reaches every worker at once


def clock_and_policy(workers: int, scheme: str, stragglers: list[str], **extra: object):
    cfg = load_config(overrides={"workers": workers, "coding.scheme": scheme,
                                 "coding.stragglers": 0 if scheme == "none" else 1,
                                 "stragglers.per_worker": stragglers, "network.wan": "unlimited",
                                 "coordinator.deadline_s": 30, **extra})
    code = make_code(scheme, workers, cfg.coding.tolerance(workers), cfg.coding.seed)
    return SimClock(cfg, compute_s=1.0), close_policy(code, cfg.coding)


def frames_of(size: int, played: list[int]):
    def play(i: int) -> tuple[bytes, list[int]]:
        played.append(i)
        return bytes(size), [i]
    return play


def test_transfer_is_the_bytes_at_the_rate_plus_the_one_way_delay() -> None:
    assert transfer_s(1000, LinkProfile.parse("8kbit/100ms")) == pytest.approx(1.1)
    assert transfer_s(10**9, LinkProfile.parse("unlimited")) == 0.0


def test_a_quorum_closes_its_grace_window_after_the_quorum_and_a_lagging_worker_skips() -> None:
    clock, policy = clock_and_policy(4, "quorum", ["none", "none", "none", "fixed:10"], **{"coding.grace_s": 2})
    played: list[int] = []
    decision = clock.close(0, policy, frames_of(100, played))
    first = clock.rounds[0]
    assert (first.closed_at, first.chosen, first.reason) == (pytest.approx(3.0), [0, 1, 2], "quorum")
    assert sorted(played) == [0, 1, 2, 3] and sorted(decision.coefficients) == [0, 1, 2]
    clock.published(EMPTY, frames_of(100, played))
    assert clock.ready_at == [pytest.approx(3.0)] * 3 + [pytest.approx(10.0)]  # its push took until 10

    played.clear()
    clock.close(1, policy, frames_of(100, played))
    second = clock.rounds[1]
    assert (second.closed_at, second.chosen) == (pytest.approx(6.0), [0, 1, 2])
    assert played == [0, 1, 2]  # worker 3 was still pushing round 0 at the close
    clock.published(EMPTY, frames_of(100, played))
    assert second.skipped == [3] and played == [0, 1, 2]  # round 1's result was in before it started
    assert clock.ready_at[3] == pytest.approx(10.0)


def test_a_code_closes_at_its_first_decodable_arrival() -> None:
    clock, policy = clock_and_policy(4, "pgc-fr", ["none", "fixed:5", "fixed:3", "fixed:5"])
    clock.close(0, policy, frames_of(100, []))
    closed = clock.rounds[0]
    assert closed.arrivals == {0: 1.0, 2: 3.0}  # what the close saw: 1 and 3 come at 5
    assert closed.closed_at == pytest.approx(3.0) and closed.reason == "decodable" and closed.chosen == [0, 2]


def test_at_the_deadline_the_round_closes_with_what_arrived() -> None:
    clock, policy = clock_and_policy(3, "none", ["none", "none", "fixed:100"])
    clock.close(0, policy, frames_of(100, []))
    closed = clock.rounds[0]
    assert (closed.closed_at, closed.reason, closed.chosen) == (pytest.approx(30.0), "deadline", [0, 1])


def test_frames_and_results_take_their_links() -> None:
    clock, policy = clock_and_policy(2, "none", ["none", "none"], **{"network.per_worker": ["8kbit/100ms", "80kbit/0ms"]})
    clock.close(0, policy, frames_of(1000, []))
    closed = clock.rounds[0]
    assert closed.arrivals == {0: pytest.approx(2.1), 1: pytest.approx(1.1)}  # 1 s compute + the push
    assert closed.closed_at == pytest.approx(2.1)


def test_a_worker_whose_result_comes_while_it_computes_does_not_push() -> None:
    clock, policy = clock_and_policy(4, "quorum", ["none", "none", "none", "fixed:4"], **{"coding.grace_s": 1})
    clock.close(0, policy, frames_of(100, []))
    assert clock.rounds[0].closed_at == pytest.approx(2.0)
    clock.pushed_at[3] = 99.0  # a push that would take long: it is never made
    clock.published(EMPTY, frames_of(100, []))
    assert clock.ready_at[3] == pytest.approx(4.0)  # it encoded at 4, when the result was in


def test_only_non_overlapped_rounds_are_modelled() -> None:
    cfg = load_config(overrides={"workers": 2, "outer.overlap": "delayed"})
    with pytest.raises(ValueError, match="overlap"):
        SimClock(cfg, compute_s=1.0)


def test_a_quorum_variant_names_its_grace_multiple() -> None:
    assert scheme_overrides("quorum:0.25") == {"coding.scheme": "quorum", "coding.stragglers": 1,
                                                "coding.grace_spread": 0.25}
    assert scheme_overrides("none") == {"coding.scheme": "none", "coding.stragglers": 0}
    assert scheme_overrides("quorum:0:drop")["coding.late"] == "drop"
    assert all(map(known_scheme, ["quorum:0", "quorum:1:keep", "quorum:0.5:drop", "pgc-fr"]))
    assert not any(map(known_scheme, ["quorum:x", "quorum:-1", "quorum:1:lose", "quorum:1:drop:2",
                                      "pgc-fr:0.5", "bogus"]))


@pytest.mark.parametrize(("budget", "rounds_played"), [({"until": 2.5}, 2), ({"until": 2.0}, 1),
                                                       ({"max_rounds": 3}, 3)])
def test_a_run_ends_once_its_time_budget_is_spent_or_its_rounds_played(budget: dict, rounds_played: int) -> None:
    cfg = load_config(overrides={"workers": 2, "network.wan": "unlimited"})
    clock = SimClock(cfg, compute_s=2.0, **budget)  # every round: 2 s of compute, nothing else
    policy = close_policy(make_code("none", 2, 0), cfg.coding)
    for round_ in range(5):
        clock.close(round_, policy, frames_of(100, []))
        clock.published(EMPTY, frames_of(100, []))
        if clock.over():
            break
    assert len(clock.rounds) == rounds_played
    assert [r.closed_at for r in clock.rounds] == pytest.approx([2.0, 4.0, 6.0][:rounds_played])
