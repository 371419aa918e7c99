"""One numbering of rounds (docs/protocol.md, "Round numbers"): rounds are numbered from 0
in the terminal as in the logs, metrics.jsonl, the report and the wire; a checkpoint
``round_N`` is the model before round N; the report's round axes have whole ticks and its
loss-against-time line does not draw the start-up as training."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from geoloco.coordinator import checkpoint  # noqa: E402
from geoloco.progress import round_line  # noqa: E402
from geoloco.report import Run, _label_rounds, loss_series  # noqa: E402


def line(r: int, rounds: int) -> str:
    return round_line({"round": r, "val_loss": 5.0, "train_loss": 4.0, "upload_bytes_per_worker": 1000,
                       "round_seconds": 2.0}, rounds, 10.0, 20.0)


def test_the_round_lines_number_rounds_from_0_as_metrics_jsonl_does() -> None:
    assert line(0, 20).startswith("round  0/19  val 5.0000")
    assert line(19, 20).startswith("round 19/19  ")
    assert line(0, 1).startswith("round 0/0  ")
    assert len(line(999_999, 1_000_000)) <= 80


def test_a_checkpoint_is_named_by_the_round_it_comes_before() -> None:
    assert checkpoint.starts(0) == "before round 0; no round done yet"
    assert checkpoint.starts(20) == "before round 20; rounds 0-19 done"


def run(rounds: list[dict], initial: float | None = 6.0) -> Run:
    return Run("r", Path("r"), rounds, {}, {"initial_val_loss": initial} if initial is not None else {})


def test_the_start_up_is_drawn_flat_and_training_starts_at_round_0s_opening() -> None:
    r = run([{"round": 0, "val_loss": 5.0, "round_seconds": 10.0, "elapsed_seconds": 40.0},
             {"round": 1, "val_loss": 4.0, "round_seconds": 10.0, "elapsed_seconds": 50.0}])
    start_up, points = loss_series(r, "val_loss", "time")
    assert start_up == [(0.0, 6.0), (30.0, 6.0)]  # 30 s of start-up: the loss did not move
    assert points == [(30.0, 6.0), (40.0, 5.0), (50.0, 4.0)]
    assert loss_series(r, "train_loss", "time")[0] == []
    assert loss_series(r, "val_loss", "bytes")[0] == []
    resumed = run([{"round": 7, "val_loss": 3.0, "round_seconds": 10.0, "elapsed_seconds": 90.0}])
    assert loss_series(resumed, "val_loss", "time") == ([], [(90.0, 3.0)])  # no start-up line mid-run


def test_round_axes_tick_whole_rounds() -> None:
    fig, ax = plt.subplots()
    ax.plot([0, 1, 2], [1, 2, 3], label="x")
    _label_rounds(ax, "bytes", "t")
    locator = ax.xaxis.get_major_locator()
    assert isinstance(locator, MaxNLocator)
    assert all(float(t).is_integer() for t in locator.tick_values(0, 2))
    plt.close(fig)
