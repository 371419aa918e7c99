"""A restarted worker keeps what its error feedback held, against real processes: with
--state-dir each worker saves its own state every round; a worker SIGKILLed and started
again takes its slot back once the coordinator has marked it dead, restores that state
(error feedback, inner AdamW, data positions) and finishes on the coordinator's digest; a
worker without saved state says that it starts from zero. The surviving worker is held
(SIGSTOP) from the victim's death until the restarted worker follows the rounds, so the
run cannot end before the restart has joined, however slow its start."""

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
    survivor = "worker-0" if victim == "worker-1" else "worker-1"
    processes.kill(victim)  # its stream ends with it: from then on, rounds do not wait for it
    with processes.paused(survivor):  # the open round waits for it: no round closes
        start_worker("restarted")  # it reclaims its slot from its --state-dir, dead or not
        wait_until(lambda: processes.log("coordinator").count("worker 1 follows rounds") >= 2, 180,
                   "the restarted worker to follow the rounds")
    assert len(metrics(run_dir)) < ROUNDS

    assert processes.wait("coordinator", timeout=240) == 0, processes.log("coordinator")[-3000:]
    for name in (survivor, "restarted"):
        assert processes.wait(name, timeout=60) == 0, processes.log(name)[-3000:]
    assert "restored the local state of round" in processes.log("restarted")
    _, digest = final_coordinator_digest(run_dir)
    finished = worker_reports(reports)
    assert finished[1]["pid"] == processes.procs["restarted"].pid
    assert all(r["status"] == "finished" and r["digest"] == digest for r in finished.values())
    assert sorted(p.name for p in state_dir.glob("*.state.pt")) == ["worker-0.state.pt", "worker-1.state.pt"]


def test_a_state_file_saved_for_other_data_or_another_model_is_ignored(processes: Processes,
                                                                       tmp_path: Path) -> None:
    state_dir = tmp_path / "state"

    def run(name: str, extra: dict[str, str]) -> str:
        """One worker through a 2-round run on ``state_dir``; its log."""
        run_dir = tmp_path / name
        processes.start(f"coordinator-{name}", [
            "coordinator", "--listen", "127.0.0.1:0", "--workers", "1", "--rounds", "2",
            "--run-dir", str(run_dir), *set_flags({**SMALL, "coordinator.checkpoint_every": "0", **extra})])
        processes.start(f"worker-{name}", ["worker", "--coordinator", f"127.0.0.1:{coordinator_port(run_dir)}",
                                           "--device", "cpu", "--state-dir", str(state_dir)])
        for proc in (f"worker-{name}", f"coordinator-{name}"):
            assert processes.wait(proc, timeout=180) == 0, processes.log(proc)[-3000:]
        assert (state_dir / "worker-0.state.pt").exists()
        return processes.log(f"worker-{name}")

    assert "no local state of worker 0" in run("first", {})
    other_data = run("other-data", {"task.corpus_bytes": "250000"})
    assert "was saved for other data: error feedback and inner AdamW state start from zero" in other_data
    assert "restored the local state" not in other_data
    other_model = run("other-model", {"task.seq_len": "16"})  # another position table: another layout
    assert "was saved for another model layout: error feedback" in other_model
    assert "restored the local state" not in other_model
