"""A real short `geoloco local` run shows its start-up phases and one plain line per round
within 80 columns when its output is no terminal, and writes timestamps, elapsed time and
the learning rate into metrics.jsonl; `geoloco report` on it and a DiLoCo run draws PNGs
with a line of each run's colour. About 50 s."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from run_processes import SMALL, set_flags

import geoloco
from geoloco.config import RunConfig, validate
from geoloco.report import DPI, FIGSIZE, RUN_COLORS
from geoloco.schedule import lr_at

pytestmark = pytest.mark.slow

ROUNDS = 3
TOKEN = "report-test"


@pytest.fixture(scope="module")
def sparseloco_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    run_dir = tmp_path_factory.mktemp("runs") / "sparseloco"
    proc = subprocess.run(
        [sys.executable, "-m", "geoloco.cli", "local", "--workers", "2", "--rounds", str(ROUNDS),
         "--wan", "1gbit/1ms", "--run-dir", str(run_dir),
         *set_flags({**SMALL, "coordinator.val_every": "1"})],  # a loss point every round, whatever the timing
        capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return run_dir, proc.stdout


@pytest.fixture(scope="module")
def diloco_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The dense baseline, in this process: a coordinator and two worker threads."""
    run_dir = tmp_path_factory.mktemp("runs") / "diloco"
    cfg = validate(RunConfig.from_dict({
        "workers": 2, "rounds": ROUNDS, "run_dir": str(run_dir),
        "task": {"model": "gpt-tiny", "seq_len": 32, "batch_size": 8, "val_windows": 16, "corpus_bytes": 300_000},
        "inner": {"steps": 8, "warmup_steps": 4}, "compression": {"method": "diloco"},
        "coordinator": {"listen": "127.0.0.1:0", "token": TOKEN, "checkpoint_every": 0, "val_every": 1}}))
    coordinator = geoloco.Coordinator(cfg)
    coordinator.start()
    workers = [geoloco.Worker(f"127.0.0.1:{coordinator.port}", TOKEN, device="cpu").start() for _ in range(2)]
    try:
        assert coordinator.wait(timeout=240)
        assert all(w.wait(timeout=60) and w.exit_code == 0 for w in workers)
    finally:
        for w in workers:
            w.stop(timeout=10)
        coordinator.stop(grace=0.5)
    return run_dir


def test_local_run_prints_its_phases_and_a_line_per_round_in_80_columns(sparseloco_run) -> None:
    _, stdout = sparseloco_run
    lines = stdout.splitlines()
    for phase in ("starting the coordinator", "coordinator up on 127.0.0.1:", "2 workers joined",
                  "round 0 running"):
        assert any(phase in line for line in lines), f"no {phase!r} in:\n{stdout}"
    rounds = [line for line in lines if line.startswith("round ") and "/" in line.split()[1]]
    assert [line.split()[1] for line in rounds] == [f"{r}/{ROUNDS - 1}" for r in range(ROUNDS)]  # from 0
    assert all(" eta " in line and "val " in line for line in rounds)
    shown = lines[:next(i for i, line in enumerate(lines) if line.startswith("summary of"))]
    assert max(len(line) for line in shown) <= 80, max(shown, key=len)
    assert "\r" not in stdout  # no bar drawn into a pipe


def test_metrics_lines_carry_wall_time_elapsed_time_and_the_learning_rate(sparseloco_run) -> None:
    run_dir, _ = sparseloco_run
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    cfg = validate(RunConfig.from_dict(json.loads((run_dir / "config.json").read_text())))
    times = [m["time"] for m in lines]
    elapsed = [m["elapsed_seconds"] for m in lines]
    assert times == sorted(times) and elapsed == sorted(elapsed) and elapsed[0] > 0
    assert times[-1] - times[0] == pytest.approx(elapsed[-1] - elapsed[0], abs=0.5)
    steps = cfg.inner.steps
    assert [m["lr"] for m in lines] == [pytest.approx(lr_at(cfg.inner, r * steps, ROUNDS * steps))
                                        for r in range(ROUNDS)]
    for m in lines:  # each arrived worker's compute + send + wait is the round's time
        for w in map(str, m["arrived"]):
            parts = m["compute_seconds_by_worker"][w] + m["send_seconds_by_worker"][w] + m["wait_seconds_by_worker"][w]
            assert parts == pytest.approx(m["round_seconds"], abs=0.05)


def _pixels_of(png: Path, color: str) -> int:
    import matplotlib.image

    image = matplotlib.image.imread(png)[..., :3]
    rgb = np.array([int(color[i:i + 2], 16) / 255 for i in (1, 3, 5)])
    return int((np.abs(image - rgb).max(axis=-1) < 0.08).sum())


def _empty_png_bytes() -> int:
    """The size of a PNG with labelled axes and nothing drawn, at the report's size."""
    import io

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=FIGSIZE)
    ax.set(title="title", xlabel="x", ylabel="y")
    buf = io.BytesIO()
    fig.savefig(buf, dpi=DPI, format="png")
    plt.close(fig)
    return len(buf.getvalue())


def _legend_entry_pixels(color: str, path: Path) -> int:
    """Pixels of ``color`` in a figure of the report's size whose only drawing is one
    legend entry of a run's solid loss line, as plot_loss draws it (width 2, fontsize 8)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=FIGSIZE)
    ax.plot([], [], "-", color=color, linewidth=2, label="run val")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return _pixels_of(path, color)


def test_report_draws_every_run_and_writes_markdown(sparseloco_run, diloco_run, tmp_path) -> None:
    out = tmp_path / "report"
    proc = subprocess.run([sys.executable, "-m", "geoloco.cli", "report", str(sparseloco_run[0]), str(diloco_run),
                           "--out", str(out)], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    pngs = sorted(p.name for p in out.glob("*.png"))
    assert pngs == sorted(["loss-vs-time.png", "loss-vs-bytes.png",
                           *(f"{run}-{kind}.png" for run in ("sparseloco", "diloco")
                             for kind in ("timeline", "bytes", "round-time"))])
    empty = _empty_png_bytes()  # about 7.4 kB at 640 x 360
    assert all((out / p).stat().st_size > empty for p in pngs), empty
    for plot in ("loss-vs-time.png", "loss-vs-bytes.png"):
        for color in RUN_COLORS[:2]:  # a line of each run, not only its legend entries
            # a run's legend is its val entry (about 40 pixels of its colour at FIGSIZE and
            # DPI) and its dotted train entry (about 12). A run's line spans only its own
            # share of the axes: on loss-vs-bytes (log x) each run's 3 points (cumulative
            # bytes, 1x to 3x) cover half a decade of the ~3 the two runs span; DiLoCo's drew
            # 186 pixels once. Over 3 val legend entries is a drawn line.
            entry = _legend_entry_pixels(color, tmp_path / "legend.png")
            assert entry > 0, color  # the measure sees the colour
            assert _pixels_of(out / plot, color) > 3 * entry, (plot, color, entry)
    text = (out / "report.md").read_text()
    assert "| sparseloco | sparseloco | 3 |" in text and "| diloco | diloco | 3 |" in text
    for p in pngs:
        assert f"]({p})" in text


def test_report_of_a_folder_without_metrics_is_a_clear_error(tmp_path) -> None:
    proc = subprocess.run([sys.executable, "-m", "geoloco.cli", "report", str(tmp_path)],
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 1
    assert "no metrics.jsonl" in proc.stderr
