"""Exactly once across coordinator kills, against real processes: a coordinator SIGKILLed
between a round's logged decision and its broadcast, between the broadcast and its own
apply (the apply is in memory: a kill during it leaves the same), or while the checkpoint
after the round is half written, resumes with --resume, replays the rounds of its round log after the checkpoint
instead of redoing them, and the run ends on the same final parameters, bit for bit, as the
undisturbed run of the same seed: every replica takes each round once (applies it, or, when
the kill cut its result off, fetches a state that holds it), and each round is in
metrics.jsonl once. Killed after the last round's decision, the resumed run replays it,
hands it to the workers that rejoin for it, and ends. With an aggregated round result
(coordinator.broadcast aggregate) the same holds: the coordinator's error feedback comes
back bit for bit from the checkpoint, and the replay compresses the logged rounds'
aggregates again, so the rounds after the kill send the frames the undisturbed run sent."""

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
    worker_reports,
)

pytestmark = pytest.mark.slow
WORKERS, ROUNDS, KILLED_ROUND = 2, 6, 3
FAST = {**SMALL, "task.seq_len": "16", "task.batch_size": "4", "inner.steps": "4",
        "inner.warmup_steps": "2", "coordinator.checkpoint_every": "2",
        "coordinator.deadline_s": "300"}


def run(processes: Processes, tmp_path: Path, name: str, crash_at: str | None,
        killed_round: int = KILLED_ROUND, flags: dict[str, str] = FAST) -> str:
    """One run of the seed; with ``crash_at`` its coordinator kills itself there and is
    resumed. Returns the final digest, after checking each replica and metrics line."""
    run_dir, reports = tmp_path / f"run-{name}", tmp_path / f"reports-{name}"
    args = ["coordinator", "--workers", str(WORKERS), "--rounds", str(ROUNDS), "--run-dir", str(run_dir),
            *set_flags(flags)]
    processes.start(f"{name}-coordinator", [*args, "--listen", "127.0.0.1:0",
                                            *(["--crash-at", crash_at] if crash_at else [])])
    listen = f"127.0.0.1:{coordinator_port(run_dir)}"  # the port it bound: the resume binds it again
    for i in range(WORKERS):
        processes.start(f"{name}-worker-{i}", ["worker", "--coordinator", listen, "--device", "cpu",
                                               "--connect-timeout", "120", "--report-dir", str(reports)])
    if crash_at is not None:
        assert processes.wait(f"{name}-coordinator", timeout=240) == -9
        assert f"crash point {crash_at.replace(':', ' of round ')}" in processes.log(f"{name}-coordinator")
        processes.start(f"{name}-resumed", [*args, "--listen", listen, "--resume"])
        assert processes.wait(f"{name}-resumed", timeout=240) == 0, processes.log(f"{name}-resumed")[-3000:]
        assert f"round {killed_round} replayed from the round log" in processes.log(f"{name}-resumed")
    else:
        assert processes.wait(f"{name}-coordinator", timeout=240) == 0
    for i in range(WORKERS):
        assert processes.wait(f"{name}-worker-{i}", timeout=60) == 0, processes.log(f"{name}-worker-{i}")[-3000:]
    assert [m["round"] for m in metrics(run_dir)] == list(range(ROUNDS))
    round_, digest = final_coordinator_digest(run_dir)
    assert round_ == ROUNDS
    finished = worker_reports(reports)
    assert sorted(finished) == list(range(WORKERS))
    for report in finished.values():
        assert report["status"] == "finished" and report["digest"] == digest and report["resyncs"] == 0
    for i in range(WORKERS):
        each_round_once(processes.log(f"{name}-worker-{i}"))
    return digest


THETA_EVENT = re.compile(r"fetched state of round (?P<fetched>\d+)|round (?P<applied>\d+) applied:")


def each_round_once(worker_log: str) -> None:
    """θ took every round once, in order: each result applied to θ holding exactly the
    rounds before it, or taken inside a fetched state (the state of round r holds rounds
    0 .. r - 1: a worker whose result a kill cut off fetches it on rejoining), and none
    applied twice."""
    held = 0  # θ holds rounds 0 .. held - 1
    for event in THETA_EVENT.finditer(worker_log):
        if event["fetched"] is not None:
            held = int(event["fetched"])
            continue
        applied = int(event["applied"])
        assert applied == held, f"round {applied} applied to θ holding rounds 0..{held - 1}"
        held = applied + 1
    assert held == ROUNDS, f"θ ends holding rounds 0..{held - 1}"


def test_a_coordinator_killed_between_decision_broadcast_and_apply_ends_bit_identical(
        processes: Processes, tmp_path: Path) -> None:
    undisturbed = run(processes, tmp_path, "undisturbed", None)
    for stage in ("decision", "broadcast", "checkpoint"):
        assert run(processes, tmp_path, stage, f"{stage}:{KILLED_ROUND}") == undisturbed, stage
    # killed with the checkpoint after the killed round half written: the resume removes
    # it and starts from the one before, replaying the logged rounds since
    assert "left by a write that was cut off" in processes.log("checkpoint-resumed")
    # the last round's decision logged, not broadcast: the resumed run replays it, the
    # workers that wait for it rejoin and get it, and the run ends
    last = ROUNDS - 1
    assert run(processes, tmp_path, "last", f"decision:{last}", last) == undisturbed


def test_an_aggregated_result_survives_a_kill_after_its_decision_bit_identical(
        processes: Processes, tmp_path: Path) -> None:
    flags = {**FAST, "coordinator.broadcast": "aggregate"}
    undisturbed = run(processes, tmp_path, "aggregate", None, flags=flags)
    assert run(processes, tmp_path, "aggregate-killed", f"decision:{KILLED_ROUND}", flags=flags) == undisturbed
    sent = [m["broadcast"] for m in metrics(tmp_path / "run-aggregate-killed")]
    assert sent == ["aggregate"] * ROUNDS
