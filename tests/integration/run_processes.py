"""Helpers for integration tests that start real ``geoloco`` processes on loopback: small
configs, the port a coordinator bound, process groups that are always cleaned up, run-dir readers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from geoloco.coordinator import checkpoint
from geoloco.replica import param_digest

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "integration"
# gpt-tiny with short sequences and few inner steps: a round takes well under a second.
SMALL = {
    "task.model": "gpt-tiny", "task.seq_len": "32", "task.batch_size": "8",
    "task.val_windows": "16", "task.corpus_bytes": "300000",
    "inner.steps": "8", "inner.warmup_steps": "4", "inner.lr": "3e-3",
    "coordinator.join_timeout_s": "60",
}


def set_flags(values: dict[str, Any]) -> list[str]:
    """``--set key=value`` for every item."""
    return [arg for key, value in values.items() for arg in ("--set", f"{key}={value}")]


class Processes:
    """Processes started by one test; ``cleanup`` kills whatever is still running."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, args: list[str]) -> subprocess.Popen:
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", GEOLOCO_TOKEN=TOKEN,
                   PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
        out = open(self.log_dir / f"{name}.log", "ab")  # noqa: SIM115 - the child owns it
        proc = subprocess.Popen([sys.executable, "-m", "geoloco.cli", *args], stdout=out,
                                stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True)
        out.close()
        self.procs[name] = proc
        return proc

    def log(self, name: str) -> str:
        return (self.log_dir / f"{name}.log").read_text(errors="replace")

    def wait(self, name: str, timeout: float) -> int:
        try:
            return self.procs[name].wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{name} still running after {timeout}s; log:\n{self.log(name)[-3000:]}") from None

    @contextmanager
    def paused(self, name: str) -> Iterator[None]:
        """``name``'s process group stopped (SIGSTOP) for the block, then continued: the
        process does nothing meanwhile, so the test can look at or change what it writes."""
        proc = self.procs[name]
        os.killpg(proc.pid, signal.SIGSTOP)
        try:
            wait_until(lambda: stopped(proc.pid), 30, f"{name} to stop", poll=0.005)
            yield
        finally:
            os.killpg(proc.pid, signal.SIGCONT)

    def kill(self, name: str) -> None:
        proc = self.procs[name]
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    def cleanup(self) -> None:
        for name in list(self.procs):
            self.kill(name)


def stopped(pid: int) -> bool:
    """Whether every thread of ``pid`` is stopped (state T in /proc)."""
    states = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            states.append((task / "stat").read_text().rsplit(")", 1)[1].split()[0])
        except FileNotFoundError:  # a thread that just ended
            continue
    return all(state in "Tt" for state in states)


def wait_until(condition: Callable[[], bool], timeout: float, what: str, poll: float = 0.1) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(poll)


def coordinator_port(run_dir: Path, timeout: float = 90) -> int:
    """The port a coordinator started with ``--listen HOST:0`` wrote to run_dir/coordinator.port."""
    port_file = run_dir / "coordinator.port"
    wait_until(lambda: port_file.exists() and port_file.read_text().strip().isdigit(), timeout,
               "the coordinator to write its port")
    return int(port_file.read_text())


def run_worker_threads(coordinator: Any, workers: list[Any], timeout: float,
                       started: Callable[[int], None] | None = None) -> dict[int, int]:
    """Run in-process workers (objects with ``run()`` and ``close()``, such as a
    geoloco.worker.loop.Worker over a FaultySession) on threads until the coordinator's run
    ends; then close them and stop the coordinator. started(i), if given, runs after worker i's
    thread starts. Returns each worker's exit code by position."""
    codes: dict[int, int] = {}
    threads = []
    try:
        for i, w in enumerate(workers):
            threads.append(threading.Thread(target=lambda i=i, w=w: codes.__setitem__(i, w.run()), daemon=True))
            threads[-1].start()
            if started is not None:
                started(i)
        for t in threads:
            t.join(timeout=timeout)
        assert coordinator.wait(timeout=60)
    finally:
        for w in workers:
            w.close()
        coordinator.stop(grace=0.5)
    return codes


def metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def worker_reports(report_dir: Path) -> dict[int, dict[str, Any]]:
    reports = [json.loads(p.read_text()) for p in sorted(report_dir.glob("worker-*.json"))]
    return {r["worker_id"]: r for r in reports}


def final_coordinator_digest(run_dir: Path) -> tuple[int, str]:
    """Round and parameter digest of the newest checkpoint (the final one after a run)."""
    ckpt = checkpoint.load_latest(run_dir)
    assert ckpt is not None, f"no checkpoint in {run_dir}"
    return ckpt.round, param_digest([t.to(torch.float32) for t in ckpt.params.values()])
