"""The aggregated round result (coordinator.broadcast; docs/decisions.md, "One frame down"):
the coordinator compresses the round's aggregate into one frame with its own error
feedback, so what a frame leaves out comes back in a later round and nothing is lost;
``auto`` takes the smaller result in bytes; the error feedback survives a checkpoint and a
replay from the round log bit for bit; a discarded update leaves it as it was."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from geoloco.compression import Compressor, Layout, aggregate, decode_frame
from geoloco.config import ConfigError, GuardConfig, RunConfig, validate
from geoloco.coordinator import roundlog
from geoloco.coordinator.bounds import FrameBounds
from geoloco.coordinator.loop import RoundLoop
from geoloco.coordinator.metrics import broadcast_of
from geoloco.coordinator.outer import (
    COORDINATOR_SENDER,
    SparseLoCoOuter,
    UpdateFrame,
    apply_update,
    broadcast_density,
    broadcast_passes,
    make_outer,
)
from geoloco.coordinator.rounds import Arrival, ClosedRound, Decision
from geoloco.protos import geoloco_pb2 as pb
from geoloco.replica import START_DENSITY

DENSITY = 64 / 4096


def layout() -> Layout:
    return Layout.from_named_tensors([("w", torch.zeros(128, 192)), ("b", torch.zeros(64))])


def run_config(broadcast: str, **coordinator: object) -> RunConfig:
    return validate(RunConfig.from_dict({"workers": 8, "coordinator": {"broadcast": broadcast, **coordinator},
                                         "compression": {"density": DENSITY}}))


def worker_frames(lay: Layout, n: int, round_: int) -> list[Arrival]:
    """n workers' sparse frames of random pseudo-gradients (each its own compressor)."""
    arrivals = []
    for i in range(n):
        gen = torch.Generator().manual_seed(1000 * round_ + i)
        deltas = [torch.randn(s.shape, generator=gen) for s in lay.specs]
        data = Compressor(lay, density=DENSITY).compress(deltas, round=round_, sender=i)
        arrivals.append(Arrival(i, data, decode_frame(data, lay)))
    return arrivals


def step(outer: SparseLoCoOuter, arrivals: list[Arrival], round_: int):
    decision = Decision({a.worker: 1.0 for a in arrivals}, len(arrivals), "all arrived")
    return outer.step(round_, [(a, 1.0) for a in arrivals], decision)


def test_aggregate_is_one_coordinator_frame_and_delays_what_it_leaves_out_never_loses_it() -> None:
    lay = layout()
    outer = make_outer(run_config("aggregate", broadcast_density=2 * DENSITY), lay)
    params = [torch.zeros(s.shape) for s in lay.specs]
    wanted = [torch.zeros(s.shape) for s in lay.specs]  # the sum of the exact updates
    for r in range(4):
        arrivals = worker_frames(lay, 8, r)
        update = step(outer, arrivals, r)
        assert [f.sender for f in update.frames] == [COORDINATOR_SENDER] and update.aggregated
        assert len(update.frames[0].data) < sum(len(a.data) for a in arrivals) / 3
        exact = aggregate(lay, [a.frame for a in arrivals], [1.0] * 8, mode="mean_kept")
        for w, u in zip(wanted, exact, strict=True):
            w.add_(u, alpha=update.alpha)
        apply_update(params, update)
    # what the broadcasts applied plus what the error feedback still holds is every round's
    # exact update: the coordinator's error feedback has decay 1
    held = [e.view(s.shape) for e, s in zip(outer.compressor.error, lay.specs, strict=True)]
    for p, e, w in zip(params, held, wanted, strict=True):
        torch.testing.assert_close(p + update.alpha * e, w, rtol=0, atol=1e-5)
    assert max(e.abs().max().item() for e in held) > 0  # something was left for later


def test_auto_takes_frames_for_few_workers_and_the_aggregate_for_many() -> None:
    lay = layout()
    outer = make_outer(run_config("auto", broadcast_density=2 * DENSITY), lay)
    one = step(outer, worker_frames(lay, 1, 0), 0)  # one frame is smaller than the aggregate at 2x density
    assert not one.aggregated and [f.sender for f in one.frames] == [0]
    assert outer.compressor.error is None or all(not e.any() for e in outer.compressor.error)
    many = step(outer, worker_frames(lay, 8, 1), 1)
    assert many.aggregated and [f.sender for f in many.frames] == [COORDINATOR_SENDER]
    closed = ClosedRound(pb.RoundHeader(frames=[pb.FrameInfo(sender=f.sender) for f in many.frames]), (), {})
    assert broadcast_of(closed) == "aggregate"


@pytest.mark.parametrize(("workers", "scheme", "stragglers", "density", "passes"), [
    (2, "none", 0, 2 * DENSITY, 1), (8, "none", 0, 8 * DENSITY, 1), (16, "none", 0, 0.25, 1),
    (32, "none", 0, 0.25, 2), (48, "gc-cr", 2, 0.25, 3), (64, "none", 0, 0.25, 4), (128, "none", 0, 0.25, 4),
    (16, "gc-fr", 3, 4 * DENSITY, 1), (64, "pgc-fr", 1, 0.25, 2)])
def test_the_default_broadcast_carries_the_union_of_the_frames_a_round_aggregates(
        workers: int, scheme: str, stragglers: int, density: float, passes: int) -> None:
    """Unset, coordinator.broadcast_density is the union's density (the frames a full round
    aggregates, n or one a group under an FR code, times the workers' density), at most a
    quarter a frame, in as many frames as that takes (at most 4): what held the loss at
    n = 8, 16 and 32 (docs/decisions.md, "One frame down"). Set, it is one frame unless
    broadcast_passes says otherwise."""
    cfg = validate(RunConfig.from_dict({"workers": workers, "coding": {"scheme": scheme, "stragglers": stragglers},
                                        "coordinator": {"broadcast": "aggregate"},
                                        "compression": {"density": DENSITY}}))
    assert (broadcast_density(cfg), broadcast_passes(cfg)) == (density, passes)
    assert make_outer(cfg, layout()).passes == passes
    set_density = run_config("aggregate", broadcast_density=0.5)
    assert (broadcast_density(set_density), broadcast_passes(set_density)) == (0.5, 1)
    both = run_config("aggregate", broadcast_density=0.1, broadcast_passes=3)
    assert (broadcast_density(both), broadcast_passes(both)) == (0.1, 3)
    auto = validate(RunConfig.from_dict({"workers": 4, "coordinator": {"broadcast": "aggregate"},
                                         "compression": {"density": "auto", "target_push_s": 5.0}}))
    assert broadcast_density(auto) == 4 * START_DENSITY


def test_the_error_feedback_is_restored_bit_for_bit_and_a_discarded_update_leaves_it() -> None:
    lay = layout()
    cfg = run_config("auto", broadcast_density=0.01)  # undoable: "aggregate" compresses in place
    outer = make_outer(cfg, lay)
    for r in range(2):
        assert step(outer, worker_frames(lay, 4, r), r).aggregated
    saved = outer.state_dict()
    restored = make_outer(cfg, lay)
    restored.load_state_dict(saved)
    assert all(torch.equal(a, b) for a, b in zip(restored.compressor.error, outer.compressor.error, strict=True))
    before = [e.clone() for e in outer.compressor.error]
    arrivals = worker_frames(lay, 4, 2)
    first = step(outer, arrivals, 2)
    outer.discard()  # the update was not committed (coordinator.bounds): as if never made
    assert all(torch.equal(a, b) for a, b in zip(outer.compressor.error, before, strict=True))
    assert step(outer, arrivals, 2).frames[0].data == first.frames[0].data
    assert step(restored, arrivals, 2).frames[0].data == first.frames[0].data


def test_a_logged_aggregate_keeps_its_source_frames_for_the_replay(tmp_path) -> None:
    lay = layout()
    cfg = run_config("aggregate")
    outer, replaying = make_outer(cfg, lay), make_outer(cfg, lay)
    arrivals = worker_frames(lay, 3, 0)
    update = step(outer, arrivals, 0)
    header = pb.RoundHeader(round=0, aggregation=update.mode, alpha=update.alpha,
                            frames=[pb.FrameInfo(sender=f.sender, weight=f.weight, nbytes=len(f.data))
                                    for f in update.frames])
    credit = pb.Settlement(kind=pb.Settlement.CREDIT, sender=0, mate_frame=arrivals[0].data)
    roundlog.append(tmp_path, roundlog.LoggedRound(
        header, tuple(f.data for f in update.frames), {1: credit}, {"round": 0},
        tuple((f.sender, f.weight, f.data) for f in update.sources), update.source_mode))
    [entry] = roundlog.read(tmp_path, 0)
    assert entry.settlements[1].mate_frame == arrivals[0].data
    sources = entry.source_frames(lay)
    assert [(f.sender, f.weight, f.data) for f in sources] == [(a.worker, 1.0, a.data) for a in arrivals]
    again = replaying.combine(0, sources, entry.source_mode)
    assert again.frames[0].data == entry.parts[0]
    assert all(torch.equal(a, b) for a, b in zip(replaying.compressor.error, outer.compressor.error, strict=True))


def test_the_frames_broadcast_is_unchanged_and_bad_settings_are_refused() -> None:
    lay = layout()
    outer = make_outer(run_config("frames"), lay)
    arrivals = worker_frames(lay, 2, 0)
    update = step(outer, arrivals, 0)
    assert [f.data for f in update.frames] == [a.data for a in arrivals] and not update.aggregated
    assert outer.state_dict() == {}
    with pytest.raises(ConfigError, match="coordinator.broadcast"):
        run_config("everything")
    with pytest.raises(ConfigError, match="broadcast_density"):
        run_config("aggregate", broadcast_density=2.0)
    with pytest.raises(ConfigError, match="needs compression.method 'sparseloco'"):
        validate(RunConfig.from_dict({"coordinator": {"broadcast": "aggregate"},
                                      "compression": {"method": "diloco"}, "outer": {"lr": 0.7}}))
    frames = [UpdateFrame(a.worker, 1.0, a.data, a.frame) for a in arrivals]
    assert outer.combine(0, frames, "sum").frames == frames


@pytest.mark.parametrize("backend", ["numba", "reference"])
@pytest.mark.parametrize("mode", ["sum", "mean_kept"])
def test_compress_aggregate_is_compress_of_the_aggregate_bit_for_bit(backend: str, mode: str) -> None:
    """The broadcast compressor adds the frames into its spare buffers and encodes them in
    place (numba), instead of compressing a dense aggregate: the same frames and the same
    error feedback, round after round, through a restore (``auto``, a discarded update) too."""
    lay = layout()
    fused, dense = (Compressor(lay, density=2 * DENSITY, beta=1.0, undoable=True, backend=backend)
                    for _ in range(2))
    for r in range(4):
        frames = [a.frame for a in worker_frames(lay, 5, r)]
        weights = [0.5, 1.0, 0.25, 2.0, 1.0]
        got = fused.compress_aggregate(frames, weights, mode=mode, round=r, sender=COORDINATOR_SENDER)
        want = dense.compress(aggregate(lay, frames, weights, mode=mode), round=r, sender=COORDINATOR_SENDER)
        assert got == want, f"round {r}: the frames differ"
        for e, f in zip(fused.error, dense.error, strict=True):
            assert torch.equal(e, f), f"round {r}: the error feedback differs"
        if r == 1:  # undone, then redone
            fused.restore()
            dense.restore()
            assert fused.compress_aggregate(frames, weights, mode=mode, round=r, sender=COORDINATOR_SENDER) == want
            dense.compress(aggregate(lay, frames, weights, mode=mode), round=r, sender=COORDINATOR_SENDER)


def test_a_second_pass_sends_what_the_first_left_out_and_is_undone_with_it() -> None:
    """coordinator.broadcast_passes = 2: the second coordinator frame compresses the error
    feedback the first left (no new input), so the two together come closer to the exact
    aggregate than one; nothing is lost (decay 1), a discarded update puts the error
    feedback back as it was before both, and a replay makes the same two frames."""
    lay = layout()
    cfg = run_config("auto", broadcast_density=2 * DENSITY, broadcast_passes=2)  # undoable
    one, two = make_outer(run_config("aggregate", broadcast_density=2 * DENSITY), lay), make_outer(cfg, lay)
    arrivals = worker_frames(lay, 8, 0)
    exact = aggregate(lay, [a.frame for a in arrivals], [1.0] * 8, mode="mean_kept")
    single, double = step(one, arrivals, 0), step(two, arrivals, 0)
    assert [f.sender for f in double.frames] == [COORDINATOR_SENDER] * 2 and double.aggregated
    assert double.frames[0].data == single.frames[0].data  # the first pass is the one-pass frame

    def miss(update) -> float:
        params = [torch.zeros(s.shape) for s in lay.specs]
        apply_update(params, update)
        return sum(((p - update.alpha * u) ** 2).sum().item() for p, u in zip(params, exact, strict=True))

    assert miss(double) < 0.8 * miss(single)
    params = [torch.zeros(s.shape) for s in lay.specs]
    apply_update(params, double)
    held = [e.view(s.shape) for e, s in zip(two.compressor.error, lay.specs, strict=True)]
    for p, e, u in zip(params, held, exact, strict=True):  # applied + held is the exact update
        torch.testing.assert_close(p + double.alpha * e, double.alpha * u, rtol=0, atol=1e-6)
    closed = ClosedRound(pb.RoundHeader(frames=[pb.FrameInfo(sender=f.sender) for f in double.frames]), (), {})
    assert broadcast_of(closed) == "aggregate"

    before = [e.clone() for e in two.compressor.error]
    again = step(two, worker_frames(lay, 8, 1), 1)
    two.discard()
    assert all(torch.equal(a, b) for a, b in zip(two.compressor.error, before, strict=True))
    assert [f.data for f in step(two, worker_frames(lay, 8, 1), 1).frames] == [f.data for f in again.frames]
    with pytest.raises(ConfigError, match="broadcast_passes"):
        run_config("aggregate", broadcast_passes=0)


@pytest.mark.parametrize("backend", ["numba", "reference"])
def test_a_further_pass_in_place_is_the_pass_through_the_spares_and_restores_with_the_first(backend: str) -> None:
    """``compress_residual`` (coordinator.broadcast_passes > 1) makes the frame and the error
    feedback a no-input ``compress_aggregate`` makes, bit for bit, without touching the
    state a ``restore`` goes back to: a restore after two passes is the state before both,
    and no copy of the state is made for it."""
    lay = layout()
    in_place, through = (Compressor(lay, density=2 * DENSITY, beta=1.0, undoable=True, backend=backend)
                         for _ in range(2))
    for r in range(3):
        frames = [a.frame for a in worker_frames(lay, 4, r)]
        before = [e.clone() for e in in_place.error] if in_place.error is not None else None
        for c in (in_place, through):
            c.compress_aggregate(frames, [1.0] * 4, mode="mean_kept", round=r, sender=COORDINATOR_SENDER)
        got = in_place.compress_residual(round=r, sender=COORDINATOR_SENDER)
        want = through.compress_aggregate([], [], mode="sum", round=r, sender=COORDINATOR_SENDER)
        assert got == want, f"round {r}: the second frames differ"
        assert all(torch.equal(a, b) for a, b in zip(in_place.error, through.error, strict=True))
        if r == 1 and before is not None:  # both passes undone at once
            in_place.restore()
            assert all(torch.equal(a, b) for a, b in zip(in_place.error, before, strict=True))
            break


@pytest.mark.parametrize("mode", ["sum", "mean_kept"])
def test_the_aggregate_made_in_place_is_the_one_made_through_the_spares_bit_for_bit(mode: str) -> None:
    """Without ``undoable`` (coordinator.broadcast ``aggregate``) the numba compressor adds
    the frames straight into its error feedback and encodes it in place, holding no spare
    buffers: the same frames and error feedback as the undoable path through the spares,
    round after round, one frame or several, and further passes too."""
    lay = layout()
    in_place = Compressor(lay, density=2 * DENSITY, beta=1.0, backend="numba")
    spared = Compressor(lay, density=2 * DENSITY, beta=1.0, undoable=True, backend="numba")
    for r in range(4):
        n = 1 if r == 2 else 5
        frames = [a.frame for a in worker_frames(lay, n, r)]
        weights = [0.5, 1.0, 0.25, 2.0, 1.0][:n]
        got = [in_place.compress_aggregate(frames, weights, mode=mode, round=r, sender=COORDINATOR_SENDER),
               in_place.compress_residual(round=r, sender=COORDINATOR_SENDER)]
        want = [spared.compress_aggregate(frames, weights, mode=mode, round=r, sender=COORDINATOR_SENDER),
                spared.compress_residual(round=r, sender=COORDINATOR_SENDER)]
        assert got == want, f"round {r}: the frames differ"
        assert all(torch.equal(a, b) for a, b in zip(in_place.error, spared.error, strict=True)), r
    assert in_place._encoder(torch.device("cpu"))._spare is None  # no second copy was made
    with pytest.raises(RuntimeError, match="undoable"):
        in_place.restore()


def test_an_in_place_aggregate_is_admitted_on_a_bound_that_holds_and_a_hostile_round_is_refused_untouched() -> None:
    """Under ``aggregate`` nothing can undo a step, so the guard admits a round before it
    (``worst_move``, ``FrameBounds.admits``): the bound it rests on holds round after round
    (no broadcast value moves a coordinate further, no error feedback grows past it, two
    passes included), and a round whose frames could overflow the parameters is refused
    before the error feedback is touched; measuring the bound again does not admit it."""
    lay = layout()
    outer = make_outer(run_config("aggregate", broadcast_passes=2), lay)
    assert outer.in_place and not outer.compressor.undoable
    bounds = FrameBounds(GuardConfig(), [torch.zeros(s.shape) for s in lay.specs])
    for r in range(4):
        arrivals = worker_frames(lay, 8, r)
        decision = Decision({a.worker: 1.0 for a in arrivals}, len(arrivals), "all arrived")
        chosen = [(a, 1.0) for a in arrivals]
        move = outer.worst_move(chosen, decision)
        assert bounds.admits(move)
        update = outer.step(r, chosen, decision)
        actual = abs(update.alpha) * sum(f.frame.magnitudes()[1] for f in update.frames)
        assert 0 < actual <= move, (r, actual, move)
        largest = max(float(e.abs().max()) for e in outer.compressor.error)
        assert largest <= outer.ef_bound, (r, largest, outer.ef_bound)
        assert bounds.safe(update)
    with pytest.raises(RuntimeError, match="cannot be undone"):
        outer.discard()

    hostile = []
    for i in range(8):
        gen = torch.Generator().manual_seed(99 + i)
        data = Compressor(lay, density=DENSITY).compress([torch.randn(s.shape, generator=gen) * 1e29
                                                          for s in lay.specs], round=4, sender=i)
        hostile.append(Arrival(i, data, decode_frame(data, lay)))
    decision = Decision({a.worker: 1.0 for a in hostile}, len(hostile), "all arrived")
    before = [e.clone() for e in outer.compressor.error]
    assert not bounds.admits(outer.worst_move([(a, 1.0) for a in hostile], decision))
    outer.measure_bound()
    assert not bounds.admits(outer.worst_move([(a, 1.0) for a in hostile], decision))
    loop = SimpleNamespace(outer=outer, bounds=bounds)  # what the round loop's check reads
    assert not RoundLoop.admits(loop, [(a, 1.0) for a in hostile], decision)
    assert RoundLoop.admits(loop, chosen, Decision({a.worker: 1.0 for a in arrivals}, 8, "all arrived"))
    assert all(torch.equal(a, b) for a, b in zip(outer.compressor.error, before, strict=True))
    assert make_outer(run_config("auto"), lay).worst_move([(a, 1.0) for a in hostile], decision) is None


def test_an_aggregate_of_a_layout_with_empty_tensors_is_made_both_ways() -> None:
    """A layout with a tensor of no elements, shaped (0, 7): both paths take it (the
    parameters the frames are added into keep each tensor's shape) and agree."""
    lay = Layout.from_named_tensors([("w", torch.zeros(64, 96)), ("e", torch.zeros(0, 7)), ("b", torch.zeros(5))])
    gen = torch.Generator().manual_seed(5)
    data = Compressor(lay, density=DENSITY).compress([torch.randn(s.shape, generator=gen) for s in lay.specs],
                                                    round=0, sender=0)
    made = [Compressor(lay, density=0.05, beta=1.0, undoable=undoable, backend="numba").compress_aggregate(
        [decode_frame(data, lay)], [1.0], mode="mean_kept", round=0, sender=COORDINATOR_SENDER)
        for undoable in (True, False)]
    assert made[0] == made[1]
    assert decode_frame(made[0], lay).kept > 0
