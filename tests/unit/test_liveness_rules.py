"""Dead workers on the coordinator, pure parts: a worker without a Rounds stream for
coordinator.liveness_s is marked dead, an open round then closes once every live worker is
in ("live arrived"), and a new Join takes the dead slot with a new session; a round stops
waiting for a worker as soon as its Rounds stream ends, until it follows again."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from geoloco.coordinator.gradient_coding import make_code
from geoloco.coordinator.metrics import RunTotals
from geoloco.coordinator.registry import RegistryError, WorkerRegistry
from geoloco.coordinator.rounds import Arrival, CodePolicy, RoundState
from geoloco.coordinator.state import CoordinatorState


def arrive(rs: RoundState, worker: int) -> None:
    rs.accept(Arrival(worker, b"", SimpleNamespace(round=rs.round)))


def test_a_round_waits_for_live_workers_and_closes_once_the_others_are_dead() -> None:
    policy = CodePolicy(make_code("none", 3, 0))
    rs = RoundState(0, deadline_s=300.0)
    rs.open()
    arrive(rs, 1)
    assert rs.try_close(policy, others_dead=False) is None
    assert RoundState(0, 300.0).try_close(policy, others_dead=True) is None  # not open yet
    decision = rs.try_close(policy, others_dead=True)
    assert decision.reason == "live arrived" and set(decision.coefficients) == {1}


def test_nobody_in_waits_for_the_deadline_even_when_the_others_are_dead() -> None:
    rs = RoundState(0, deadline_s=300.0)
    rs.open()
    assert rs.try_close(CodePolicy(make_code("none", 2, 0)), others_dead=True) is None


def test_a_worker_gone_liveness_s_is_marked_dead_and_a_new_join_takes_its_slot() -> None:
    registry = WorkerRegistry(2, "tok")
    state = CoordinatorState(None, [], registry, RunTotals(), RoundState(0, 300.0), liveness_s=0.2)
    first = [state.join("tok", "h", "cpu", None, "")[0] for _ in range(2)]
    with pytest.raises(RegistryError, match="slots are taken"):
        state.join("tok", "h", "cpu", None, "")
    with state.follow(1, 0):
        time.sleep(0.3)
        with state.lock:
            state.check_liveness()
        assert [r.dead for r in registry.records.values()] == [True, False]  # 1 follows
        assert state.live_count() == 1
    with state.follow(0, 0):  # a slow starter that follows after all is back
        assert not registry.records[0].dead and state.live_count() == 2
    time.sleep(0.3)
    with state.lock:
        state.check_liveness()
    replacement, _ = state.join("tok", "h", "cpu", None, "")
    assert replacement.worker_id == 0 and replacement.session != first[0].session
    assert not replacement.dead and replacement.live
    with pytest.raises(RegistryError, match="bad session"):  # the dead worker's session is void
        state.authenticate(0, first[0].session)


def test_the_end_of_a_run_does_not_wait_for_a_worker_gone_liveness_s() -> None:
    registry = WorkerRegistry(2, "tok")
    state = CoordinatorState(None, [], registry, RunTotals(), RoundState(0, 300.0), liveness_s=0.2)
    for _ in range(2):
        state.join("tok", "h", "cpu", None, "")
    done = threading.Event()
    with state.follow(0, 0):
        state.mark_finish_delivered(0)  # worker 0 has the last result; worker 1 never follows
        threading.Thread(target=lambda: (state.wait_finish_delivered(600.0), done.set()), daemon=True).start()
        assert done.wait(60), "waited for a worker without a Rounds stream"
    assert registry.records[1].dead and not registry.records[0].dead


def test_a_round_stops_waiting_for_a_worker_whose_stream_ended_until_it_follows_again() -> None:
    registry = WorkerRegistry(3, "tok")
    state = CoordinatorState(None, [], registry, RunTotals(), RoundState(0, 300.0), liveness_s=600.0)
    for _ in range(3):
        state.join("tok", "h", "cpu", None, "")
    with state.lock:
        state.rs.open()
        arrive(state.rs, 1)
    with state.follow(0, 0), state.follow(2, 0):
        pass  # both streams end: the processes died, long before liveness_s
    with state.lock:
        assert state._waiting_for() == set() and not registry.records[0].dead
    with state.follow(0, 0, starting=True), state.follow(2, 0):  # 0 restarted: still starting
        with state.lock:
            assert state._waiting_for() == {2}  # 2 follows again: waited for
        older = state.follow(0, 0)  # 0's real stream replaces its starting one
        older.__enter__()
        with state.lock:
            assert state._waiting_for() == {0, 2}
        with state.follow(0, 0):  # a newer stream of its own, then the older one ends: no gap
            older.__exit__(None, None, None)
            with state.lock:
                assert state._waiting_for() == {0, 2} and 0 not in state.stream_lost


def test_the_end_of_the_run_does_not_count_as_a_lost_stream() -> None:
    registry = WorkerRegistry(1, "tok")
    state = CoordinatorState(None, [], registry, RunTotals(), RoundState(0, 300.0))
    state.join("tok", "h", "cpu", None, "")
    state.stopping = True
    with state.follow(0, 0):
        pass
    assert state.stream_lost == set()
