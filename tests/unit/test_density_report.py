"""The chosen density where an operator reads it: `geoloco report`'s table of each worker's
density over the run (from metrics.jsonl's density_by_worker), and the worker's own
Prometheus gauge of its last frame's density."""

from __future__ import annotations

from pathlib import Path

from geoloco.report import Run, density_lines


def test_report_lists_each_workers_density_first_last_and_range(tmp_path: Path) -> None:
    rounds = [{"round": r, "density_by_worker": {"0": d0, "1": 0.015625}}
              for r, d0 in enumerate([0.015625, 0.03125, 0.0078125])]
    lines = density_lines([Run("auto", tmp_path, rounds)])
    assert lines[1] == "| run | worker | density first → last | range |"
    assert lines[3] == "| auto | 0 | 0.01562 → 0.00781 | 0.00781–0.03125 |"
    assert lines[4] == "| auto | 1 | 0.01562 → 0.01562 | 0.01562–0.01562 |"
    assert density_lines([Run("old", tmp_path, [{"round": 0}])]) == []  # lines without densities
