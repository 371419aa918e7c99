"""Faulty sessions (geoloco.worker.faults) under real workers and a real coordinator process:
a push dropped, a stream cut, a parameter flipped. Two in-process workers, one over the
faulty session, run three rounds against ``geoloco coordinator`` and must end in step."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import pytest
from run_processes import SMALL, TOKEN, Processes, coordinator_port, metrics, set_flags, wait_until

from geoloco.protos import geoloco_pb2 as pb
from geoloco.replica import param_digest
from geoloco.worker.faults import Fault, FaultySession
from geoloco.worker.loop import Worker
from geoloco.worker.session import Push, Session

pytestmark = pytest.mark.slow
RUN = {**SMALL, "task.batch_size": "4", "inner.steps": "2", "inner.warmup_steps": "2",
       "coordinator.checkpoint_every": "0"}
ROUNDS = 3


class HoldsLastPush(Session):
    """The punctual worker's session, whose push of the last round waits for ``until``."""

    def __init__(self, address: str, until: Callable[[], bool]) -> None:
        super().__init__(address, TOKEN, 30)
        self.until = until

    def push(self, push: Push) -> pb.PushReply:
        if push.round == ROUNDS - 1:
            wait_until(self.until, 120, "the faulty worker to follow the rounds again")
        return super().push(push)


def run_two_workers(processes: Processes, run_dir: Path, faulty: FaultySession,
                    deadline_s: float = 60.0, hold: Callable[[], bool] | None = None) -> tuple[Worker, Worker]:
    """A coordinator process and two in-process workers, one over ``faulty``, until the run
    is over; both must exit 0. ``hold``: the punctual worker pushes the last round only
    once it is true."""
    processes.start("coordinator", ["coordinator", "--listen", "127.0.0.1:0", "--workers", "2",
                                    "--rounds", str(ROUNDS), "--run-dir", str(run_dir),
                                    *set_flags({**RUN, "coordinator.deadline_s": str(deadline_s)})])
    address = f"127.0.0.1:{coordinator_port(run_dir)}"
    faulty.address = address
    punctual = Session(address, TOKEN, 30) if hold is None else HoldsLastPush(address, hold)
    workers = [Worker(faulty, device="cpu"), Worker(punctual, device="cpu")]
    codes: dict[int, int] = {}
    threads = [threading.Thread(target=lambda i=i, w=w: codes.__setitem__(i, w.run()), daemon=True)
               for i, w in enumerate(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=180)
    assert codes == {0: 0, 1: 0}, processes.log("coordinator")[-3000:]
    assert processes.wait("coordinator", timeout=60) == 0, processes.log("coordinator")[-3000:]
    return workers[0], workers[1]


def end_in_step(faulty: Worker, punctual: Worker) -> None:
    """The punctual worker confirmed every digest (no resync), so ending on its parameters
    is ending on the coordinator's."""
    assert punctual.counters.resyncs == 0
    assert param_digest(faulty.theta) == param_digest(punctual.theta)
    assert faulty.round == punctual.round == ROUNDS


def test_a_dropped_push_is_counted_and_the_round_closes_without_it(processes: Processes,
                                                                   tmp_path: Path) -> None:
    session = FaultySession("", TOKEN, 30, fault=Fault.DROP_PUSH, rounds=[1])
    faulty, punctual = run_two_workers(processes, tmp_path / "run", session, deadline_s=5.0)
    assert session.fired == [1]
    assert faulty.counters.rejected_pushes == 1 and faulty.counters.resyncs == 0
    closed = metrics(tmp_path / "run")
    assert [sorted(m["arrived"]) for m in closed] == [[0, 1], [punctual.session.worker_id], [0, 1]]
    end_in_step(faulty, punctual)


def test_a_flipped_parameter_is_found_by_the_digest_and_resynced(processes: Processes,
                                                                 tmp_path: Path) -> None:
    session = FaultySession("", TOKEN, 30, fault=Fault.FLIP_PARAMETER, rounds=[1])
    faulty, punctual = run_two_workers(processes, tmp_path / "run", session)
    assert session.fired == [1]
    assert faulty.counters.resyncs == 1
    end_in_step(faulty, punctual)


def test_a_cut_stream_makes_the_worker_rejoin_with_its_id(processes: Processes, tmp_path: Path) -> None:
    session = FaultySession("", TOKEN, 30, fault=Fault.CUT_STREAM, rounds=[1])
    # a worker without its Rounds stream is not waited for until it follows the rounds again
    # (CoordinatorState._waiting_for): the last round waits for that, not for a race
    def following_again() -> bool:
        return processes.log("coordinator").count(f"worker {session.worker_id} follows rounds from") >= 2

    faulty, punctual = run_two_workers(processes, tmp_path / "run", session, hold=following_again)
    assert session.fired == [1]
    assert faulty.counters.reconnects == 1
    # it kept its id: no third worker, and its frame of the last round came under that id
    assert sorted(metrics(tmp_path / "run")[-1]["arrived"]) == [0, 1]
    end_in_step(faulty, punctual)
