"""A restarted worker proves it is the same worker, against real processes: SIGKILLed and
started again on its own --state-dir, faster than coordinator.liveness_s (its slot still
held) or slower (its slot marked dead), it reclaims its id at once with the secret saved
there (0600; the coordinator keeps only its sha256), restores its error feedback, AdamW
state and data positions, and every replica finishes on the coordinator's digest."""

from __future__ import annotations

import hashlib
import json
import stat
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
        "inner.warmup_steps": "2", "coordinator.deadline_s": "600", "coordinator.checkpoint_every": "0"}
LINK = "unlimited/100ms"  # each worker's own relay: rounds last long enough for a restart


@pytest.mark.parametrize("restart", ["faster", "slower"])
def test_a_restarted_worker_gets_its_slot_back_at_once(processes: Processes, tmp_path: Path,
                                                       restart: str) -> None:
    run_dir, reports = tmp_path / "run", tmp_path / "reports"
    liveness = "600" if restart == "faster" else "3"
    processes.start("coordinator", ["coordinator", "--listen", "127.0.0.1:0", "--workers", "2",
                                    "--rounds", str(ROUNDS), "--run-dir", str(run_dir),
                                    *set_flags({**FAST, "coordinator.liveness_s": liveness})])
    address = f"127.0.0.1:{coordinator_port(run_dir)}"

    def start_worker(name: str, state_dir: Path) -> None:
        processes.start(name, ["worker", "--coordinator", address, "--device", "cpu",
                               "--connect-timeout", "120", "--report-dir", str(reports),
                               "--state-dir", str(state_dir), "--wan-emulate", LINK,
                               *set_flags({"worker.state_every": "1"})])

    for i in range(2):
        start_worker(f"worker-{i}", tmp_path / f"state-{i}")
    wait_until(lambda: len(metrics(run_dir)) >= 3, 180, "three rounds")
    victim = next(n for n, p in processes.procs.items() if p.pid == worker_reports(reports)[1]["pid"])
    state_dir = tmp_path / f"state-{victim[-1]}"
    survivor = next(name for name in processes.procs if name.startswith("worker") and name != victim)
    processes.kill(victim)  # its stream ends with it: rounds no longer wait for it
    with processes.paused(survivor):  # the open round waits for it: no round closes
        if restart == "slower":
            wait_until(lambda: "worker 1 has had no Rounds stream" in processes.log("coordinator"), 60,
                       "worker 1 to be marked dead")
        start_worker("restarted", state_dir)
        wait_until(lambda: processes.log("coordinator").count("worker 1 follows rounds") >= 2, 180,
                   "the restarted worker to follow the rounds")
    assert len(metrics(run_dir)) < ROUNDS

    assert processes.wait("coordinator", timeout=300) == 0, processes.log("coordinator")[-3000:]
    for name in processes.procs:
        if name != victim:
            assert processes.wait(name, timeout=60) == 0, processes.log(name)[-3000:]
    log = processes.log("restarted")
    assert "reclaiming worker 1" in log and "rejoined as worker 1" in log
    assert "restored the local state of round" in log
    coordinator_log = processes.log("coordinator")
    assert "worker 1 reclaimed its id" in coordinator_log
    if restart == "faster":
        assert "marked dead" not in coordinator_log
    identity = state_dir / "worker-1.identity.json"
    assert stat.S_IMODE(identity.stat().st_mode) == 0o600
    secret = json.loads(identity.read_text())["session"]
    registry = (run_dir / "registry.json").read_text()
    assert secret not in registry and hashlib.sha256(secret.encode()).hexdigest() in registry
    _, digest = final_coordinator_digest(run_dir)
    finished = worker_reports(reports)
    assert finished[1]["pid"] == processes.procs["restarted"].pid
    assert all(r["status"] == "finished" and r["digest"] == digest for r in finished.values())
    assert [m["round"] for m in metrics(run_dir)] == list(range(ROUNDS))


def test_a_worker_started_again_after_the_last_round_finishes_at_once(processes: Processes,
                                                                      tmp_path: Path) -> None:
    """Under pgc-fr (n = 2, s = 1) the survivor carries the run to its end alone; the killed
    worker, started again only then, fetches the final state and finishes on its digest, and
    the coordinator, which waits for every live worker to have the end, ends with it rather
    than after coordinator.liveness_s (600 s here) or the deadline."""
    run_dir, reports, rounds = tmp_path / "run", tmp_path / "reports", 8
    coded = {**FAST, "coordinator.liveness_s": "600", "coding.scheme": "pgc-fr", "coding.stragglers": "1"}
    processes.start("coordinator", ["coordinator", "--listen", "127.0.0.1:0", "--workers", "2",
                                    "--rounds", str(rounds), "--run-dir", str(run_dir), *set_flags(coded)])
    address = f"127.0.0.1:{coordinator_port(run_dir)}"

    def start_worker(name: str, state_dir: Path) -> None:
        processes.start(name, ["worker", "--coordinator", address, "--device", "cpu",
                               "--connect-timeout", "120", "--report-dir", str(reports),
                               "--state-dir", str(state_dir), "--wan-emulate", LINK])

    for i in range(2):
        start_worker(f"worker-{i}", tmp_path / f"state-{i}")
    wait_until(lambda: len(metrics(run_dir)) >= 2, 180, "two rounds")
    victim = next(n for n, p in processes.procs.items() if p.pid == worker_reports(reports)[1]["pid"])
    processes.kill(victim)
    wait_until(lambda: len(metrics(run_dir)) == rounds, 180, "the survivor to close every round")
    start_worker("restarted", tmp_path / f"state-{victim[-1]}")

    assert processes.wait("restarted", timeout=120) == 0, processes.log("restarted")[-3000:]
    assert processes.wait("coordinator", timeout=120) == 0, processes.log("coordinator")[-3000:]
    assert "rounds of the run are closed (rejoined after the last one)" in processes.log("restarted")
    _, digest = final_coordinator_digest(run_dir)
    finished = worker_reports(reports)
    assert finished[1]["pid"] == processes.procs["restarted"].pid
    assert all(r["status"] == "finished" and r["digest"] == digest for r in finished.values()), finished
