"""Overlapped rounds (outer.overlap) in real processes: every replica's global track passes
the coordinator's digest every round, and a run ends with the very parameters of the
sequential in-process computation of the same updates (benchmarks/inprocess.py,
simulate_overlap), which differ from the non-overlapped run's; a worker SIGKILLed during
an overlapped round comes back (a new process takes its dead slot, catches up without
overlap) and agrees; a coordinator killed and resumed during an overlapped run continues
with equal digests, with the late result folded in at the end of the phase or mid-phase
(outer.fold_step). Cost: five local runs of 2 workers (about 15 s each) and three runs of
3 processes (about 60 s each)."""

from __future__ import annotations

import copy
import json
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

from benchmarks.inprocess import simulate, simulate_overlap
from benchmarks.overlap import logged_fold_steps
from geoloco.config import load_config
from geoloco.launch import run_local

pytestmark = pytest.mark.slow
WORKERS = 3
OVERLAP = {**SMALL, "task.seq_len": "16", "task.batch_size": "4", "inner.steps": "4",
           "outer.overlap": "eager"}


@pytest.mark.parametrize(("method", "mode", "fold_step"), [
    ("sparseloco", "eager", None), ("sparseloco", "delayed", None), ("diloco", "eager", None),
    ("sparseloco", "eager", 1), ("sparseloco", "delayed", 1), ("sparseloco", "eager", "arrival")])
def test_overlapped_run_equals_the_sequential_computation(method: str, mode: str, fold_step: int | str | None,
                                                          tmp_path: Path) -> None:
    """fold_step 1: each late result is folded in after the first of the phase's 2 inner
    steps, and the second trains from the global track. "arrival" (4 inner steps): before the
    first step that found it wholly in, which each worker logs, or at the phase's end; the
    simulation folds at those steps. A phase that pushed the round's last frame usually
    gets its result within its first step, but a loaded machine may leave every fold at the
    end: bit for bit either way."""
    cfg = load_config(overrides={
        "workers": 2, "rounds": 4, "inner.steps": 4 if fold_step == "arrival" else 2, "task.seq_len": 16,
        "task.batch_size": 2,
        "task.val_windows": 2, "network.wan": "unlimited", "coordinator.checkpoint_every": 0,
        "run_dir": str(tmp_path / "run"), "compression.method": method, "outer.overlap": mode,
        "outer.fold_step": fold_step,
    })
    assert run_local(cfg).ok
    run = tmp_path / "run"
    reports = [json.loads(p.read_text()) for p in sorted((run / "workers").glob("worker-*.json"))]
    summary = json.loads((run / "summary.json").read_text())
    # every round, every replica's global track matched the coordinator's digest
    assert (summary["digest_mismatches"], summary["worker_resyncs"]) == (0, 0), summary
    assert len(metrics(run)) == 4
    logs = (run / "logs" / "worker-0.log").read_text()
    assert "trains from the running copy" in logs  # the rounds did overlap
    if fold_step == "arrival":  # where each phase folded depends on when its result came: as logged
        steps = logged_fold_steps(run)
        assert all(1 <= k < 4 and 1 <= r < 4 for (_, r), k in steps.items()), steps
    else:
        assert ("folded in before inner step" in logs) == (fold_step is not None)
        steps = None
    result = simulate_overlap(cfg, fold_steps=steps)
    assert [r["digest"] for r in reports] == [result.digest] * 2
    assert result.final_val_loss == summary["final_val_loss"]
    if fold_step is not None:
        at_end = copy.deepcopy(cfg)
        at_end.outer.fold_step = None
        assert simulate_overlap(at_end).digest != result.digest  # the fold's step changed it
    cfg.outer.overlap, cfg.outer.fold_step = "none", None
    assert simulate(cfg).digest != result.digest  # the overlap changed the computation


def start_coordinator(processes: Processes, run_dir: Path, listen: str, rounds: int,
                      extra: dict[str, str], resume: bool = False, name: str = "coordinator") -> None:
    args = ["coordinator", "--listen", listen, "--workers", str(WORKERS), "--rounds", str(rounds),
            "--run-dir", str(run_dir), *set_flags({**OVERLAP, **extra})]
    processes.start(name, args + (["--resume"] if resume else []))


def start_worker(processes: Processes, address: str, report_dir: Path, name: str) -> None:
    processes.start(name, ["worker", "--coordinator", address, "--device", "cpu",
                           "--connect-timeout", "60", "--report-dir", str(report_dir)])


def test_sigkilled_worker_comes_back_and_agrees(processes: Processes, tmp_path: Path) -> None:
    run_dir, reports = tmp_path / "run", tmp_path / "reports"
    rounds = 8
    start_coordinator(processes, run_dir, "127.0.0.1:0", rounds,
                      {"coordinator.liveness_s": "3", "coordinator.deadline_s": "120",
                       "coordinator.checkpoint_every": "0"})
    address = f"127.0.0.1:{coordinator_port(run_dir)}"
    for i in range(WORKERS):
        start_worker(processes, address, reports, f"worker-{i}")
    wait_until(lambda: len(metrics(run_dir)) >= 2, 120, "two rounds to close")
    victim = worker_reports(reports)[1]["pid"]
    name = next(n for n, p in processes.procs.items() if p.pid == victim)
    processes.kill(name)  # mid-run: its frame of the open round is in flight or not yet made
    survivor = next(n for n, p in processes.procs.items() if p.pid == worker_reports(reports)[0]["pid"])
    with processes.paused(survivor):  # no round closes until the new worker is in
        start_worker(processes, address, reports, "worker-new")  # takes the dead slot once it is dead
        wait_until(lambda: processes.log("coordinator").count("worker 1 follows rounds") >= 2, 180,
                   "the new worker to follow the rounds as worker 1")

    assert processes.wait("coordinator", timeout=180) == 0, processes.log("coordinator")[-3000:]
    for n in [n for n in processes.procs if n.startswith("worker") and n != name]:
        assert processes.wait(n, timeout=30) == 0, processes.log(n)[-3000:]
    _, digest = final_coordinator_digest(run_dir)
    finished = worker_reports(reports)
    assert sorted(finished) == [0, 1, 2]
    for report in finished.values():
        assert report["status"] == "finished" and report["digest"] == digest, report
    assert finished[1]["pid"] == processes.procs["worker-new"].pid
    lines = metrics(run_dir)
    assert len(lines) == rounds and 1 in lines[-1]["arrived"]  # back in by the end
    assert "trains from the running copy" in processes.log("worker-new")  # overlapping again


@pytest.mark.parametrize("fold_step", [None, 2])
def test_coordinator_killed_and_resumed_continues_with_equal_digests(
    processes: Processes, tmp_path: Path, fold_step: int | None
) -> None:
    """fold_step 2: the workers wait for the round in flight mid-phase, inside the inner
    loop, when the coordinator dies."""
    run_dir, reports = tmp_path / "run", tmp_path / "reports"
    rounds = 7
    extra = {"coordinator.checkpoint_every": "1", "coordinator.deadline_s": "60",
             **({"outer.fold_step": str(fold_step)} if fold_step is not None else {})}
    start_coordinator(processes, run_dir, "127.0.0.1:0", rounds, extra)
    listen = f"127.0.0.1:{coordinator_port(run_dir)}"  # the port it bound: the resume binds it again
    for i in range(WORKERS):
        start_worker(processes, listen, reports, f"worker-{i}")
    wait_until(lambda: len(metrics(run_dir)) >= 3, 120, "three rounds to close")
    processes.kill("coordinator")  # the workers hold a round in flight
    wait_until(lambda: all("connection lost" in processes.log(f"worker-{i}") for i in range(WORKERS)),
               120, "every worker to see its stream break")
    start_coordinator(processes, run_dir, listen, rounds, extra, resume=True, name="coordinator-2")

    assert processes.wait("coordinator-2", timeout=180) == 0, processes.log("coordinator-2")[-3000:]
    for i in range(WORKERS):
        assert processes.wait(f"worker-{i}", timeout=30) == 0, processes.log(f"worker-{i}")[-3000:]
    round_, digest = final_coordinator_digest(run_dir)
    assert round_ == rounds
    finished = worker_reports(reports)
    assert sorted(finished) == [0, 1, 2]
    for report in finished.values():
        assert report["status"] == "finished" and report["digest"] == digest, report
        assert report["reconnects"] >= 1
    lines = metrics(run_dir)
    assert sorted(m["round"] for m in lines) == list(range(rounds))
    assert all(m["digest_mismatches_by_worker"].get(str(w), 0) == 0 for m in lines for w in range(WORKERS))
    if fold_step is not None:
        assert all("folded in before inner step 2" in processes.log(f"worker-{i}") for i in range(WORKERS))


@pytest.mark.parametrize("scheme", ["none", "gc-fr"])
def test_the_overlap_simulation_without_overlap_is_the_plain_one(scheme: str) -> None:
    """simulate_overlap's loop with overlap none takes the order of simulate, bit for bit,
    so the loss benchmarks compare the modes on one code path."""
    cfg = load_config(overrides={"workers": 2, "rounds": 3, "inner.steps": 2, "task.seq_len": 16,
                                 "task.batch_size": 2, "task.val_windows": 2, "coding.scheme": scheme,
                                 "coding.stragglers": 0 if scheme == "none" else 1})
    plain, looped = simulate(cfg), simulate_overlap(cfg)
    assert (plain.digest, plain.final_val_loss) == (looped.digest, looped.final_val_loss)


def test_gradient_coding_under_overlap_keeps_the_replicas_equal(tmp_path: Path) -> None:
    """Classic FR with s = 1 and two workers: each round closes at the first frame, so the
    slow worker (a fixed straggler) is behind in most rounds: its result is in before it
    pushes, and it applies it without pushing (or settles its late frame); the replicas
    still agree every round and at the end."""
    cfg = load_config(overrides={
        "workers": 2, "rounds": 5, "inner.steps": 2, "task.seq_len": 16, "task.batch_size": 2,
        "task.val_windows": 2, "network.wan": "unlimited", "coordinator.checkpoint_every": 0,
        "run_dir": str(tmp_path / "run"), "outer.overlap": "eager", "coding.scheme": "gc-fr",
        "coding.stragglers": 1, "stragglers.per_worker": ["none", "fixed:4"],
    })
    assert run_local(cfg).ok
    run = tmp_path / "run"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["digest_mismatches"] == 0, summary
    _, digest = final_coordinator_digest(run)
    reports = [json.loads(p.read_text()) for p in sorted((run / "workers").glob("worker-*.json"))]
    assert [r["digest"] for r in reports] == [digest] * 2
    lines = metrics(run)
    assert len(lines) == 5 and any(m["arrived"] == [0] for m in lines), lines
