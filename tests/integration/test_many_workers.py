"""Sixteen workers against one real coordinator (issue 25, "many workers on one machine"):
in-process workers on threads (a tiny model each, so sixteen fit 2 cores), real gRPC on
loopback and real frames. Under the default scheme and ``pgc-fr`` with s = 3 (four groups
of four) with ``coordinator.broadcast = frames``, and ``gc-fr`` with ``aggregate`` (its
CREDIT settlements are what the aggregate changes most; scheme ``none`` with ``aggregate``
runs in real processes in test_round_log), every
worker finishes, every replica ends on the coordinator's parameters bit for bit, the loss
falls, and each worker's download is what the mode sends: with ``frames`` the round header
and every kept worker's frame, so it grows with n; with ``aggregate`` the header and one
frame of the coordinator's (at twice the workers' density), under two of the workers'
frames whatever n (``gc-fr``: the
group-mates of the chosen frames settle by CREDIT, with the mate's frame beside the
aggregate)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from run_processes import metrics, run_worker_threads, wait_until

from geoloco.config import load_config
from geoloco.coordinator.app import Coordinator
from geoloco.replica import param_digest
from geoloco.worker.loop import Worker
from geoloco.worker.session import Session

N = 16
ROUNDS = 5
TOKEN = "many-workers-test"
pytestmark = pytest.mark.slow


def train(run_dir: Path, scheme: str, stragglers: int,
          broadcast: str) -> tuple[Coordinator, list[Worker], dict[int, int]]:
    cfg = load_config(overrides={
        "workers": N, "rounds": ROUNDS, "seed": 0, "task.model": "gpt-tiny", "task.seq_len": 32,
        "task.batch_size": 2, "task.val_windows": 32, "task.corpus_bytes": 400_000,
        "inner.steps": 3, "inner.warmup_steps": 1, "inner.lr": 3e-3,
        "coding.scheme": scheme, "coding.stragglers": stragglers,
        "coordinator.listen": "127.0.0.1:0", "coordinator.token": TOKEN,
        "coordinator.checkpoint_every": 0, "coordinator.deadline_s": 600.0,
        "coordinator.join_timeout_s": 600.0, "coordinator.liveness_s": 600.0,
        "coordinator.broadcast": broadcast,
        # one frame at twice the workers' density: the setting whose download does not grow
        # with n (the default carries the union of the round's frames, which grows up to n = 64)
        "coordinator.broadcast_density": 2 * load_config().compression.density if broadcast == "aggregate" else None})
    coordinator = Coordinator(cfg, run_dir)
    address = f"127.0.0.1:{coordinator.start()}"
    sessions = [Session(address, TOKEN, 120) for _ in range(N)]
    workers = [Worker(s, device="cpu") for s in sessions]
    codes = run_worker_threads(coordinator, workers, timeout=1200, started=lambda i: wait_until(
        lambda: sessions[i].worker_id is not None, 300, f"worker {i} to join"))
    return coordinator, workers, codes


@pytest.mark.parametrize(("scheme", "stragglers", "broadcast"), [
    ("none", 0, "frames"), ("pgc-fr", 3, "frames"), ("gc-fr", 3, "aggregate")])
def test_sixteen_workers_train_to_one_digest(tmp_path: Path, scheme: str, stragglers: int, broadcast: str) -> None:
    coordinator, workers, codes = train(tmp_path, scheme, stragglers, broadcast)
    assert codes == dict.fromkeys(range(N), 0), codes
    digests = {param_digest(w.theta) for w in workers}
    assert digests == {coordinator.digest()}, "a replica ended off the coordinator's parameters"

    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["rounds"] == ROUNDS
    assert summary["digest_mismatches"] == 0 and summary["rejected_frames"] == 0
    assert summary["final_val_loss"] < summary["initial_val_loss"], summary

    lines = metrics(tmp_path)
    assert [m["round"] for m in lines] == list(range(ROUNDS))
    for m in lines:
        frames = {int(k): v for k, v in m["upload_bytes"].items()}
        chosen = sum(frames[i] for i in m["chosen"])
        assert m["broadcast"] == broadcast, m
        if broadcast == "frames":
            # each worker is sent the round header and every chosen frame, its own included
            # (none: all n; pgc-fr: a decodable set), a header of a few hundred bytes
            assert chosen < m["download_bytes_per_worker"] < chosen + 16 * 1024, m
        else:  # one frame at twice the workers' density, whatever n
            assert m["download_bytes_per_worker"] < 2 * max(frames.values()) + 16 * 1024, m
            assert m["download_bytes_per_worker"] < chosen / 2, m
        if scheme == "none":
            assert sorted(m["chosen"]) == list(range(N)), m
    if scheme == "gc-fr":  # every round chose one frame per group: the others were CREDITed
        assert all(len(m["chosen"]) == 4 for m in lines), lines
