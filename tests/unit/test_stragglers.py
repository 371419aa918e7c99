"""Straggler models: determinism, distribution sanity, trace replay and profile parsing."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from geoloco.profiles import StragglerProfile, StragglerProfileError
from geoloco.profiles import parse_straggler_profile as parse_profile
from geoloco.worker.stragglers import MarkovBursty, make_straggler

ROUNDS = 20_000


def _delays(profile: str, rounds: int = ROUNDS, compute_s: float = 1.0) -> np.ndarray:
    model = make_straggler(profile, worker_id=0, seed=0)
    return np.array([model.extra_delay(t, compute_s) for t in range(rounds)])


def test_none_and_fixed_slowdown() -> None:
    assert make_straggler("none", 3, 0).extra_delay(5, 2.0) == 0.0
    fixed = make_straggler("fixed:4", 1, 0)
    assert fixed.extra_delay(0, 0.5) == pytest.approx(1.5)
    assert fixed.extra_delay(9, 2.0) == pytest.approx(6.0)


@pytest.mark.parametrize("profile", ["exp:0.1:0.5", "markov:0.1:0.3:4"])
def test_same_seed_same_delays_any_query_order(profile: str) -> None:
    rounds = list(range(50))
    forward = [make_straggler(profile, 2, 7).extra_delay(t, 1.0) for t in rounds]
    backward_model = make_straggler(profile, 2, 7)
    backward = [backward_model.extra_delay(t, 1.0) for t in reversed(rounds)][::-1]
    assert forward == backward
    other_seed = [make_straggler(profile, 2, 8).extra_delay(t, 1.0) for t in rounds]
    other_worker = [make_straggler(profile, 3, 7).extra_delay(t, 1.0) for t in rounds]
    assert forward != other_seed and forward != other_worker


def test_shifted_exponential_mean_and_shift() -> None:
    delays = _delays("exp:0.1:0.5")
    assert delays.min() >= 0.1
    # mean 0.6, standard error 0.5 / sqrt(20000) ~ 0.0035
    assert delays.mean() == pytest.approx(0.6, abs=0.02)
    assert np.median(delays - 0.1) == pytest.approx(0.5 * np.log(2), abs=0.02)
    assert np.all(_delays("exp:0.25:0", rounds=100) == 0.25)


def test_markov_stationary_fraction_and_burstiness() -> None:
    delays = _delays("markov:0.1:0.3:4", compute_s=1.0)
    assert set(np.unique(delays)) <= {0.0, 3.0}
    slow = delays > 0
    assert slow.mean() == pytest.approx(0.1 / (0.1 + 0.3), abs=0.03)
    stay_slow = np.mean(slow[1:][slow[:-1]])  # P(slow at t+1 | slow at t) = 1 - p_fast
    assert stay_slow == pytest.approx(0.7, abs=0.03)
    become_slow = np.mean(slow[1:][~slow[:-1]])  # P(slow | fast) = p_slow
    assert become_slow == pytest.approx(0.1, abs=0.02)


def test_markov_degenerate_chains() -> None:
    assert MarkovBursty(0.0, 0.0, 4.0, 0, 0).stationary_slow == 0.0
    assert not _delays("markov:0:0:4", rounds=200).any()
    assert np.all(_delays("markov:1:0:2", rounds=200) == 1.0)


def test_trace_replay_csv_and_json(tmp_path: Path) -> None:
    csv_path = tmp_path / "delays.csv"
    csv_path.write_text("0.0,0.5,1.0\n2.0, 0.25 ,0\n")
    row1 = make_straggler(f"trace:{csv_path}", 1, 0)
    assert [row1.extra_delay(t, 9.0) for t in range(5)] == [2.0, 0.25, 0.0, 2.0, 0.25]
    json_path = tmp_path / "delays.json"
    json_path.write_text(json.dumps([[1, 2], [3, 4], [5, 6]]))
    row2 = make_straggler(f"trace:{json_path}", 2, 0)
    assert [row2.extra_delay(t, 0.0) for t in range(3)] == [5.0, 6.0, 5.0]


def test_trace_errors_name_the_problem(tmp_path: Path) -> None:
    with pytest.raises(StragglerProfileError, match="cannot read straggler trace"):
        make_straggler(f"trace:{tmp_path / 'missing.csv'}", 0, 0)
    short = tmp_path / "short.csv"
    short.write_text("1,2\n3,4\n")
    with pytest.raises(StragglerProfileError, match=r"workers 0\.\.1, not worker 2"):
        make_straggler(f"trace:{short}", 2, 0)
    bad = tmp_path / "bad.csv"
    bad.write_text("1,-2\n")
    with pytest.raises(StragglerProfileError, match=r"row 0 round 1: '-2'"):
        make_straggler(f"trace:{bad}", 0, 0)
    not_table = tmp_path / "flat.json"
    not_table.write_text("[1, 2]")
    with pytest.raises(StragglerProfileError, match="list of lists"):
        make_straggler(f"trace:{not_table}", 0, 0)


def test_parse_profile_forms() -> None:
    assert parse_profile("none") == StragglerProfile("none")
    assert parse_profile(" fixed:4 ") == StragglerProfile("fixed", (4.0,))
    assert parse_profile("exp:0.1:0.5") == StragglerProfile("exp", (0.1, 0.5))
    assert parse_profile("shifted-exponential:0:1") == StragglerProfile("exp", (0.0, 1.0))
    assert parse_profile("markov:0.1:0.3:4") == StragglerProfile("markov", (0.1, 0.3, 4.0))
    assert parse_profile("trace:/a/b:c.csv") == StragglerProfile("trace", (), "/a/b:c.csv")


@pytest.mark.parametrize(
    ("profile", "why"),
    [
        ("slow:4", "unknown kind 'slow'"),
        ("fixed", "fixed takes 1 value"),
        ("fixed:0.5", "FACTOR must be >= 1"),
        ("fixed:x", "'x' is not a number"),
        ("fixed:inf", "not a finite number"),
        ("exp:0.1", "exp takes 2 value"),
        ("exp:-1:0.5", "T0 and MEAN must be >= 0"),
        ("markov:0.1:1.5:4", r"P_SLOW and P_FAST must be in \[0, 1\]"),
        ("markov:0.1:0.3:0.5", "FACTOR must be >= 1"),
        ("none:3", "none takes 0 value"),
        ("trace:", "trace needs a file path"),
    ],
)
def test_parse_errors_name_the_allowed_forms(profile: str, why: str) -> None:
    with pytest.raises(StragglerProfileError, match=why) as info:
        parse_profile(profile)
    assert "allowed forms: none, fixed:FACTOR, exp:T0:MEAN" in str(info.value)


def test_make_straggler_rejects_negative_ids() -> None:
    with pytest.raises(ValueError, match="worker_id=-1"):
        make_straggler("exp:0:1", -1, 0)
    with pytest.raises(ValueError, match="round_index must be >= 0, got -3"):
        make_straggler("exp:0:1", 0, 0).extra_delay(-3, 1.0)


def test_slow_blocks_alternate_fast_and_slow_blocks_of_rounds() -> None:
    model = make_straggler("blocks:4:3", 0, 0)
    assert [model.extra_delay(t, 1.0) for t in range(12)] == [0.0] * 3 + [3.0] * 3 + [0.0] * 3 + [3.0] * 3
    for bad in ("blocks:0.5:3", "blocks:4:0", "blocks:4:1.5", "blocks:4"):
        with pytest.raises(StragglerProfileError):
            parse_profile(bad)


def test_the_emulated_extra_time_is_spent_computing() -> None:
    """occupy keeps the thread busy (a sleep would leave its CPU time near zero)."""
    import time

    from geoloco.worker.stragglers import occupy

    wall, cpu = time.monotonic(), time.thread_time()
    occupy(0.2)
    assert time.monotonic() - wall >= 0.2
    assert time.thread_time() - cpu > 0.01
