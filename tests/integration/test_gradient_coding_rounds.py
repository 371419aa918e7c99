"""Gradient coding in real rounds: real coordinator and worker processes on loopback.

- ``pgc-fr`` (n = 4, s = 1): a worker SIGKILLed mid-run does not stall the run; rounds keep
  closing as soon as they decode, far before the deadline, and the survivors end on the
  coordinator's digest.
- A ``fixed:4`` straggler under ``pgc-fr`` is never waited for.
- ``quorum`` (n = 3, quorum 2, a fixed grace window): rounds close on the quorum once the
  window has passed, with the mean of what arrived, without the straggler; and
  every replica ends on the coordinator's digest.
- ``gc-cr`` (n = 3, s = 1) trains s + 1 partitions per worker per round and finishes.
- A frame that arrives after its round closed is dropped and counted as late.
- ``benchmarks/stragglers.py --quick`` ends with its JSON line.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from run_processes import (
    ROOT,
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
from geoloco.worker.faults import Fault, FaultySession
from geoloco.worker.loop import Worker
from geoloco.worker.session import Session

pytestmark = pytest.mark.slow
CODED = {**SMALL, "inner.steps": "4", "coordinator.checkpoint_every": "0"}


def run_local(processes: Processes, run_dir: Path, workers: int, rounds: int, scheme: str,
              extra: list[str] = ()) -> None:
    args = ["local", "--workers", str(workers), "--rounds", str(rounds), "--wan", "unlimited",
            "--run-dir", str(run_dir), "--scheme", scheme, "--stragglers", "1",
            "--deadline", "60", "--stall-timeout", "60", *extra, *set_flags(CODED)]
    processes.start("local", args)
    assert processes.wait("local", timeout=150) == 0, processes.log("local")[-4000:]


def check_digests(run_dir: Path, reports: dict[int, dict], workers: list[int], rounds: int) -> None:
    round_, digest = final_coordinator_digest(run_dir)
    assert round_ == rounds
    for wid in workers:
        assert reports[wid]["status"] == "finished", reports[wid]
        assert reports[wid]["digest"] == digest, f"worker {wid} ended on another digest"


def test_pgc_fr_run_survives_a_killed_worker(processes: Processes, tmp_path: Path) -> None:
    run_dir, reports, rounds, deadline = tmp_path / "run", tmp_path / "reports", 8, 60.0
    # liveness 15 s (a worker builds its task between Join and its Rounds stream): the killed
    # worker is marked dead, and the end of the run does not wait the deadline for it
    flags = {**CODED, "coding.scheme": "pgc-fr", "coding.stragglers": "1",
             "coordinator.deadline_s": str(deadline), "coordinator.liveness_s": "15"}
    processes.start("coordinator", ["coordinator", "--listen", "127.0.0.1:0", "--workers", "4",
                                    "--rounds", str(rounds), "--run-dir", str(run_dir), *set_flags(flags)])
    port_file = run_dir / "coordinator.port"
    wait_until(lambda: port_file.exists() and port_file.read_text().strip().isdigit(), 60, "the port")
    for i in range(4):
        processes.start(f"worker-{i}", ["worker", "--coordinator", f"127.0.0.1:{port_file.read_text().strip()}",
                                        "--device", "cpu", "--report-dir", str(reports)])
    wait_until(lambda: len(metrics(run_dir)) >= 2, 90, "two rounds to close")
    victim = worker_reports(reports)[0]["pid"]  # worker 0: the first choice of its group
    name = next(n for n, p in processes.procs.items() if p.pid == victim)
    processes.kill(name)
    killed_after = len(metrics(run_dir))

    assert processes.wait("coordinator", timeout=120) == 0, processes.log("coordinator")[-3000:]
    for n in processes.procs:
        if n.startswith("worker") and n != name:
            assert processes.wait(n, timeout=30) == 0, processes.log(n)[-3000:]
    lines = metrics(run_dir)
    assert len(lines) == rounds
    after = lines[killed_after + 1:]  # the round open at the kill may hold its frame
    assert after, "the run ended before the kill took effect"
    for m in after:
        assert 0 not in m["arrived"], m
        assert m["close_reason"] == "decodable", m
        assert m["round_seconds"] < deadline / 4, m
    check_digests(run_dir, worker_reports(reports), [1, 2, 3], rounds)


def straggler_delays(log: str) -> list[float]:
    return [float(s) for s in re.findall(r"straggler emulation computes ([0-9.]+)s more", log)]


def waited_for(m: dict, worker: int) -> bool:
    """Whether ``worker``'s frame was the last of round ``m``'s chosen frames to come: the
    one the close waited for (it waited least after its frame was in)."""
    wait = {int(w): s for w, s in m["wait_seconds_by_worker"].items()}
    return all(wait[worker] <= wait[w] for w in m["chosen"])


def came_before(m: dict, first: int, then: int) -> bool:
    """Whether ``first``'s frame was in before ``then``'s in round ``m`` (both arrived): a
    frame's wait is the round's seconds less when it came, so the earlier waited longer."""
    wait = {int(w): s for w, s in m["wait_seconds_by_worker"].items()}
    return wait[first] > wait[then]


def test_fixed_straggler_is_not_waited_for_under_pgc_fr(processes: Processes, tmp_path: Path) -> None:
    run_dir, rounds = tmp_path / "run", 5
    run_local(processes, run_dir, 4, rounds, "pgc-fr", ["--straggler-profiles", "fixed:4,none,none,none"])
    lines = metrics(run_dir)
    assert len(lines) == rounds
    for m in lines:
        if m["round"] == 0:
            # workers join one after another and round 0 opens when the last has fetched the
            # state: worker 0 may have trained before its mate started (4 s ahead and more
            # on a loaded machine), so its frame can come before worker 1's. The close may
            # wait for it only then: never while its mate's frame was in. (Worker 1's frame
            # may still come between worker 0's and the broadcast, the close being under way:
            # one CI run had it 11 ms after worker 0's, and 0.21 s before the broadcast.)
            mate_first = {0, 1} <= set(m["arrived"]) and came_before(m, 1, 0)
            assert not (0 in m["chosen"] and waited_for(m, 0) and mate_first), m
        else:
            assert 0 not in m["chosen"], m  # its group-mate, worker 1, stands in for it
        assert m["close_reason"] == "decodable", m
        assert set(m["partitions_trained"].values()) == ({2} if m["round"] == 0 else {1}), m
    delays = straggler_delays((run_dir / "logs" / "worker-0.log").read_text())
    assert delays, "the straggler was never delayed"
    round_s = statistics.median(m["round_seconds"] for m in lines)
    assert round_s < statistics.median(delays), (round_s, delays)
    summary = json.loads((run_dir / "summary.json").read_text())
    per_round = sum(m["late_frames"] for m in lines)
    # the total also counts a last-round frame that came after the last round had closed
    assert per_round <= summary["late_frames"] <= per_round + 1, (summary["late_frames"], per_round)
    assert summary["worst_case_coefficient"] == 1.0 and summary["coding_scheme"] == "pgc-fr"
    check_digests(run_dir, worker_reports(run_dir / "workers"), list(range(4)), rounds)


def test_quorum_closes_without_the_straggler_and_replicas_agree(processes: Processes, tmp_path: Path) -> None:
    run_dir, rounds = tmp_path / "run", 5
    run_local(processes, run_dir, 3, rounds, "quorum",
              ["--straggler-profiles", "fixed:4,none,none", "--set", "coding.grace_s=0.2"])
    lines = metrics(run_dir)
    assert [m["round"] for m in lines] == list(range(rounds))
    for m in lines:  # every arrived frame is in the mean: no coding, no choice among them
        assert m["close_reason"] in ("quorum", "all arrived"), m
        assert sorted(m["chosen"]) == sorted(m["arrived"]) and len(m["arrived"]) >= 2, m
    # round 0 opens once the last worker has fetched the state, and by then the others may
    # have pushed: who arrives first there is the start-up's order, not the straggler's
    quorum_rounds = [m for m in lines if m["close_reason"] == "quorum" and m["round"] > 0]
    assert quorum_rounds, "no round closed on the quorum: the 4x straggler was waited for every round"
    assert all(0 not in m["arrived"] for m in quorum_rounds)  # the slow one is the one left out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["coding_scheme"] == "quorum" and summary["coding_stragglers"] == 1, summary
    check_digests(run_dir, worker_reports(run_dir / "workers"), list(range(3)), rounds)


def test_gc_cr_three_workers_trains_two_partitions_and_finishes(processes: Processes, tmp_path: Path) -> None:
    run_dir, rounds = tmp_path / "run", 4
    run_local(processes, run_dir, 3, rounds, "gc-cr")
    lines = metrics(run_dir)
    assert [m["round"] for m in lines] == list(range(rounds))
    for m in lines:
        assert m["close_reason"] in ("decodable", "all arrived"), m
        assert len(m["arrived"]) >= 2 and set(m["partitions_trained"].values()) == {2}, m
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["partitions_per_worker_round"] == 2.0
    assert summary["final_val_loss"] < summary["initial_val_loss"]
    assert summary["worst_case_coefficient"] > 1.0  # CR decodes with coefficients other than 1
    check_digests(run_dir, worker_reports(run_dir / "workers"), list(range(3)), rounds)


def test_frames_for_closed_rounds_are_dropped_and_counted(tmp_path: Path) -> None:
    rounds = 3
    cfg = load_config(overrides={**CODED, "coordinator.token": TOKEN, "workers": "2", "rounds": str(rounds), "coding.scheme": "pgc-fr",
                                 "coding.stragglers": "1", "coordinator.listen": "127.0.0.1:0",
                                 "coordinator.deadline_s": "60"})
    coordinator = Coordinator(cfg, tmp_path / "run")
    port = coordinator.start()
    address = f"127.0.0.1:{port}"
    # worker 1 pushes only once the round has closed, without looking at the Rounds stream
    # first, as one whose frames reach the coordinator late would: every frame it sends is late
    late = FaultySession(address, TOKEN, 30, fault=Fault.LATE_PUSH)
    workers = [Worker(s, device="cpu", report_dir=tmp_path / "reports") for s in (Session(address, TOKEN, 30), late)]

    def first_joins_first(i: int) -> None:  # the punctual worker joins first and gets id 0
        if i == 0:
            wait_until(lambda: coordinator.registry.live_count == 1, 60, "worker 0 to join")

    codes = run_worker_threads(coordinator, workers, 120, first_joins_first)
    assert codes == {0: 0, 1: 0}
    lines = metrics(tmp_path / "run")
    assert all(m["arrived"] == [0] and m["chosen"] == [0] for m in lines), lines
    assert coordinator.totals.late_frames == rounds  # one late frame a round, from worker 1
    assert late.fired == list(range(rounds))
    assert workers[1].counters.rejected_pushes == rounds
    assert coordinator.totals.rejected_frames == 0


def test_stragglers_benchmark_quick_prints_the_json_keys(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "benchmarks.stragglers", "--quick", "--schemes",
                           "none,pgc-fr,quorum", "--work-dir", str(tmp_path)], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(result) == {"n=2 s=1", "corpus", "data_fingerprint", "versions"}  # + provenance
    case = result["n=2 s=1"]
    assert set(case) == {"none", "pgc-fr", "quorum", "load_average", "pgc_fr_minus_quorum"}
    keys = {"base_round_s", "straggler_round_s", "x_base", "final_val_loss", "loss_vs_none"}
    for scheme in ("none", "pgc-fr", "quorum"):
        assert set(case[scheme]) == keys, case[scheme]
        assert all(len(v) == 2 for v in case[scheme].values())  # mean, sd
    assert case["none"]["loss_vs_none"][0] == 0.0
    assert case["none"]["base_round_s"][0] > 0
    diff = case["pgc_fr_minus_quorum"]  # one seed: the difference, no bounds
    assert diff["seeds"] == 1 and diff["lower95"] is None and diff["upper95"] is None
    # the per-scheme losses are printed to 4 decimals, the difference from the raw ones
    assert abs(diff["mean"] - (case["pgc-fr"]["final_val_loss"][0] - case["quorum"]["final_val_loss"][0])) < 2e-4
