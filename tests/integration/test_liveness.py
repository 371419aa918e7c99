"""A killed worker, against real processes: its Rounds stream ends with its process, so
rounds close without it at once ("live arrived", not at the deadline), before
coordinator.liveness_s marks it dead; once dead, a new `geoloco worker` with the token takes
its slot (id 0, its partitions), fetches the state and pushes within one round, and every
replica finishes on the coordinator's digest."""

from __future__ import annotations

import re
from datetime import datetime
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
                                                "coordinator.liveness_s": "5",
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
    wait_until(lambda: any(m["close_reason"] == "live arrived" for m in metrics(run_dir)), 60,
               "a round without worker 0")
    survivor = next(n for n, p in processes.procs.items() if p.pid == worker_reports(reports)[1]["pid"])
    with processes.paused(survivor):  # its stream is up: the open round waits for it, no round closes
        dead = wait_until_logged(processes, "worker 0 has had no Rounds stream", 60, "worker 0 to be marked dead")
        start_worker("replacement")
        wait_until(lambda: processes.log("coordinator").count("worker 0 follows rounds") >= 2, 180,
                   "the replacement to follow the rounds as worker 0")
    first_without = next(m for m in metrics(run_dir) if 0 not in m["arrived"])
    assert first_without["time"] < dead, "the round waited for the killed worker until it was dead"

    assert processes.wait("coordinator", timeout=240) == 0, processes.log("coordinator")[-3000:]
    for name in processes.procs:
        if name != victim:
            assert processes.wait(name, timeout=60) == 0, processes.log(name)[-3000:]
    lines = metrics(run_dir)
    assert [m["round"] for m in lines] == list(range(ROUNDS))
    assert "worker 0's Rounds stream ended" in processes.log("coordinator")
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


def wait_until_logged(processes: Processes, text: str, timeout: float, what: str) -> float:
    """Wait for the coordinator's log line holding ``text``; the epoch time it was logged at."""
    wait_until(lambda: text in processes.log("coordinator"), timeout, what)
    line = next(x for x in processes.log("coordinator").splitlines() if text in x)
    stamp = datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")  # logging's asctime, local time
    return stamp.timestamp()
