"""Stopping real runs: one Ctrl-C (SIGINT to the process group) on `geoloco local` stops
every process within seconds without a traceback, the coordinator checkpoints the open
round, `local` prints its summary, and `geoloco local --resume` finishes the run with
every round once; a second Ctrl-C forces the stop and leaves no process behind."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from run_processes import (
    SMALL,
    Processes,
    final_coordinator_digest,
    metrics,
    set_flags,
    wait_until,
    worker_reports,
)

from geoloco.coordinator import checkpoint

pytestmark = pytest.mark.slow
ROUNDS = 6


def local_args(run_dir: Path, *extra: str) -> list[str]:
    return ["local", "--workers", "2", "--rounds", str(ROUNDS), "--wan", "unlimited",
            "--run-dir", str(run_dir), "--stall-timeout", "60", "--progress", "lines", *extra,
            *set_flags({**SMALL, "coordinator.checkpoint_every": "0"})]


def no_tracebacks(run_dir: Path, processes: Processes, name: str) -> None:
    logs = {p.name: p.read_text(errors="replace") for p in (run_dir / "logs").glob("*.log")}
    logs[name] = processes.log(name)
    for log_name, text in logs.items():
        assert "Traceback" not in text, f"{log_name}:\n{text[-3000:]}"


def group_gone(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


def test_one_ctrl_c_checkpoints_and_local_resume_finishes_the_run(processes: Processes,
                                                                  tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    local = processes.start("local", local_args(run_dir))
    wait_until(lambda: len(metrics(run_dir)) >= 2, 180, "two rounds")
    os.killpg(local.pid, signal.SIGINT)  # what Ctrl-C on a terminal does
    assert processes.wait("local", timeout=60) == 130
    wait_until(lambda: group_gone(local.pid), 10, "every process of the run to end")
    no_tracebacks(run_dir, processes, "local")
    done = len(metrics(run_dir))
    newest = checkpoint.list_checkpoints(run_dir)[-1]
    assert checkpoint.load(newest).round == done  # the stop checkpointed the open round
    assert "checkpointing round" in (run_dir / "logs" / "coordinator.log").read_text()
    assert f"summary of {run_dir}" in processes.log("local")

    processes.start("resumed", local_args(run_dir, "--resume"))
    assert processes.wait("resumed", timeout=240) == 0, processes.log("resumed")[-4000:]
    assert [m["round"] for m in metrics(run_dir)] == list(range(ROUNDS))
    round_, digest = final_coordinator_digest(run_dir)
    assert round_ == ROUNDS
    reports = worker_reports(run_dir / "workers")
    assert sorted(reports) == [0, 1]
    assert all(r["status"] == "finished" and r["digest"] == digest for r in reports.values())
    assert "resumed from checkpoint at round" in (run_dir / "logs" / "coordinator.log").read_text()


def test_a_second_ctrl_c_forces_the_stop_and_leaves_no_process(processes: Processes,
                                                               tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    local = processes.start("local", local_args(run_dir))
    wait_until(lambda: len(metrics(run_dir)) >= 1, 180, "round 0")
    os.killpg(local.pid, signal.SIGINT)
    time.sleep(0.3)
    os.killpg(local.pid, signal.SIGINT)
    assert processes.wait("local", timeout=30) == 130
    wait_until(lambda: group_gone(local.pid), 10, "every process of the run to end")
