"""A worker holding the token sends tiny frames (every quantizer level scaled by 1e-6,
checksum repaired: geoloco.worker.faults.Fault.SHRINK_FRAME) to make the frame bounds'
reference tiny, so that the honest frames look 1e6 x too large and are dropped. Against the
real coordinator: at n = 2 (too few workers to tell which is honest) the honest frame is
clipped, never dropped; at n = 4 the reference stays an honest frame's, and the honest
frames are neither dropped nor clipped. Before the reference pool (guard.min_reference_workers,
guard.reference_rounds) the n = 2 attack dropped every honest frame."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from run_processes import run_worker_threads, wait_until

from geoloco.config import load_config
from geoloco.coordinator.app import Coordinator
from geoloco.worker.faults import Fault, FaultySession
from geoloco.worker.loop import Worker
from geoloco.worker.session import Session

TOKEN = "suppression-test"
ROUNDS = 4
pytestmark = pytest.mark.slow


def attacked_run(run_dir: Path, n: int, attacker: int) -> list[dict]:
    """n in-process workers, ``attacker`` shrinking every frame it pushes; every worker
    must finish; the metrics lines."""
    cfg = load_config(overrides={
        "workers": n, "rounds": ROUNDS, "seed": 0, "task.model": "gpt-tiny", "task.seq_len": 32,
        "task.batch_size": 4, "task.val_windows": 8, "task.corpus_bytes": 200_000, "inner.steps": 3,
        "inner.warmup_steps": 2, "coordinator.listen": "127.0.0.1:0", "coordinator.token": TOKEN,
        "coordinator.checkpoint_every": 0, "coordinator.deadline_s": 120.0,
        "coordinator.join_timeout_s": 120.0})
    coordinator = Coordinator(cfg, run_dir)
    address = f"127.0.0.1:{coordinator.start()}"
    sessions = [FaultySession(address, TOKEN, 30, fault=Fault.SHRINK_FRAME) if i == attacker
                else Session(address, TOKEN, 30) for i in range(n)]
    workers = [Worker(s, device="cpu") for s in sessions]
    codes = run_worker_threads(coordinator, workers, timeout=400, started=lambda i: wait_until(
        lambda: sessions[i].worker_id is not None, 120, f"worker {i} to join"))
    assert codes == dict.fromkeys(range(n), 0)
    assert [s.worker_id for s in sessions] == list(range(n))
    assert sessions[attacker].fired == list(range(ROUNDS))
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_at_n_2_a_tiny_frame_gets_the_honest_frame_clipped_not_dropped(tmp_path: Path) -> None:
    lines = attacked_run(tmp_path / "run", n=2, attacker=1)
    assert len(lines) == ROUNDS
    for m in lines:
        assert m["rejected_by_worker"] == {}, m
        assert m["chosen"] == [0, 1], m
        assert m["clipped_by_worker"] == {"0": 1}, m  # scaled to 2 x the tiny reference


def test_at_n_4_one_tiny_sender_leaves_the_honest_frames_whole(tmp_path: Path) -> None:
    lines = attacked_run(tmp_path / "run", n=4, attacker=3)
    for m in lines:
        assert m["rejected_by_worker"] == {} and m["chosen"] == [0, 1, 2, 3], m
        assert m["clipped_by_worker"] == {}, m
