"""A worker slower to start than coordinator.liveness_s, against a real coordinator on
loopback: from its Join until it follows the rounds, its Rounds stream of a starting worker
keeps it live, so a new worker's Join in that time is refused (every slot held) instead of
taking its slot; the slow worker then plays every round. A starting worker that dies frees
its slot liveness_s later, as any other.

The slowness is a seam of the real session: its first FetchState waits for the test."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from run_processes import SMALL, TOKEN, run_worker_threads, wait_until, worker_reports

from geoloco.config import load_config
from geoloco.coordinator.app import Coordinator
from geoloco.replica import param_digest
from geoloco.transport import JoinRefused
from geoloco.worker.loop import Worker
from geoloco.worker.session import Session, State

pytestmark = pytest.mark.slow
LIVENESS_S = 1.0


class SlowStart(Session):
    """A session whose first FetchState (the last step of a worker's start) waits until
    ``go`` is set; ``starting`` is set when it begins to wait."""

    def __init__(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003 - Session's own
        super().__init__(*args, **kwargs)
        self.starting, self.go = threading.Event(), threading.Event()

    def fetch_state(self) -> State:
        if not self.starting.is_set():
            self.starting.set()
            self.go.wait()
        return super().fetch_state()


def coordinator(tmp_path: Path, workers: int, rounds: int) -> tuple[Coordinator, str]:
    cfg = load_config(overrides={**SMALL, "coordinator.token": TOKEN, "workers": str(workers),
                                 "rounds": str(rounds), "coordinator.listen": "127.0.0.1:0",
                                 "coordinator.checkpoint_every": "0", "coordinator.deadline_s": "120",
                                 "coordinator.liveness_s": str(LIVENESS_S)})
    coord = Coordinator(cfg, tmp_path / "run")
    return coord, f"127.0.0.1:{coord.start()}"


def join_once(address: str) -> int:
    """A new worker's single Join: its id, or JoinRefused."""
    session = Session(address, TOKEN, connect_timeout_s=0)
    try:
        return session.join("cpu").worker_id
    finally:
        session.close()


def test_a_worker_slower_to_start_than_liveness_keeps_its_slot(tmp_path: Path) -> None:
    coord, address = coordinator(tmp_path, workers=2, rounds=3)
    slow = SlowStart(address, TOKEN, 30)
    workers = [Worker(s, device="cpu", report_dir=tmp_path / "reports") for s in (slow, Session(address, TOKEN, 30))]

    def refuse_a_newcomer_while_slow_starts(i: int) -> None:
        if i != len(workers) - 1:  # once every worker runs
            return
        assert slow.starting.wait(120), "the slow worker never reached FetchState"
        wait_until(lambda: slow.worker_id in coord.state.overview().following, 60,
                   "the coordinator to see the slow worker's starting stream")
        time.sleep(3 * LIVENESS_S)  # it has had no real stream for 3x liveness_s since its Join
        with pytest.raises(JoinRefused) as refused:
            join_once(address)
        assert refused.value.code == "RESOURCE_EXHAUSTED", refused.value
        slow.go.set()

    try:
        codes = run_worker_threads(coord, workers, 180, started=refuse_a_newcomer_while_slow_starts)
    finally:
        slow.go.set()
    assert codes == {0: 0, 1: 0}
    reports = worker_reports(tmp_path / "reports")
    assert sorted(reports) == [0, 1]
    digest = param_digest(coord.params)
    assert all(r["status"] == "finished" and r["digest"] == digest for r in reports.values())
    assert not any(r.dead for r in coord.state.registry.records.values())


def test_a_worker_that_dies_while_starting_frees_its_slot(tmp_path: Path) -> None:
    coord, address = coordinator(tmp_path, workers=1, rounds=1)
    slow = SlowStart(address, TOKEN, 30)
    worker = Worker(slow, device="cpu")
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    try:
        assert slow.starting.wait(120), "the worker never reached FetchState"
        slot = slow.worker_id
        worker.stop()  # its stream ends as a killed process's does
        newcomer = Session(address, TOKEN, connect_timeout_s=60)  # retries while the slot is held
        try:
            assert newcomer.join("cpu").worker_id == slot
        finally:
            newcomer.close()
    finally:
        slow.go.set()
        thread.join(timeout=60)
        coord.stop(grace=0.5)
