"""Stopping real runs: one Ctrl-C (SIGINT to the process group) on `geoloco local` stops
every process within seconds without a traceback, the coordinator checkpoints the open
round, `local` prints its summary, and `geoloco local --resume` finishes the run with
every round once; a second Ctrl-C, while the clean stop waits for a held coordinator,
forces the stop at once: no summary, no checkpoint, no process left behind."""

from __future__ import annotations

import os
import signal
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

pytestmark = pytest.mark.slow
ROUNDS = 6


def local_args(run_dir: Path, *extra: str) -> list[str]:
    return ["local", "--workers", "2", "--rounds", str(ROUNDS), "--wan", "unlimited",
            "--run-dir", str(run_dir), "--stall-timeout", "60", "--progress", "lines", *extra,
            *set_flags({**SMALL, "coordinator.checkpoint_every": "0"})]


def no_tracebacks(run_dir: Path, processes: Processes, name: str) -> None:
    logs = {p.name: p.read_text(errors="replace") for p in (run_dir / "logs").glob("*.log")}
    logs[name] = processes.log(name)
    for log_name, text in logs.items():
        assert "Traceback" not in text, f"{log_name}:\n{text[-3000:]}"


def group_gone(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


def test_one_ctrl_c_checkpoints_and_local_resume_finishes_the_run(processes: Processes,
                                                                  tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    local = processes.start("local", local_args(run_dir))
    wait_until(lambda: len(metrics(run_dir)) >= 2, 180, "two rounds")
    os.killpg(local.pid, signal.SIGINT)  # what Ctrl-C on a terminal does
    assert processes.wait("local", timeout=60) == 130
    wait_until(lambda: group_gone(local.pid), 10, "every process of the run to end")
    no_tracebacks(run_dir, processes, "local")
    done = len(metrics(run_dir))
    newest = checkpoint.list_checkpoints(run_dir)[-1]
    assert checkpoint.load(newest).round == done  # the stop checkpointed the open round
    assert "checkpointing the model before round" in (run_dir / "logs" / "coordinator.log").read_text()
    assert f"summary of {run_dir}" in processes.log("local")

    processes.start("resumed", local_args(run_dir, "--resume"))
    assert processes.wait("resumed", timeout=240) == 0, processes.log("resumed")[-4000:]
    assert [m["round"] for m in metrics(run_dir)] == list(range(ROUNDS))
    round_, digest = final_coordinator_digest(run_dir)
    assert round_ == ROUNDS
    reports = worker_reports(run_dir / "workers")
    assert sorted(reports) == [0, 1]
    assert all(r["status"] == "finished" and r["digest"] == digest for r in reports.values())
    assert "resumed from the checkpoint before round" in (run_dir / "logs" / "coordinator.log").read_text()


def child_pid(parent: int, role: str) -> int:
    """The pid of ``parent``'s child ``geoloco <role>``."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            stat = (proc / "stat").read_text()
            args = (proc / "cmdline").read_bytes().split(b"\0")
        except (FileNotFoundError, ProcessLookupError, NotADirectoryError):
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == parent and role.encode() in args:
            return int(proc.name)
    raise AssertionError(f"no child {role} of {parent}")


def test_a_second_ctrl_c_forces_the_stop_and_leaves_no_process(processes: Processes,
                                                               tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    local = processes.start("local", local_args(run_dir))
    wait_until(lambda: len(metrics(run_dir)) >= 1, 180, "round 0")
    # the coordinator held (SIGSTOP): the clean stop cannot end before the second Ctrl-C,
    # which would otherwise wait COORDINATOR_STOP_S for its checkpoint, then kill it
    os.kill(child_pid(local.pid, "coordinator"), signal.SIGSTOP)
    os.killpg(local.pid, signal.SIGINT)
    wait_until(lambda: "SIGINT: stopping cleanly" in processes.log("local"), 30, "the first Ctrl-C")
    os.killpg(local.pid, signal.SIGINT)
    assert processes.wait("local", timeout=30) == 130
    wait_until(lambda: group_gone(local.pid), 10, "every process of the run to end")
    log = processes.log("local")
    assert "SIGINT again: stopping now" in log, log[-3000:]
    # what only the forced stop does: no wait for the coordinator, no summary, no checkpoint
    assert "did not stop within" not in log and f"summary of {run_dir}" not in log, log[-3000:]
    assert "checkpointing the model before round" not in (run_dir / "logs" / "coordinator.log").read_text()
    assert [checkpoint.load(p).round for p in checkpoint.list_checkpoints(run_dir)] == [0]


def test_sigterm_stops_a_coordinator_and_workers_run_directly(processes: Processes, tmp_path: Path) -> None:
    run_dir, reports = tmp_path / "run", tmp_path / "reports"
    processes.start("coordinator", ["coordinator", "--listen", "127.0.0.1:0", "--workers", "2",
                                    "--rounds", "40", "--run-dir", str(run_dir),
                                    *set_flags({**SMALL, "coordinator.checkpoint_every": "0"})])
    address = f"127.0.0.1:{coordinator_port(run_dir)}"
    for i in range(2):
        processes.start(f"worker-{i}", ["worker", "--coordinator", address, "--device", "cpu",
                                        "--report-dir", str(reports)])
    wait_until(lambda: len(metrics(run_dir)) >= 2, 180, "two rounds")
    # the workers first (each stops where it is and says so; the open round waits for them),
    # while the coordinator runs: once it is gone a worker may be failing its rejoin already
    for name in ("worker-0", "worker-1"):
        os.kill(processes.procs[name].pid, signal.SIGTERM)
        assert processes.wait(name, timeout=60) == 130, processes.log(name)[-3000:]
    assert sorted(r["status"] for r in worker_reports(reports).values()) == ["stopped", "stopped"]
    # then the coordinator: it checkpoints the open round and writes its summary
    os.kill(processes.procs["coordinator"].pid, signal.SIGTERM)
    assert processes.wait("coordinator", timeout=120) == 130
    log = processes.log("coordinator")
    done = len(metrics(run_dir))
    assert f"SIGTERM: checkpointing the model before round {done} (a resume runs it) and stopping" in log, log[-3000:]
    assert checkpoint.load(checkpoint.list_checkpoints(run_dir)[-1]).round == done
    assert (run_dir / "summary.json").exists()
    for name in ("coordinator", "worker-0", "worker-1"):
        assert "Traceback" not in processes.log(name), processes.log(name)[-3000:]
