"""Disk full on a real coordinator, its run dir on a small tmpfs the test mounts: a
checkpoint that does not fit is one clear error line and leaves no partial folder, the
rounds go on, and once there is room again the next checkpoint is written."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from run_processes import SMALL, Processes, coordinator_port, metrics, set_flags, wait_until

from geoloco.coordinator import checkpoint

pytestmark = pytest.mark.slow
ROUNDS = 12
MARGIN_BYTES = 256 << 10  # room left on the full disk: metrics lines fit, a checkpoint does not


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


def test_a_full_disk_skips_checkpoints_and_training_goes_on(processes: Processes, small_disk: Path,
                                                            tmp_path: Path) -> None:
    run_dir = small_disk / "run"
    processes.start("coordinator", ["coordinator", "--listen", "127.0.0.1:0", "--workers", "2",
                                    "--rounds", str(ROUNDS), "--run-dir", str(run_dir),
                                    *set_flags({**SMALL, "coordinator.checkpoint_every": "1"})])
    port = coordinator_port(run_dir)
    for i in range(2):
        processes.start(f"worker-{i}", ["worker", "--coordinator", f"127.0.0.1:{port}",
                                        "--device", "cpu", "--report-dir", str(tmp_path / "reports")])
    wait_until(lambda: len(metrics(run_dir)) >= 2, 180, "two rounds")
    filler = small_disk / "filler"
    with open(filler, "wb") as f:
        os.posix_fallocate(f.fileno(), 0, os.statvfs(small_disk).f_bavail * os.statvfs(small_disk).f_frsize
                           - MARGIN_BYTES)
    wait_until(lambda: error_lines(processes.log("coordinator")), 60, "a checkpoint to fail")
    full_at = len(metrics(run_dir))
    wait_until(lambda: len(metrics(run_dir)) >= full_at + 2, 60, "two more rounds on the full disk")
    assert not [p for p in (run_dir / "checkpoints").iterdir() if ".tmp" in p.name]
    filler.unlink()

    assert processes.wait("coordinator", timeout=180) == 0, processes.log("coordinator")[-3000:]
    log = processes.log("coordinator")
    errors = error_lines(log)
    assert errors and all("No space left on device" in e and "training goes on" in e for e in errors), errors
    assert "Traceback" not in log
    assert [m["round"] for m in metrics(run_dir)] == list(range(ROUNDS))
    assert checkpoint.load(checkpoint.list_checkpoints(run_dir)[-1]).round == ROUNDS
