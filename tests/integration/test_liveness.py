"""A killed worker, against real processes: once its Rounds stream has been gone for
coordinator.liveness_s it is marked dead and rounds close without it ("live arrived", not
at the deadline); a new `geoloco worker` with the token then takes its slot (id 0, its
partitions), fetches the state and pushes within one round, and every replica finishes on
the coordinator's digest."""

from __future__ import annotations

import re
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
WORKERS, ROUNDS = 3, 24


def test_a_dead_worker_is_not_waited_for_and_a_new_worker_takes_its_slot(processes: Processes,
                                                                         tmp_path: Path) -> None:
    run_dir, reports = tmp_path / "run", tmp_path / "reports"
    processes.start("coordinator", ["coordinator", "--listen", "127.0.0.1:0", "--workers", str(WORKERS),
                                    "--rounds", str(ROUNDS), "--run-dir", str(run_dir),
                                    *set_flags({**SMALL, "coordinator.deadline_s": "300",
                                                "coordinator.liveness_s": "10",
                                                "coordinator.checkpoint_every": "0"})])
    address = f"127.0.0.1:{coordinator_port(run_dir)}"

    def start_worker(name: str) -> None:
        processes.start(name, ["worker", "--coordinator", address, "--device", "cpu",
                               "--report-dir", str(reports)])

    for i in range(WORKERS):
        start_worker(f"worker-{i}")
    wait_until(lambda: len(metrics(run_dir)) >= 2, 180, "two rounds")
    victim = next(n for n, p in processes.procs.items() if p.pid == worker_reports(reports)[0]["pid"])
    processes.kill(victim)
    wait_until(lambda: "worker 0 has had no Rounds stream" in processes.log("coordinator"), 60,
               "worker 0 to be marked dead")
    wait_until(lambda: any(m["close_reason"] == "live arrived" for m in metrics(run_dir)), 60,
               "a round without worker 0")
    start_worker("replacement")

    assert processes.wait("coordinator", timeout=240) == 0, processes.log("coordinator")[-3000:]
    for name in processes.procs:
        if name != victim:
            assert processes.wait(name, timeout=60) == 0, processes.log(name)[-3000:]
    lines = metrics(run_dir)
    assert [m["round"] for m in lines] == list(range(ROUNDS))
    assert all(m["close_reason"] != "deadline" for m in lines)
    without = [m for m in lines if 0 not in m["arrived"]]
    assert without and all(m["close_reason"] == "live arrived" and m["arrived"] == [1, 2] for m in without)
    fetched = [int(r) for r in re.findall(r"worker 0 fetches the state of round (\d+)",
                                          processes.log("coordinator"))]
    joined_at = fetched[-1]  # the replacement's FetchState
    assert all(0 in m["arrived"] for m in lines[joined_at + 1:])  # it pushes within one round
    _, digest = final_coordinator_digest(run_dir)
    finished = worker_reports(reports)
    assert finished[0]["pid"] == processes.procs["replacement"].pid
    for report in finished.values():
        assert report["status"] == "finished" and report["digest"] == digest
