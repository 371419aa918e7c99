"""The coordinator's pieces without a server: close policies, round bookkeeping, the
outer optimizers against torch's own SGD, and checkpoints that survive a damaged file."""

from __future__ import annotations

import pytest
import torch

from geoloco.compression import Layout, decode_frame, encode_dense
from geoloco.config import OuterConfig
from geoloco.coordinator import checkpoint
from geoloco.coordinator.gradient_coding import make_code
from geoloco.coordinator.outer import DiLoCoOuter, SparseLoCoOuter, apply_update, mean_weights
from geoloco.coordinator.rounds import Arrival, CodePolicy, Decision, RoundError, RoundState

SHAPES = {"w": (8, 8), "b": (5,)}


def layout() -> Layout:
    return Layout.from_named_tensors((n, torch.zeros(s)) for n, s in SHAPES.items())


def dense_arrival(lay: Layout, worker: int, round: int, seed: int) -> tuple[Arrival, list]:
    gen = torch.Generator().manual_seed(seed)
    deltas = [torch.randn(s.shape, generator=gen) for s in lay.specs]
    data = encode_dense(lay, deltas, round=round, sender=worker)
    return Arrival(worker, data, decode_frame(data, lay)), deltas


def test_wait_for_all_closes_only_when_all_arrived_or_at_the_deadline():
    policy = CodePolicy(make_code("none", 3, 0))
    assert policy.decide([0, 1], deadline_passed=False) is None
    assert policy.decide([0, 1, 2], False) == Decision({0: 1.0, 1: 1.0, 2: 1.0}, 3, "all arrived")
    assert policy.decide([2, 0], True) == Decision({0: 1.0, 2: 1.0}, 2, "deadline")
    assert policy.decide([], True) == Decision({}, 0, "deadline")


def test_ignore_stragglers_closes_at_n_minus_s():
    policy = CodePolicy(make_code("ignore", 4, 1))
    assert policy.decide([0, 1], False) is None
    decision = policy.decide([0, 1, 3], False)
    assert decision.reason == "decodable" and decision.coefficients == pytest.approx(
        {0: 4 / 3, 1: 4 / 3, 3: 4 / 3})
    weights, mode = mean_weights(decision, "mean")
    assert mode == "sum" and sum(weights) == pytest.approx(1.0)


def test_round_state_refuses_wrong_round_duplicates_and_late_frames():
    lay = layout()
    rs = RoundState(2, deadline_s=3600.0)  # no deadline passes while the test looks
    arrival, _ = dense_arrival(lay, 0, 2, seed=0)
    with pytest.raises(RoundError, match="frame for round 3 but round 2 is open"):
        rs.check_push(0, 3)
    rs.accept(arrival)
    with pytest.raises(RoundError, match="already pushed"):
        rs.accept(arrival)
    policy = CodePolicy(make_code("none", 2, 0))
    assert rs.try_close(policy) is None  # not opened: the deadline clock has not started
    rs.open()
    assert rs.try_close(policy) is None
    rs.deadline_s = 0.0  # the deadline has passed
    assert rs.seconds_left() <= 0
    assert rs.try_close(policy).reason == "deadline"
    assert [a.worker for a, _ in rs.chosen()] == [0]
    with pytest.raises(RoundError, match="round 2 is closed"):
        rs.check_push(1, 2)


def test_sparseloco_broadcasts_the_workers_frames_with_mean_weights():
    lay = layout()
    arrivals = [dense_arrival(lay, i, 0, seed=i)[0] for i in range(2)]
    outer = SparseLoCoOuter(lay, OuterConfig(lr=1.0, momentum=0.0, aggregation="mean"))
    decision = Decision({0: 1.0, 1: 1.0}, 2, "all arrived")
    update = outer.step(0, [(a, 1.0) for a in arrivals], decision)
    assert [f.data for f in update.frames] == [a.data for a in arrivals]
    assert [f.weight for f in update.frames] == [0.5, 0.5] and update.alpha == -1.0
    kept = SparseLoCoOuter(lay, OuterConfig(lr=1.0, momentum=0.0, aggregation="mean_kept"))
    update = kept.step(0, [(a, 1.0) for a in arrivals], decision)
    assert update.mode == "mean_kept" and [f.weight for f in update.frames] == [1.0, 1.0]
    stale = Decision({0: 1.0, 1: 1.0}, 2, "all arrived", stale_overlap=True)
    assert kept.step(0, [(a, 1.0) for a in arrivals], stale).mode == "sum"  # pgc-cr: see mean_weights


def test_diloco_matches_torch_nesterov_sgd_over_three_rounds():
    lay = layout()
    params = [torch.randn(s.shape, generator=torch.Generator().manual_seed(9)) for s in lay.specs]
    reference = [torch.nn.Parameter(p.clone()) for p in params]
    sgd = torch.optim.SGD(reference, lr=0.7, momentum=0.9, nesterov=True)
    outer = DiLoCoOuter(lay, OuterConfig(lr=0.7, momentum=0.9))
    for r in range(3):
        pairs = [dense_arrival(lay, i, r, seed=10 * r + i) for i in range(2)]
        update = outer.step(r, [(a, 1.0) for a, _ in pairs], Decision({0: 1.0, 1: 1.0}, 2, "x"))
        assert len(update.frames) == 1 and update.alpha == 1.0
        apply_update(params, update)
        for j, p in enumerate(reference):
            p.grad = (pairs[0][1][j] + pairs[1][1][j]) / 2
        sgd.step()
    for p, ref in zip(params, reference, strict=True):
        torch.testing.assert_close(p, ref.detach(), rtol=1e-5, atol=1e-6)
    restored = DiLoCoOuter(lay, OuterConfig(lr=0.7, momentum=0.9))
    restored.load_state_dict(outer.state_dict())
    for a, b in zip(restored.buffers, outer.buffers, strict=True):
        assert torch.equal(a, b)


def test_checkpoint_roundtrip_prunes_and_skips_a_damaged_newest(tmp_path):
    lay = layout()
    for r in range(1, 6):
        ckpt = checkpoint.Checkpoint(r, {"w": torch.full((8, 8), float(r)), "b": torch.zeros(5)},
                                     {"momentum_buffers": None}, {0: {"session": "s0"}},
                                     lay.digest, {"rounds": r}, guard_norms={1: (r - 1, 0.1 + r / 3)})
        checkpoint.save(tmp_path, ckpt)
    paths = checkpoint.list_checkpoints(tmp_path)
    assert [p.name for p in paths] == [f"round_{r:08d}" for r in (3, 4, 5)]
    latest = checkpoint.load_latest(tmp_path)
    assert latest.round == 5 and latest.workers == {0: {"session": "s0"}}
    assert latest.guard_norms == {1: (4, 0.1 + 5 / 3)}  # the frame bounds' memory, exactly
    assert latest.layout_digest == lay.digest and torch.equal(latest.params["w"], torch.full((8, 8), 5.0))
    assert list(latest.params) == ["w", "b"]  # the layout's order, whatever the file's
    weights = paths[-1] / checkpoint.WEIGHTS_FILE
    weights.write_bytes(weights.read_bytes()[:100])
    assert checkpoint.load_latest(tmp_path).round == 4
    state = paths[-2] / checkpoint.STATE_FILE
    state.write_bytes(state.read_bytes()[:100])
    assert checkpoint.load_latest(tmp_path).round == 3
    assert checkpoint.load_latest(tmp_path / "nothing") is None
