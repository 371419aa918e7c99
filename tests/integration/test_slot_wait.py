"""A new worker waiting for a slot, against real processes: while every slot is held its Join
is answered RESOURCE_EXHAUSTED, and it retries with backoff (one log line per attempt)
instead of exiting; once a worker has been gone coordinator.liveness_s it takes that slot,
and every replica finishes on the coordinator's digest."""

from __future__ import annotations

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
ROUNDS = 40
FAST = {**SMALL, "task.seq_len": "16", "task.batch_size": "4", "inner.steps": "4",
        "inner.warmup_steps": "2", "coordinator.deadline_s": "300", "coordinator.checkpoint_every": "0"}
LINK = "unlimited/100ms"  # each worker's own relay: rounds last long enough for the slot to free


def test_a_replacement_waits_for_a_slot_then_joins(processes: Processes, tmp_path: Path) -> None:
    run_dir, reports = tmp_path / "run", tmp_path / "reports"
    processes.start("coordinator", ["coordinator", "--listen", "127.0.0.1:0", "--workers", "2",
                                    "--rounds", str(ROUNDS), "--run-dir", str(run_dir),
                                    *set_flags({**FAST, "coordinator.liveness_s": "5"})])
    address = f"127.0.0.1:{coordinator_port(run_dir)}"
    names = ["worker-a", "worker-b", "worker-c"]  # three processes for two slots, started at once
    for name in names:
        processes.start(name, ["worker", "--coordinator", address, "--device", "cpu",
                               "--connect-timeout", "180", "--report-dir", str(reports),
                               "--wan-emulate", LINK])

    def waiting() -> str | None:
        return next((n for n in names if processes.log(n).count("RESOURCE_EXHAUSTED") >= 2), None)

    wait_until(lambda: waiting() is not None, 180, "one worker to retry its Join twice")
    replacement = waiting()
    assert processes.procs[replacement].poll() is None, processes.log(replacement)[-3000:]
    wait_until(lambda: len(worker_reports(reports)) == 2, 60, "two workers joined")
    assert len(metrics(run_dir)) < ROUNDS, "the run ended before the slot could be freed"
    victim = next(n for n, p in processes.procs.items() if p.pid == worker_reports(reports)[1]["pid"])
    processes.kill(victim)

    assert processes.wait("coordinator", timeout=300) == 0, processes.log("coordinator")[-3000:]
    for name in processes.procs:
        if name != victim:
            assert processes.wait(name, timeout=60) == 0, processes.log(name)[-3000:]
    log = processes.log(replacement)
    attempts = [line for line in log.splitlines() if "RESOURCE_EXHAUSTED" in line]
    assert attempts and all("retrying in" in line for line in attempts)
    assert "joined as worker 1" in log
    _, digest = final_coordinator_digest(run_dir)
    finished = worker_reports(reports)
    assert finished[1]["pid"] == processes.procs[replacement].pid
    assert all(r["status"] == "finished" and r["digest"] == digest for r in finished.values())
    assert [m["round"] for m in metrics(run_dir)] == list(range(ROUNDS))
