"""A restarted worker keeps what its error feedback held, against real processes: with
--state-dir each worker saves its own state every round; a worker SIGKILLed and started
again takes its slot back once the coordinator has marked it dead, restores that state
(error feedback, inner AdamW, data positions) and finishes on the coordinator's digest; a
worker without saved state says that it starts from zero."""

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
ROUNDS = 14


def test_a_restarted_worker_restores_its_own_state(processes: Processes, tmp_path: Path) -> None:
    run_dir, reports, state_dir = tmp_path / "run", tmp_path / "reports", tmp_path / "state"
    processes.start("coordinator", ["coordinator", "--listen", "127.0.0.1:0", "--workers", "2",
                                    "--rounds", str(ROUNDS), "--run-dir", str(run_dir),
                                    *set_flags({**SMALL, "coordinator.liveness_s": "5",
                                                "coordinator.checkpoint_every": "0"})])
    address = f"127.0.0.1:{coordinator_port(run_dir)}"

    def start_worker(name: str) -> None:
        processes.start(name, ["worker", "--coordinator", address, "--device", "cpu",
                               "--report-dir", str(reports), "--state-dir", str(state_dir)])

    for i in range(2):
        start_worker(f"worker-{i}")
    wait_until(lambda: len(metrics(run_dir)) >= 3, 180, "three rounds")
    victim = next(n for n, p in processes.procs.items() if p.pid == worker_reports(reports)[1]["pid"])
    assert "no local state of worker 1" in processes.log(victim)
    processes.kill(victim)
    wait_until(lambda: "worker 1 has had no Rounds stream" in processes.log("coordinator"), 60,
               "worker 1 to be marked dead")
    start_worker("restarted")

    assert processes.wait("coordinator", timeout=240) == 0, processes.log("coordinator")[-3000:]
    for name in ("worker-0" if victim == "worker-1" else "worker-1", "restarted"):
        assert processes.wait(name, timeout=60) == 0, processes.log(name)[-3000:]
    assert "restored the local state of round" in processes.log("restarted")
    _, digest = final_coordinator_digest(run_dir)
    finished = worker_reports(reports)
    assert finished[1]["pid"] == processes.procs["restarted"].pid
    assert all(r["status"] == "finished" and r["digest"] == digest for r in finished.values())
    assert sorted(p.name for p in state_dir.glob("*.state.pt")) == ["worker-0.state.pt", "worker-1.state.pt"]
