"""Operator mistakes against real processes: a second coordinator on a busy port exits
non-zero instead of sharing it (SO_REUSEPORT off), and `geoloco local` on a folder with
run files but no GeoLoCo marker refuses (exit 2) and leaves its files as they were."""

from __future__ import annotations

from pathlib import Path

import pytest
from run_processes import SMALL, Processes, coordinator_port, set_flags

pytestmark = pytest.mark.slow


def coordinator_args(run_dir: Path, listen: str) -> list[str]:
    return ["coordinator", "--listen", listen, "--workers", "2", "--rounds", "2",
            "--run-dir", str(run_dir), *set_flags(SMALL)]


def test_a_second_coordinator_on_a_busy_port_exits_non_zero(processes: Processes, tmp_path: Path) -> None:
    processes.start("first", coordinator_args(tmp_path / "first", "127.0.0.1:0"))
    listen = f"127.0.0.1:{coordinator_port(tmp_path / 'first')}"
    processes.start("second", coordinator_args(tmp_path / "second", listen))
    assert processes.wait("second", timeout=90) == 1
    log = processes.log("second")
    assert "cannot listen on coordinator.listen" in log and "Traceback" not in log, log[-2000:]
    assert processes.procs["first"].poll() is None  # the first one still serves


def test_local_on_a_previous_run_refuses_and_keeps_its_files(processes: Processes, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints" / "round_00000005").mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text('{"round": 4}\n')
    processes.start("local", ["local", "--run-dir", str(run_dir), "--workers", "2"])
    assert processes.wait("local", timeout=60) == 2
    assert "holds metrics.jsonl, checkpoints but no geoloco-run.json" in processes.log("local")
    assert (run_dir / "metrics.jsonl").read_text() == '{"round": 4}\n'
    assert sorted(p.name for p in run_dir.iterdir()) == ["checkpoints", "metrics.jsonl"]
