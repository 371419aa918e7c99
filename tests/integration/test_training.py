"""End to end through ``geoloco local``: the real coordinator and 3 worker processes on
loopback behind link emulator relays. Validation loss goes down, every replica ends on the
coordinator's digest, and the frame sizes in metrics.jsonl are the codec's figures."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest
import torch
from run_processes import (
    SMALL,
    Processes,
    final_coordinator_digest,
    metrics,
    set_flags,
    worker_reports,
)

from geoloco.compression import Compressor, Layout, encode_dense
from geoloco.config import load_config
from geoloco.tasks import build_task

pytestmark = pytest.mark.slow
WORKERS = 3
ROUNDS = 5


def run_local(processes: Processes, run_dir: Path, extra: dict[str, str], method: str) -> str:
    args = ["local", "--workers", str(WORKERS), "--rounds", str(ROUNDS), "--wan", "unlimited",
            "--run-dir", str(run_dir), "--method", method, "--stall-timeout", "60",
            *set_flags({**SMALL, **extra})]
    processes.start("local", args)
    code = processes.wait("local", timeout=240)
    log = processes.log("local")
    assert code == 0, log[-4000:]
    return log


def run_layout(run_dir: Path) -> Layout:
    cfg = load_config(run_dir / "config.json")
    model = build_task(cfg.task, cfg.workers, seed=cfg.seed).make_model()
    return Layout.from_named_tensors(model.named_parameters())


def check_replicas(run_dir: Path) -> None:
    round_, digest = final_coordinator_digest(run_dir)
    assert round_ == ROUNDS
    reports = worker_reports(run_dir / "workers")
    assert sorted(reports) == list(range(WORKERS))
    for wid, report in reports.items():
        assert report["status"] == "finished", report
        assert report["digest"] == digest, f"worker {wid} ended on another digest"
        assert report["resyncs"] == 0


def check_loss_went_down(run_dir: Path, lines: list[dict]) -> dict:
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["rounds"] == ROUNDS
    assert summary["final_val_loss"] < summary["initial_val_loss"] - 0.3, summary
    # the last round always validates; the others only while a validation costs little
    # beside a round (coordinator.val_every's default), so under load some have none
    measured = [m["val_loss"] for m in lines if m["val_loss"] is not None]
    assert lines[-1]["val_loss"] == summary["final_val_loss"] == measured[-1]
    assert len(measured) == 1 or measured[-1] < measured[0], measured
    assert summary["digest_mismatches"] == 0
    return summary


def test_sparseloco_run_converges_and_replicas_agree(processes: Processes, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    out = run_local(processes, run_dir, {"compression.index_coding": "fixed"}, "sparseloco")
    lines = metrics(run_dir)
    assert [m["round"] for m in lines] == list(range(ROUNDS))
    assert all(sorted(m["arrived"]) == list(range(WORKERS)) for m in lines)
    summary = check_loss_went_down(run_dir, lines)
    check_replicas(run_dir)

    # Fixed-width index coding makes a sparse frame's size a function of layout and density.
    cfg = load_config(run_dir / "config.json")
    layout = run_layout(run_dir)
    gen = torch.Generator().manual_seed(0)
    deltas = [torch.randn(s.shape, generator=gen) for s in layout.specs]
    expected = len(Compressor(layout, density=cfg.compression.density, beta=cfg.compression.ef_beta,
                              tile=cfg.compression.tile, index_coding="fixed").compress(deltas, round=0, sender=0))
    for m in lines:
        assert set(m["upload_bytes"].values()) == {expected}, m
        header_bytes = m["download_bytes_per_worker"] - WORKERS * expected
        assert 0 < header_bytes < 1024, m  # the broadcast is the workers' own frames + a header
    dense = len(encode_dense(layout, deltas, round=0, sender=0, dtype="fp32"))
    assert summary["dense_fp32_bytes"] == dense
    assert expected < 0.05 * dense
    for wid, relay in summary["relay_bytes"].items():  # the relays carried at least the frames
        assert relay["up"] + relay["down"] >= ROUNDS * expected * (1 + WORKERS), wid
    assert f"round {ROUNDS - 1}/{ROUNDS - 1}" in out and "summary of" in out
    check_mutual_tls_and_no_token_written(run_dir)


def check_mutual_tls_and_no_token_written(run_dir: Path) -> None:
    """`geoloco local` runs the deployed path: mutual TLS with credentials of its own, the
    token in a 0600 file and in no config.json."""
    token = (run_dir / "certs" / "token").read_text().strip()
    assert stat.S_IMODE((run_dir / "certs" / "token").stat().st_mode) == 0o600
    assert token not in (run_dir / "config.json").read_text()
    coordinator_log = (run_dir / "logs" / "coordinator.log").read_text()
    assert "(mutual TLS)" in coordinator_log and token not in coordinator_log


def test_dense_diloco_run_converges_and_frames_are_dense_fp32(processes: Processes, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_local(processes, run_dir, {}, "diloco")
    lines = metrics(run_dir)
    check_loss_went_down(run_dir, lines)
    check_replicas(run_dir)
    layout = run_layout(run_dir)
    dense = len(encode_dense(layout, [torch.zeros(s.shape) for s in layout.specs], round=0, sender=0))
    for m in lines:
        assert set(m["upload_bytes"].values()) == {dense}, m
