"""Two workers that hold the token and push poisoned frames (one scaled by 1e6, one with
every quantizer level at 3.4e38, both with a valid checksum: geoloco.worker.faults) beside
two honest workers, against the real coordinator: every poisoned frame is rejected, the
offenders are named in the log and the metrics, the honest workers finish, and the run
ends exactly where a run ends whose two offenders push nothing at all (same seed): the
poisoned frames have no effect beyond their absence. Against a clean run of four honest
workers the attacked run has half the data; that figure is printed, not bounded (with
SparseLoCo's per-coordinate mean two workers' frames give a full step, not half a step,
so it is the loss of training on two partitions instead of four)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from run_processes import run_worker_threads, wait_until

from geoloco.config import load_config
from geoloco.coordinator.app import Coordinator
from geoloco.worker.faults import Fault, FaultySession
from geoloco.worker.loop import Worker
from geoloco.worker.session import Session

TOKEN = "poison-test"
ROUNDS = 6
LOSS_TOLERANCE = 0.01
POISONS = {2: Fault.SCALE_FRAME, 3: Fault.MAX_LEVELS}  # worker id -> what it sends
ABSENT_DEADLINE_S = 4.0


def train(run_dir: Path, poisons: dict[int, Fault], deadline_s: float = 120.0) -> tuple[dict, list[dict], dict[int, int]]:
    """Four in-process workers (joined in id order) against a coordinator; the summary, the
    metrics lines and each worker's exit code."""
    cfg = load_config(overrides={
        "workers": 4, "rounds": ROUNDS, "seed": 0, "task.model": "gpt-tiny", "task.seq_len": 32,
        "task.batch_size": 8, "task.val_windows": 16, "task.corpus_bytes": 300_000, "inner.steps": 6,
        "inner.warmup_steps": 3, "coordinator.listen": "127.0.0.1:0", "coordinator.token": TOKEN,
        "coordinator.checkpoint_every": 0, "coordinator.deadline_s": deadline_s,
        "coordinator.join_timeout_s": 120.0})
    coordinator = Coordinator(cfg, run_dir)
    address = f"127.0.0.1:{coordinator.start()}"
    sessions = [FaultySession(address, TOKEN, 30, fault=poisons[i]) if i in poisons else Session(address, TOKEN, 30)
                for i in range(4)]
    workers = [Worker(s, device="cpu") for s in sessions]
    codes = run_worker_threads(coordinator, workers, timeout=400, started=lambda i: wait_until(
        lambda: sessions[i].worker_id is not None, 120, f"worker {i} to join"))
    assert [s.worker_id for s in sessions] == [0, 1, 2, 3]
    for i, fault in poisons.items():
        assert sessions[i].fired == list(range(ROUNDS)), fault
    summary = json.loads((run_dir / "summary.json").read_text())
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return summary, lines, codes


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    handler = Captured()
    logging.getLogger("geoloco.coordinator").addHandler(handler)
    try:
        clean = train(tmp_path_factory.mktemp("clean"), {})
        poisoned = train(tmp_path_factory.mktemp("poisoned"), POISONS)
    finally:
        logging.getLogger("geoloco.coordinator").removeHandler(handler)
    # the offenders silent instead: each round closes at its deadline with the honest two
    absent = train(tmp_path_factory.mktemp("absent"), dict.fromkeys(POISONS, Fault.DROP_PUSH), ABSENT_DEADLINE_S)
    return {"clean": clean, "poisoned": poisoned, "absent": absent, "log": handler.lines}


class Captured(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_every_poisoned_frame_is_rejected_and_its_sender_named(runs) -> None:
    _, lines, codes = runs["poisoned"]
    assert codes == {0: 0, 1: 0, 2: 0, 3: 0}  # nobody is told to "lower inner.lr"
    for m in lines:
        assert m["arrived"] == [0, 1, 2, 3] and m["chosen"] == [0, 1], m
        assert m["rejected_by_worker"] == {"2": 1, "3": 1}, m
        assert m["median_frame_norm"] > 0
    summary = runs["poisoned"][0]
    assert summary["rejected_by_worker"] == {"2": ROUNDS, "3": ROUNDS}
    for worker in POISONS:
        named = [x for x in runs["log"] if f"frame from worker {worker} rejected" in x]
        assert len(named) == ROUNDS, runs["log"][-10:]


def test_the_clean_run_loses_nothing_to_the_bounds(runs) -> None:
    summary, lines, codes = runs["clean"]
    assert codes == {0: 0, 1: 0, 2: 0, 3: 0}
    assert all(m["chosen"] == [0, 1, 2, 3] and not m["rejected_by_worker"] for m in lines)
    assert summary["rejected_by_worker"] == {}


def test_poisoned_frames_change_nothing_but_their_absence(runs, capsys) -> None:
    clean, poisoned = runs["clean"][0]["final_val_loss"], runs["poisoned"][0]["final_val_loss"]
    absent = runs["absent"][0]["final_val_loss"]
    with capsys.disabled():
        print(f"\npoisoning: final validation loss {poisoned:.4f} under attack, {absent:.4f} with the "
              f"two offenders silent ({(poisoned - absent) / absent:+.2%}), {clean:.4f} with four honest "
              f"workers ({(poisoned - clean) / clean:+.2%}); initial {runs['clean'][0]['initial_val_loss']:.4f}")
    assert all(m["chosen"] == [0, 1] for m in runs["absent"][1])
    assert abs(poisoned - absent) <= LOSS_TOLERANCE * absent
