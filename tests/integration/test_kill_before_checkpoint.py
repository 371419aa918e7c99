"""A coordinator SIGKILLed before its first periodic checkpoint of a 2-worker run, then
resumed, against real processes, several times in a row, each kill at another moment of
the run (during round 0, after a few rounds): every worker rejoins, every round is in
metrics.jsonl once, and every replica finishes on the coordinator's digest.

GEOLOCO_KILL_LOOPS sets how many kills (default 3; the issue asks for 10 in a row, run by
hand: GEOLOCO_KILL_LOOPS=10)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from run_processes import (
    SMALL,
    Processes,
    coordinator_port,
    final_coordinator_digest,
    metrics,
    set_flags,
    wait_until,
    worker_reports,
)

pytestmark = pytest.mark.slow
WORKERS, ROUNDS = 2, 6
LOOPS = int(os.environ.get("GEOLOCO_KILL_LOOPS", "3"))
FAST = {**SMALL, "task.seq_len": "16", "task.batch_size": "4", "inner.steps": "4",
        "inner.warmup_steps": "2", "coordinator.checkpoint_every": "100",
        "coordinator.deadline_s": "120"}


def coordinator_args(run_dir: Path, listen: str, *extra: str) -> list[str]:
    return ["coordinator", "--listen", listen, "--workers", str(WORKERS), "--rounds", str(ROUNDS),
            "--run-dir", str(run_dir), *extra, *set_flags(FAST)]


def kill_and_resume(processes: Processes, tmp_path: Path, loop: int) -> None:
    run_dir, reports = tmp_path / f"run-{loop}", tmp_path / f"reports-{loop}"
    coordinator, resumed, workers = f"coordinator-{loop}", f"resumed-{loop}", []
    processes.start(coordinator, coordinator_args(run_dir, "127.0.0.1:0"))
    listen = f"127.0.0.1:{coordinator_port(run_dir)}"  # the port it bound: the resume binds it again
    for i in range(WORKERS):
        workers.append(f"worker-{loop}-{i}")
        processes.start(workers[-1], ["worker", "--coordinator", listen, "--device", "cpu",
                                      "--connect-timeout", "120", "--report-dir", str(reports)])
    joined = loop % 2 == 0  # every other kill lands during round 0, right after the Joins
    if joined:  # each worker's own line: its Join has its reply (a Join cut off by the kill
        # is retried without the "connection lost" waited for below)
        wait_until(lambda: all("joined as worker" in processes.log(name) for name in workers), 180, "the Joins")
    else:
        wait_until(lambda: len(metrics(run_dir)) >= 2, 180, "two rounds")
    processes.kill(coordinator)
    wait_until(lambda: all("connection lost" in processes.log(name) for name in workers), 120,
               "every worker to see its stream break")
    processes.start(resumed, coordinator_args(run_dir, listen, "--resume"))

    assert processes.wait(resumed, timeout=180) == 0, processes.log(resumed)[-3000:]
    for name in workers:
        assert processes.wait(name, timeout=60) == 0, processes.log(name)[-3000:]
    assert [m["round"] for m in metrics(run_dir)] == list(range(ROUNDS))
    round_, digest = final_coordinator_digest(run_dir)
    assert round_ == ROUNDS
    finished = worker_reports(reports)
    assert sorted(finished) == list(range(WORKERS))
    assert all(r["status"] == "finished" and r["digest"] == digest for r in finished.values())
    assert "marked dead" not in processes.log(resumed)  # nobody was left behind


def test_killed_before_the_first_checkpoint_every_worker_rejoins_every_time(
        processes: Processes, tmp_path: Path) -> None:
    for loop in range(LOOPS):
        kill_and_resume(processes, tmp_path, loop)
