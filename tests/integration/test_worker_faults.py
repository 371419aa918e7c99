"""Worker-side faults with real processes: an unreachable coordinator (retry with backoff,
one log line per attempt, non-zero exit), a worker SIGKILLed mid-run (its stream ends with it,
so the round closes once the others are in, long before its deadline; the others finish), and a coordinator restarted with ``--resume`` (the
workers reclaim their ids, resync and finish on the coordinator's digest), and a replica
that drifts (a session that flips a parameter: the digest mismatch makes the worker fetch
the state again and finish in step)."""

from __future__ import annotations

import json
import re
import socket
import time
from pathlib import Path

import pytest
from run_processes import (
    SMALL,
    TOKEN,
    Processes,
    final_coordinator_digest,
    metrics,
    run_worker_threads,
    set_flags,
    wait_until,
    worker_reports,
)

from geoloco.config import load_config
from geoloco.coordinator.app import Coordinator
from geoloco.replica import param_digest
from geoloco.transport import BACKOFF_START_S
from geoloco.worker.faults import Fault, FaultySession
from geoloco.worker.loop import Worker
from geoloco.worker.session import Session

pytestmark = pytest.mark.slow
WORKERS = 3


def start_coordinator(processes: Processes, run_dir: Path, listen: str, rounds: int,
                      extra: dict[str, str], resume: bool = False, name: str = "coordinator") -> None:
    args = ["coordinator", "--listen", listen, "--workers", str(WORKERS), "--rounds", str(rounds),
            "--run-dir", str(run_dir), *set_flags({**SMALL, **extra})]
    processes.start(name, args + (["--resume"] if resume else []))


def start_workers(processes: Processes, address: str, report_dir: Path) -> None:
    for i in range(WORKERS):
        processes.start(f"worker-{i}", ["worker", "--coordinator", address,
                                        "--device", "cpu", "--connect-timeout", "60",
                                        "--report-dir", str(report_dir)])


def read_port(run_dir: Path) -> int:
    port_file = run_dir / "coordinator.port"
    wait_until(lambda: port_file.exists() and port_file.read_text().strip().isdigit(), 60,
               "the coordinator to write its port")
    return int(port_file.read_text())


def test_unreachable_coordinator_retries_then_exits_non_zero(processes: Processes) -> None:
    with socket.socket() as bound:  # bound, never listening: every connection is refused
        bound.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{bound.getsockname()[1]}"
        start = time.monotonic()
        processes.start("worker", ["worker", "--coordinator", address, "--connect-timeout", "3"])
        code = processes.wait("worker", timeout=60)
    elapsed = time.monotonic() - start
    log = processes.log("worker")
    assert code != 0
    attempts = [(int(n), float(wait)) for n, wait in
                re.findall(r"join attempt (\d+) to \S+ failed .*; retrying in ([0-9.]+)s", log)]
    assert all(address in line for line in log.splitlines() if "join attempt" in line)
    # the back-off schedule, whatever each attempt costs: 0.5 s doubling, the last wait cut
    # to the time left of the 3 s, then one more attempt that fails and ends the worker
    assert [n for n, _ in attempts] == list(range(1, len(attempts) + 1)) and attempts, log
    scheduled = [BACKOFF_START_S * 2 ** i for i in range(len(attempts))]
    assert [w for _, w in attempts[:-1]] == scheduled[:-1], log
    assert attempts[-1][1] <= scheduled[-1] and sum(w for _, w in attempts) <= 3.0 + 0.05, log
    last = log.splitlines()[-1]
    assert "unreachable" in last and address in last and f"after {len(attempts) + 1} attempts" in last, log
    assert elapsed < 40


def test_killed_worker_is_not_waited_for_and_others_finish(processes: Processes, tmp_path: Path) -> None:
    run_dir, reports = tmp_path / "run", tmp_path / "reports"
    rounds, deadline, liveness = 3, 300.0, 20.0
    start_coordinator(processes, run_dir, "127.0.0.1:0", rounds,
                      {"coordinator.deadline_s": str(deadline), "coordinator.liveness_s": str(liveness),
                       "coordinator.checkpoint_every": "0", "inner.steps": "4", "task.batch_size": "4"})
    port = read_port(run_dir)
    start_workers(processes, f"127.0.0.1:{port}", reports)
    wait_until(lambda: len(metrics(run_dir)) >= 1, 90, "round 0 to close")
    victim = worker_reports(reports)[0]["pid"]
    name = next(n for n, p in processes.procs.items() if p.pid == victim)
    processes.kill(name)

    assert processes.wait("coordinator", timeout=120) == 0, processes.log("coordinator")[-3000:]
    survivors = [n for n in processes.procs if n.startswith("worker") and n != name]
    for n in survivors:
        assert processes.wait(n, timeout=30) == 0, processes.log(n)[-3000:]
    lines = metrics(run_dir)
    assert len(lines) == rounds
    last = lines[-1]
    # its stream ended with its process: the rounds closed once the others were in, before
    # liveness_s could have marked worker 0 dead (the end of the run waits that long for it)
    assert last["arrived"] == [1, 2] and last["close_reason"] == "live arrived", last
    assert all(m["round_seconds"] < liveness for m in lines), lines
    _, digest = final_coordinator_digest(run_dir)
    finished = worker_reports(reports)
    for wid in (1, 2):
        assert finished[wid]["status"] == "finished" and finished[wid]["digest"] == digest


def test_restarted_coordinator_with_resume_lets_workers_reclaim_and_finish(
    processes: Processes, tmp_path: Path
) -> None:
    run_dir, reports = tmp_path / "run", tmp_path / "reports"
    rounds = 6
    extra = {"coordinator.checkpoint_every": "1", "coordinator.deadline_s": "60"}
    start_coordinator(processes, run_dir, "127.0.0.1:0", rounds, extra)
    listen = f"127.0.0.1:{read_port(run_dir)}"  # the port it bound: the restart binds it again
    start_workers(processes, listen, reports)
    wait_until(lambda: len(metrics(run_dir)) >= 2, 120, "two rounds to close")
    processes.kill("coordinator")
    wait_until(lambda: all("connection lost" in processes.log(f"worker-{i}") for i in range(WORKERS)),
               120, "every worker to see its stream break")
    start_coordinator(processes, run_dir, listen, rounds, extra, resume=True, name="coordinator-2")

    assert processes.wait("coordinator-2", timeout=120) == 0, processes.log("coordinator-2")[-3000:]
    for i in range(WORKERS):
        assert processes.wait(f"worker-{i}", timeout=30) == 0, processes.log(f"worker-{i}")[-3000:]
    round_, digest = final_coordinator_digest(run_dir)
    assert round_ == rounds
    finished = worker_reports(reports)
    assert sorted(finished) == [0, 1, 2]
    for report in finished.values():
        assert report["status"] == "finished" and report["digest"] == digest
        assert report["reconnects"] >= 1
    assert "rejoined as worker" in processes.log("worker-0")


def test_digest_mismatch_makes_the_worker_fetch_state_and_continue(tmp_path: Path) -> None:
    cfg = load_config(overrides={**SMALL, "coordinator.token": TOKEN, "workers": "2", "rounds": "3", "coordinator.listen": "127.0.0.1:0",
                                 "coordinator.checkpoint_every": "0", "coordinator.deadline_s": "120"})
    coordinator = Coordinator(cfg, tmp_path / "run")
    port = coordinator.start()
    address = f"127.0.0.1:{port}"
    # one replica drifts once: a parameter flips as it applies round 0
    drifting = FaultySession(address, TOKEN, 30, fault=Fault.FLIP_PARAMETER, rounds=[0])
    sessions = [drifting, Session(address, TOKEN, 30)]
    workers = [Worker(s, device="cpu", report_dir=tmp_path / "reports") for s in sessions]
    codes = run_worker_threads(coordinator, workers, 180)
    assert codes == {0: 0, 1: 0}
    assert drifting.fired == [0]
    digest = param_digest(coordinator.params)
    reports = worker_reports(tmp_path / "reports")
    assert sorted(r["resyncs"] for r in reports.values()) == [0, 1]
    assert all(r["digest"] == digest and r["status"] == "finished" for r in reports.values())
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())  # over gRPC, no launcher
    assert (summary["digest_mismatches"], summary["worker_resyncs"]) == (1, 1), summary


def test_a_worker_on_other_data_refuses_to_start(processes: Processes, tmp_path: Path) -> None:
    corpus, run_dir = tmp_path / "corpus.txt", tmp_path / "run"
    words = [f"word{i} " for i in range(5000)]
    corpus.write_text("".join(words) * 12)  # about 400 kB
    start_coordinator(processes, run_dir, "127.0.0.1:0", 2,
                      {"task.data": str(corpus), "coordinator.checkpoint_every": "0"})
    address = f"127.0.0.1:{read_port(run_dir)}"  # it has read the corpus and taken its fingerprint
    corpus.write_text("".join(reversed(words)) * 12)  # the same path, other text: this machine's data
    processes.start("worker", ["worker", "--coordinator", address, "--device", "cpu",
                               "--connect-timeout", "60",
                               "--set", "worker.allow_config_code=true"])  # the data path is its own
    assert processes.wait("worker", timeout=120) == 1
    log = processes.log("worker")
    assert "data mismatch" in log and "has fingerprint" in log and "Traceback" not in log, log[-3000:]
