"""Error feedback that loses nothing (docs/gradient-coding.md): the compressor undoes its
last frame or takes a frame's values back, the worker settles each kind the round header
can name, and over rounds of i.i.d. pseudo-gradients with random stragglers nothing leaks
(beta = 1: whatever the applied updates miss is still owed by some error feedback), where
leaving frames unsettled leaks."""

from __future__ import annotations

import pytest
import torch

from benchmarks.ef_drift import Case, run
from geoloco.compression import Compressor, Layout, decode_frame, encode_dense
from geoloco.compression.registry import BACKENDS
from geoloco.config import CompressionConfig
from geoloco.protos import geoloco_pb2 as pb
from geoloco.worker.encoder import FrameEncoder

LAYOUT = Layout.from_named_tensors([("w", torch.zeros(70, 130)), ("b", torch.zeros(33)), ("e", torch.zeros(0))])


def deltas(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s.shape, generator=g) for s in LAYOUT.specs]


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("table", ["chunk", "bins"])
def test_restore_puts_back_the_error_feedback_of_before_the_last_frame(backend: str, table: str) -> None:
    comp = Compressor(LAYOUT, tile=16, density=1 / 16, backend=backend, table=table, undoable=True)
    comp.compress(deltas(0), round=0, sender=0)
    before = [e.clone() for e in comp.error]
    comp.compress(deltas(1), round=1, sender=0)
    assert not all(torch.equal(a, b) for a, b in zip(comp.error, before, strict=True))
    comp.restore()
    assert all(torch.equal(a, b) for a, b in zip(comp.error, before, strict=True))
    with pytest.raises(RuntimeError, match="undoable"):
        comp.restore()  # once per frame
    with pytest.raises(RuntimeError, match="undoable"):
        Compressor(LAYOUT, tile=16).restore()


def test_add_frame_puts_the_frame_back_where_it_was_taken_out() -> None:
    comp = Compressor(LAYOUT, tile=16, density=1 / 16, beta=1.0)
    frame = decode_frame(comp.compress(deltas(2), round=0, sender=0), LAYOUT)
    comp.add_frame(frame)
    for e, d in zip(comp.error, deltas(2), strict=True):  # beta = 1 from zero: e + frame = delta
        torch.testing.assert_close(e, d.reshape(-1), rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="not a sparse frame"):
        comp.add_frame(decode_frame(encode_dense(LAYOUT, deltas(3), round=0, sender=0), LAYOUT))


def settled(kind: int, sender: int = 0, mate_seed: int | None = None) -> tuple[list, list, list]:
    """(error feedback before the frame, after it, after settling) of one worker's frame."""
    enc = FrameEncoder(LAYOUT, CompressionConfig(tile=16, density=1 / 16), undoable=True)
    enc.encode(deltas(4), 0, 1)
    before = [e.clone() for e in enc.compressor.error]
    own = enc.encode(deltas(5), 1, 1)
    after = [e.clone() for e in enc.compressor.error]
    applied = []
    if mate_seed is not None:  # the mate has this worker's history, then its own message
        mate = FrameEncoder(LAYOUT, CompressionConfig(tile=16, density=1 / 16))
        mate.encode(deltas(4), 0, sender)
        applied = [decode_frame(mate.encode(deltas(mate_seed), 1, sender), LAYOUT)]
    enc.settle(pb.Settlement(kind=kind, sender=sender), own, applied)
    return before, after, [e.clone() for e in enc.compressor.error], own, applied


def test_each_settlement_kind() -> None:
    k = pb.Settlement
    before, after, now, own, _ = settled(k.KEEP)
    assert all(torch.equal(a, b) for a, b in zip(now, after, strict=True))
    before, after, now, own, _ = settled(k.RESTORE)
    assert all(torch.equal(a, b) for a, b in zip(now, before, strict=True))
    before, after, now, own, _ = settled(k.ADD_BACK)
    frame = decode_frame(own, LAYOUT)
    for j, (a, n) in enumerate(zip(after, now, strict=True)):
        want = a.clone().index_add_(0, frame.indices[j], frame.values[j])
        assert torch.equal(n, want)
    before, after, now, own, applied = settled(k.CREDIT, sender=3, mate_seed=6)  # another message
    for j, (a, n) in enumerate(zip(after, now, strict=True)):
        want = a.clone().index_add_(0, applied[0].indices[j], -applied[0].values[j])
        want.index_add_(0, frame.indices[j], frame.values[j])
        assert torch.equal(n, want)
    with pytest.raises(ValueError, match="did not apply"):
        settled(k.CREDIT, sender=2, mate_seed=None)


def test_credit_for_the_same_frame_changes_no_bit() -> None:
    """A classic FR group-mate sends the same message: its frame is this one's frame."""
    _, after, now, _, _ = settled(pb.Settlement.CREDIT, sender=3, mate_seed=5)
    assert all(torch.equal(a, b) for a, b in zip(now, after, strict=True))


@pytest.mark.slow
@pytest.mark.parametrize("scheme, n, s", [("pgc-fr", 4, 1), ("ignore", 4, 1), ("gc-fr", 4, 1)])
def test_nothing_leaks_once_frames_are_settled(scheme: str, n: int, s: int) -> None:
    """beta = 1, random stragglers, 6 rounds (benchmarks/ef_drift.py defines the leak)."""
    case = Case(scheme, n, s, "random")
    _, leak_after = run(case, settle=True, beta=1.0, rounds=6)
    _, leak_before = run(case, settle=False, beta=1.0, rounds=6)
    assert leak_after < 1e-5
    if scheme != "gc-fr":  # classic FR group-mates' frames are the same: nothing to settle
        assert leak_before > 0.1
