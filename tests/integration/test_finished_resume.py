"""A resume of a finished run, against real processes: `geoloco local --resume` and
`geoloco coordinator --resume` in a run dir whose rounds are all done say so and exit 0 at
once, start no worker and wait for no Join, and leave every file of the run as it was."""

from __future__ import annotations

from pathlib import Path

import pytest
from run_processes import SMALL, Processes, set_flags

pytestmark = pytest.mark.slow
ROUNDS = 2
FAST = {**SMALL, "task.seq_len": "16", "task.batch_size": "4", "inner.steps": "4",
        "inner.warmup_steps": "2", "coordinator.checkpoint_every": "0"}


def files(run_dir: Path) -> dict[str, bytes]:
    """Every file of the run but the logs, by path."""
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*"))
            if p.is_file() and "logs" not in p.parts}


def test_resuming_a_finished_run_says_so_and_exits_at_once(processes: Processes, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    local = ["local", "--workers", "2", "--rounds", str(ROUNDS), "--wan", "unlimited",
             "--run-dir", str(run_dir), "--progress", "lines", *set_flags(FAST)]
    processes.start("local", local)
    assert processes.wait("local", timeout=240) == 0, processes.log("local")[-3000:]
    before = files(run_dir)
    worker_logs = sorted(p.name for p in (run_dir / "logs").iterdir())

    processes.start("local-resume", [*local, "--resume"])
    assert processes.wait("local-resume", timeout=60) == 0, processes.log("local-resume")[-3000:]
    assert f"all {ROUNDS} rounds of the run in {run_dir} are done" in processes.log("local-resume")
    processes.start("coordinator-resume", ["coordinator", "--listen", "127.0.0.1:0", "--workers", "2",
                                           "--rounds", str(ROUNDS), "--run-dir", str(run_dir),
                                           "--resume", *set_flags(FAST)])
    assert processes.wait("coordinator-resume", timeout=60) == 0
    log = processes.log("coordinator-resume")
    assert f"all {ROUNDS} rounds of the run in {run_dir} are done" in log and "listening" not in log
    assert files(run_dir) == before
    assert sorted(p.name for p in (run_dir / "logs").iterdir()) == worker_logs
