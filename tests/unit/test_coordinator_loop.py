"""The coordinator's round loop over a real CoordinatorState, frames pushed through the real
servicer (no server, no network): a round is broadcast before it is applied and applied as
a replica applies it, FetchState never sees a half-applied round, refusals count on the
round they met, and a whole run ends with its checkpoints and summary.json."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch
from torch import nn

from geoloco import transport
from geoloco.compression import Compressor, Layout, decode_frame
from geoloco.config import RunConfig, load_config
from geoloco.coordinator import checkpoint
from geoloco.coordinator.gradient_coding import make_code
from geoloco.coordinator.loop import RoundLoop, round_result
from geoloco.coordinator.metrics import CLOSE_PHASES, RunTotals
from geoloco.coordinator.outer import make_outer
from geoloco.coordinator.registry import WorkerRecord, WorkerRegistry
from geoloco.coordinator.rounds import CodePolicy, RoundState
from geoloco.coordinator.service import CoordinatorServicer
from geoloco.coordinator.state import CoordinatorState
from geoloco.protos import geoloco_pb2 as pb
from geoloco.replica import apply_round, param_digest

TOKEN = "loop-test"
WAIT_S = 30.0


class ParamSum:
    """A stand-in task whose validation loss is the sum of the parameters, so a loss
    measured before the apply would differ from one measured after it."""

    def val_loss(self, model: nn.Module) -> float:
        return float(sum(p.detach().sum() for p in model.parameters()))


class CallContext:
    """What the servicer reads of a gRPC call's context, for a call made without a server."""

    def __init__(self, worker: int, session: str) -> None:
        self.metadata = transport.caller_metadata(worker, session)

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self.metadata

    def auth_context(self) -> dict:
        return {}

    def peer(self) -> str:
        return "ipv4:127.0.0.1:1"

    def cancel(self) -> None:
        raise AssertionError("the call was cancelled")

    def abort(self, code, details: str) -> None:
        raise Aborted(f"{code.name}: {details}")


class Aborted(Exception):
    """The servicer ended the call with an error status (gRPC's abort raises too)."""


class Run:
    """A coordinator without its server: state, loop and servicer as the app wires them."""

    def __init__(self, run_dir: Path, **overrides: object) -> None:
        self.cfg: RunConfig = load_config(overrides={
            "workers": 2, "rounds": 2, "coordinator.token": TOKEN,
            "coordinator.checkpoint_every": 0, "coordinator.deadline_s": WAIT_S, **overrides})
        self.model = nn.Linear(8, 16)
        named = list(self.model.named_parameters())
        self.layout = Layout.from_named_tensors(named)
        code = make_code(self.cfg.coding.scheme, self.cfg.workers, self.cfg.coding.stragglers)
        self.state = CoordinatorState(self.layout, [p.data for _, p in named],
                                      WorkerRegistry(self.cfg.workers, TOKEN), RunTotals(),
                                      RoundState(0, self.cfg.coordinator.deadline_s))
        outer = make_outer(self.cfg, self.layout)
        self.loop = RoundLoop(self.cfg, self.state, CodePolicy(code), outer, ParamSum(),
                              self.model, run_dir)
        self.servicer = CoordinatorServicer(self.state, self.cfg, self.layout, code)
        self.run_dir = run_dir
        self.records = [self.state.join(TOKEN, "test", "cpu", None, "")[0]
                        for _ in range(self.cfg.workers)]

    def frame(self, worker: int, round: int) -> bytes:
        gen = torch.Generator().manual_seed(100 * round + worker)
        deltas = [torch.randn(s.shape, generator=gen) * 1e-2 for s in self.layout.specs]
        return Compressor(self.layout).compress(deltas, round=round, sender=worker)

    def push(self, record: WorkerRecord, round: int, data: bytes) -> pb.PushReply:
        header = pb.PushHeader(worker_id=record.worker_id, session=record.session, round=round,
                               total_bytes=len(data))
        msgs = [pb.PushChunk(header=header)] + [pb.PushChunk(data=c) for c in transport.chunks(data)]
        return self.servicer.Push(iter(msgs), CallContext(record.worker_id, record.session))

    def metrics(self) -> list[dict]:
        return [json.loads(x) for x in (self.run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_round_is_applied_as_a_replica_applies_its_broadcast(tmp_path: Path) -> None:
    run = Run(tmp_path)
    a, b = run.records
    with run.state.follow(a.worker_id, 0) as (sub, _), run.state.follow(b.worker_id, 0):
        assert run.state.wait_for_joins(2, WAIT_S)
        replica = [p.clone() for p in run.state.params]
        frames = [run.frame(r.worker_id, 0) for r in (a, b)]
        for record, data in zip((a, b), frames, strict=True):
            assert run.push(record, 0, data).accepted
        run.loop.run_round()
        closed = sub.get_nowait()
    assert closed.round == 0 and not closed.finished and list(closed.header.arrived) == [0, 1]
    assert closed.data == frames[0] + frames[1]
    h = closed.header
    apply_round(replica, [decode_frame(f, run.layout) for f in frames], [f.weight for f in h.frames],
                h.aggregation, h.alpha)
    assert closed.digest.result(timeout=0) == param_digest(replica) == run.state.digest()
    assert run.state.open_round() == 1 and run.state.rs.opened_at is not None  # next one open
    (line,) = run.metrics()
    assert line["round"] == 0 and line["close_reason"] == "all arrived"
    assert line["val_loss"] == pytest.approx(ParamSum().val_loss(run.model))  # after the apply
    assert line["coordinator_apply_seconds"] >= 0 and line["close_seconds"] >= 0
    assert set(line["close_phases"]) == set(CLOSE_PHASES) and min(line["close_phases"].values()) >= 0
    assert set(line["close_rss_bytes"]) == set(CLOSE_PHASES) and all(b > 0 for b in line["close_rss_bytes"].values())


def test_broadcast_goes_first_and_fetch_state_waits_for_the_apply(tmp_path: Path) -> None:
    run = Run(tmp_path, workers=1)
    (a,) = run.records
    with run.state.follow(a.worker_id, 0) as (sub, _):
        assert run.state.wait_for_joins(1, WAIT_S)
        assert run.push(a, 0, run.frame(0, 0)).accepted
        rs = run.state.wait_for_close(run.loop.policy)
        update = run.loop.outer.step(rs.round, rs.chosen(), rs.decision)
        closed = round_result(rs, update, {}, finished=False)
        fetched = []
        def fetch_state() -> None:
            with run.state.snapshot(a) as snap:
                fetched.append(snap)

        fetch = threading.Thread(target=fetch_state)
        with run.state.publishing(closed):
            assert sub.get_nowait() is closed and not closed.digest.done()
            fetch.start()
            fetch.join(0.3)
            assert fetch.is_alive(), "FetchState read the parameters while a round was applied"
            run.state.apply(update, closed)
        fetch.join(WAIT_S)
    (snapshot,) = fetched
    assert snapshot.round == 1 and snapshot.digest == closed.digest.result(timeout=0)


def test_fetches_at_once_share_one_state_frame_and_the_last_lets_it_go(tmp_path: Path) -> None:
    """The dense state frame is a model's size: FetchState calls sending it at once share
    one (every worker fetches at round 0), and the coordinator keeps none between fetches."""
    run = Run(tmp_path, workers=2)
    a, b = run.records
    with run.state.snapshot(a) as first, run.state.snapshot(b) as second:
        assert second is first
    assert run.state.snapshot_users == 0
    with run.state.snapshot(a) as later:
        assert later is not first and later == first  # made again: the same round's frame, byte for byte
    assert run.state.snapshot_users == 0


def test_refused_pushes_count_as_rejected_or_late_on_the_round_they_met(tmp_path: Path) -> None:
    run = Run(tmp_path, workers=1)
    (a,) = run.records
    with run.state.follow(a.worker_id, 0):
        assert run.state.wait_for_joins(1, WAIT_S)
        assert "round 1 but round 0 is open" in run.push(a, 1, run.frame(0, 1)).reason
        assert not run.push(a, 0, b"not a frame").accepted
        forged = WorkerRecord(a.worker_id, "", session="forged")
        with pytest.raises(Aborted, match="UNAUTHENTICATED: bad session"):  # not counted
            run.push(forged, 0, run.frame(0, 0))
        assert run.push(a, 0, run.frame(0, 0)).accepted
        run.loop.run_round()
        assert "round 0 but round 1 is open" in run.push(a, 0, run.frame(0, 0)).reason
        assert run.push(a, 1, run.frame(0, 1)).accepted
        run.loop.run_round()
    first, second = run.metrics()
    assert (first["rejected_frames"], first["late_frames"]) == (2, 0)
    assert (second["rejected_frames"], second["late_frames"]) == (0, 1)


def test_a_run_checkpoints_each_round_and_ends_with_a_summary(tmp_path: Path) -> None:
    run = Run(tmp_path, workers=1, rounds=3, **{"coordinator.checkpoint_every": 1})
    (a,) = run.records
    initial = ParamSum().val_loss(run.model)
    loop = threading.Thread(target=run.loop.run, daemon=True)
    loop.start()
    with run.state.follow(a.worker_id, 0) as (sub, _):
        for r in range(3):
            assert run.push(a, r, run.frame(0, r)).accepted
            closed = sub.get(timeout=WAIT_S)
            assert closed.round == r and closed.finished == (r == 2)
            digest = closed.digest.result(timeout=WAIT_S)
        run.state.mark_finish_delivered(a.worker_id)
        assert run.loop.done.wait(WAIT_S)
    loop.join(WAIT_S)
    assert not run.loop.failed
    names = [p.name for p in checkpoint.list_checkpoints(tmp_path)]
    assert names == [f"round_{r:08d}" for r in (1, 2, 3)]  # every round, and the end
    final = checkpoint.load_latest(tmp_path)
    assert final.round == 3 and param_digest(list(final.params.values())) == digest
    summary = json.loads((tmp_path / "summary.json").read_text())
    lines = run.metrics()
    assert summary["rounds"] == 3 and summary["final_val_loss"] == lines[-1]["val_loss"]
    assert summary["initial_val_loss"] == pytest.approx(initial)  # before round 0


@pytest.mark.parametrize(("val_every", "due"), [
    (2, [False, True, False, True, False, True]),
    (0, [False, False, False, False, False, True]),  # 0: only after the last round
    (None, [True] * 6),  # default: every round for a small model
])
def test_validation_loss_is_due_every_val_every_rounds_and_after_the_last(
        tmp_path: Path, val_every: int | None, due: list[bool]) -> None:
    run = Run(tmp_path, rounds=6, **{"coordinator.val_every": val_every})
    assert [run.loop.val_due(n) for n in range(1, 7)] == due


def test_val_interval_keeps_validation_under_its_share_of_a_round() -> None:
    from geoloco.coordinator.loop import VAL_COST_SHARE, val_interval

    assert val_interval(None, 2.0) == 1  # nothing measured yet: every round
    assert val_interval(0.1, 2.0) == 1  # 5 % of a round: every round
    every = val_interval(3.0, 2.0)  # 150 % of a round
    assert 3.0 / (every * 2.0) <= VAL_COST_SHARE < 3.0 / ((every - 1) * 2.0)
