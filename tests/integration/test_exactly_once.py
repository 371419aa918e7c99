"""A coordinator killed at any moment resumes, against real processes: killed before its
first periodic checkpoint it resumes from the round-0 one with the registry it persisted
at the Joins, its workers get back in, every round is in metrics.jsonl once, and what the
killed writes left is removed; with no readable checkpoint `--resume` refuses to start."""

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

from geoloco.coordinator import checkpoint
from geoloco.run_dir import claim_run_dir, plan_run_dir

pytestmark = pytest.mark.slow
WORKERS = 2


def coordinator_args(run_dir: Path, listen: str, rounds: int, *extra: str) -> list[str]:
    return ["coordinator", "--listen", listen, "--workers", str(WORKERS), "--rounds", str(rounds),
            "--run-dir", str(run_dir), *extra,
            *set_flags({**SMALL, "coordinator.checkpoint_every": "5", "coordinator.deadline_s": "60"})]


def test_killed_before_the_first_checkpoint_resumes_and_every_round_is_recorded_once(
        processes: Processes, tmp_path: Path) -> None:
    run_dir, reports, rounds = tmp_path / "run", tmp_path / "reports", 4
    processes.start("coordinator", coordinator_args(run_dir, "127.0.0.1:0", rounds))
    listen = f"127.0.0.1:{coordinator_port(run_dir)}"  # the port it bound: the resume binds it again
    for i in range(WORKERS):
        processes.start(f"worker-{i}", ["worker", "--coordinator", listen, "--device", "cpu",
                                        "--connect-timeout", "90", "--report-dir", str(reports)])
    wait_until(lambda: len(metrics(run_dir)) >= 2, 180, "two rounds")
    processes.kill("coordinator")  # before round 5's checkpoint: only round 0's exists
    assert [checkpoint.load(p).round for p in checkpoint.list_checkpoints(run_dir)] == [0]
    left_behind = run_dir / "checkpoints" / "round_00000005.tmp4242"  # a write that was cut off
    left_behind.mkdir()
    wait_until(lambda: all("connection lost" in processes.log(f"worker-{i}") for i in range(WORKERS)),
               120, "every worker to see its stream break")
    processes.start("coordinator-2", coordinator_args(run_dir, listen, rounds, "--resume"))

    assert processes.wait("coordinator-2", timeout=180) == 0, processes.log("coordinator-2")[-3000:]
    for i in range(WORKERS):
        assert processes.wait(f"worker-{i}", timeout=60) == 0, processes.log(f"worker-{i}")[-3000:]
    assert [m["round"] for m in metrics(run_dir)] == list(range(rounds))
    assert not left_behind.exists() and f"removed {left_behind}" in processes.log("coordinator-2")
    round_, digest = final_coordinator_digest(run_dir)
    assert round_ == rounds
    finished = worker_reports(reports)
    assert sorted(finished) == list(range(WORKERS))
    for report in finished.values():
        assert report["status"] == "finished" and report["digest"] == digest
        assert report["reconnects"] >= 1


def test_resume_without_a_readable_checkpoint_refuses_to_start(processes: Processes, tmp_path: Path) -> None:
    run_dir = claim_run_dir(plan_run_dir(tmp_path / "run"))  # a GeoLoCo run, then damaged
    damaged = run_dir / "checkpoints" / "round_00000002"
    damaged.mkdir(parents=True)
    (damaged / "state.pt").write_bytes(b"not a checkpoint")
    (run_dir / "metrics.jsonl").write_text('{"round": 0}\n{"round": 1}\n')
    processes.start("coordinator", coordinator_args(run_dir, "127.0.0.1:0", 4, "--resume"))
    assert processes.wait("coordinator", timeout=120) == 1
    log = processes.log("coordinator")
    assert "no readable checkpoint" in log and "Traceback" not in log, log[-3000:]
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == ["round_00000002"]
    assert (run_dir / "metrics.jsonl").read_text() == '{"round": 0}\n{"round": 1}\n'
