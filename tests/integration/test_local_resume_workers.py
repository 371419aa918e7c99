"""`geoloco local --resume` restores the workers as well as the coordinator, against real
processes: `local` gives each worker a --state-dir under the run dir (worker-state/worker-I),
so after one Ctrl-C the resumed workers reclaim their ids with the secret saved there and
restore their error feedback, AdamW state and data positions, and the run finishes on one
digest."""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import pytest
import torch
from run_processes import (
    SMALL,
    Processes,
    final_coordinator_digest,
    metrics,
    set_flags,
    wait_until,
    worker_reports,
)

from geoloco.run_dir import worker_state_dir

pytestmark = pytest.mark.slow
ROUNDS = 8
FAST = {**SMALL, "task.seq_len": "16", "task.batch_size": "4", "inner.steps": "4",
        "inner.warmup_steps": "2", "coordinator.checkpoint_every": "0", "worker.state_every": "1"}


def test_local_resume_restores_the_workers_error_feedback(processes: Processes, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    local = ["local", "--workers", "2", "--rounds", str(ROUNDS), "--wan", "unlimited/100ms",
             "--run-dir", str(run_dir), "--stall-timeout", "60", "--progress", "lines", *set_flags(FAST)]
    first = processes.start("local", local)
    wait_until(lambda: len(metrics(run_dir)) >= 2, 180, "two rounds")
    os.killpg(first.pid, signal.SIGINT)  # one Ctrl-C
    assert processes.wait("local", timeout=60) == 130
    assert "--resume" in processes.log("local").split("the run goes on from its last checkpoint with:")[-1]
    saved = {}
    for i in range(2):
        state = torch.load(worker_state_dir(run_dir, i) / f"worker-{i}.state.pt", weights_only=True)
        saved[i] = state["round"]
        assert any(t.abs().sum() > 0 for t in state["error_feedback"]["error_feedback"]), "no error feedback saved"

    processes.start("resumed", [*local, "--resume"])
    assert processes.wait("resumed", timeout=240) == 0, processes.log("resumed")[-3000:]
    resumed_at = re.search(r"round (\d+) running", processes.log("resumed"))
    assert resumed_at and int(resumed_at.group(1)) >= 2, processes.log("resumed")[:2000]  # not "round 0"
    for i in range(2):
        log = (run_dir / "logs" / f"worker-{i}.log").read_text()
        assert f"reclaiming worker {i}" in log
        assert f"restored the local state of round {saved[i]}" in log, log[-3000:]
    assert [m["round"] for m in metrics(run_dir)] == list(range(ROUNDS))
    _, digest = final_coordinator_digest(run_dir)
    reports = worker_reports(run_dir / "workers")
    assert sorted(reports) == [0, 1]
    assert all(r["status"] == "finished" and r["digest"] == digest for r in reports.values())
