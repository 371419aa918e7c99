"""Disk full on a real coordinator, its run dir on a small tmpfs the test mounts: a
checkpoint that does not fit is one clear error line and leaves no partial folder, the
rounds go on, and once there is room again the next checkpoint is written. With less room
still, a round's close decision does not fit in the round log either: one error line, the
rounds go on unlogged until a checkpoint covers them. The disk is
filled, and checked for partial folders, only while the coordinator is stopped (SIGSTOP)
between two checkpoints: nothing of it is being written then."""

from __future__ import annotations

import os
import re
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from run_processes import SMALL, Processes, coordinator_port, metrics, set_flags, wait_until

from geoloco.coordinator import checkpoint

pytestmark = pytest.mark.slow
ROUNDS = 12
# room left on the full disk: metrics lines fit, a checkpoint (about 4 MB) does not, and
# neither does, with the smaller margin, one round's entry in the round log (two frames of
# gpt-tiny, about 41 kB); round-log entries that fit stop at the first that does not
MARGINS = {"checkpoints": 256 << 10, "round log": 32 << 10}


@pytest.fixture
def small_disk(tmp_path: Path):
    disk = tmp_path / "disk"
    disk.mkdir()
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=32m", "tmpfs", str(disk)],
                           capture_output=True, text=True)
    if mount.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mount.stderr.strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def error_lines(log: str) -> list[str]:
    return [line for line in log.splitlines() if " ERROR " in line]


# what the coordinator logs once a checkpoint is written, or once a failed one is cleaned up
CHECKPOINT_DONE = re.compile(r"checkpoint \S+ \(before round (\d+);|checkpoint before round (\d+) not written")


def last_checkpoint_done(log: str) -> int:
    """The round of the last checkpoint the coordinator finished, written or not; -1 if none."""
    found = CHECKPOINT_DONE.findall(log)
    return int(found[-1][0] or found[-1][1]) if found else -1


@contextmanager
def between_checkpoints(processes: Processes, run_dir: Path) -> Iterator[None]:
    """The coordinator stopped at a moment it writes nothing: its last round's line is in
    metrics.jsonl and the checkpoint after that round is finished (the next write is the
    next round's line, once that round closes). Each try that lands elsewhere continues it."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with processes.paused("coordinator"):
            if last_checkpoint_done(processes.log("coordinator")) == len(metrics(run_dir)):
                yield
                return
        time.sleep(0.05)
    raise AssertionError("the coordinator was never found between two checkpoints")


def fill(disk: Path, leave: int) -> Path:
    """A file that takes all but ``leave`` bytes of ``disk``."""
    filler = disk / "filler"
    free = os.statvfs(disk)
    with open(filler, "wb") as f:
        os.posix_fallocate(f.fileno(), 0, free.f_bavail * free.f_frsize - leave)
    return filler


@pytest.mark.parametrize("full", sorted(MARGINS))
def test_a_full_disk_skips_checkpoints_and_training_goes_on(processes: Processes, small_disk: Path,
                                                            tmp_path: Path, full: str) -> None:
    run_dir = small_disk / "run"
    processes.start("coordinator", ["coordinator", "--listen", "127.0.0.1:0", "--workers", "2",
                                    "--rounds", str(ROUNDS), "--run-dir", str(run_dir),
                                    *set_flags({**SMALL, "coordinator.checkpoint_every": "1"})])
    port = coordinator_port(run_dir)
    for i in range(2):
        processes.start(f"worker-{i}", ["worker", "--coordinator", f"127.0.0.1:{port}",
                                        "--device", "cpu", "--report-dir", str(tmp_path / "reports")])
    wait_until(lambda: len(metrics(run_dir)) >= 2, 180, "two rounds")
    with between_checkpoints(processes, run_dir):
        filler = fill(small_disk, MARGINS[full])
    wait_until(lambda: error_lines(processes.log("coordinator")), 60, "a checkpoint to fail")
    full_at = len(metrics(run_dir))
    wait_until(lambda: len(metrics(run_dir)) >= full_at + 2, 60, "two more rounds on the full disk")
    with between_checkpoints(processes, run_dir):
        assert len(error_lines(processes.log("coordinator"))) >= 2
        assert not [p.name for p in (run_dir / "checkpoints").iterdir() if ".tmp" in p.name]
        filler.unlink()

    assert processes.wait("coordinator", timeout=180) == 0, processes.log("coordinator")[-3000:]
    log = processes.log("coordinator")
    errors = error_lines(log)
    assert errors and all("No space left on device" in e and "training goes on" in e for e in errors), errors
    if full == "round log":
        assert any("not written to the round log" in e for e in errors), errors
    assert "Traceback" not in log
    assert [m["round"] for m in metrics(run_dir)] == list(range(ROUNDS))
    assert checkpoint.load(checkpoint.list_checkpoints(run_dir)[-1]).round == ROUNDS
