"""What benchmarks/peers.py reads from the loss curves (wall time, validation loss, wire
bytes): the time a curve first reaches a loss, linear between its points, None where it
never does; the loss at a wall time; and the summary's per-seed targets (torchft's final
loss of the same seed, the quickest system's end) and ratios."""

from __future__ import annotations

import pytest

from benchmarks.peers import loss_at, summarize, time_to

CURVE = [[0.0, 5.0, 0.0], [2.0, 4.0, 10.0], [4.0, 3.0, 20.0], [6.0, 3.5, 30.0]]


def test_time_to_a_loss_is_interpolated_and_none_when_never_reached() -> None:
    assert time_to(CURVE, 4.0) == 2.0
    assert time_to(CURVE, 3.5) == pytest.approx(3.0)
    assert time_to(CURVE, 3.0) == 4.0  # reached at 4 s, even though the curve rises after
    assert time_to(CURVE, 5.5) == 0.0
    assert time_to(CURVE, 2.9) is None


def test_loss_at_a_time_is_interpolated_and_the_last_past_the_end() -> None:
    assert loss_at(CURVE, 1.0) == pytest.approx(4.5)
    assert loss_at(CURVE, 5.0) == pytest.approx(3.25)
    assert loss_at(CURVE, 60.0) == 3.5


def run(round_s: float, final: float, curve: list[list[float]]) -> dict:
    return {"round_s": round_s, "compute_s": 0.1, "final_val_loss": final,
            "wire_bytes_per_replica_round": 1e6 * round_s, "curve": curve}


def test_the_summary_takes_torchfts_loss_of_the_same_seed_and_the_quickest_end() -> None:
    runs = {
        "torchft": [run(4.0, 3.0, [[0, 5, 0], [40, 3.0, 1]]), run(4.0, 2.0, [[0, 5, 0], [40, 2.0, 1]])],
        "sparseloco": [run(0.5, 2.5, [[0, 5, 0], [5, 2.5, 1]]), run(0.5, 2.2, [[0, 5, 0], [5, 2.2, 1]])],
    }
    result = summarize(runs)
    # seed 0 reaches torchft's 3.0 at 4 s of its 5 (5 -> 2.5 over 5 s); seed 1 never reaches 2.0
    assert result["sparseloco"]["time_to_torchft_loss_s"] == [pytest.approx(4.0), None]
    assert result["torchft"]["time_to_torchft_loss_s"] == [40.0, 40.0]
    assert result["time_to_loss_ratio_vs_torchft"] is None
    # at 5 s (sparseloco's end) torchft is at 5 - 2 * 5 / 40 and 5 - 3 * 5 / 40
    assert result["torchft"]["loss_at_equal_time"] == pytest.approx((4.75 + 4.625) / 2)
    assert result["speedup_vs_torchft"] == 8.0
    assert result["loss_ratio_vs_torchft"] == pytest.approx((2.5 / 3.0 + 2.2 / 2.0) / 2, abs=1e-4)
    runs["sparseloco"][1] = run(0.5, 1.9, [[0, 5, 0], [5, 1.9, 1]])
    seed_1 = 5 * (5 - 2.0) / (5 - 1.9)  # 5 -> 1.9 over 5 s passes 2.0 at 4.84 s
    assert summarize(runs)["time_to_loss_ratio_vs_torchft"] == pytest.approx((4.0 / 40 + seed_1 / 40) / 2, abs=1e-4)
