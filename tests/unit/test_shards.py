"""An island's compressor split over its ranks (compression.shards; docs/codec.md,
"Islands"): each rank keeps the error feedback of its pieces and encodes them, and the
frame joined from the ranks' parts is the whole compressor's, byte for byte, round after
round, with the same error feedback element for element; settling a frame (restore, add
back) does to each piece what it does to the whole."""

from __future__ import annotations

import pytest
import torch

from geoloco.compression import Compressor, Layout, TensorSpec, apply_frames, decode_frame
from geoloco.compression.shards import ShardCompressor, apply_to_pieces, cut_points, split_layout

TILE = 16


def layout() -> Layout:
    return Layout([
        TensorSpec("emb", (101, 48), torch.float32),    # bands of 16 rows, 5 rows left over
        TensorSpec("w", (64, 40), torch.float32),       # a right strip: never cut
        TensorSpec("b", (700,), torch.float32),         # flat chunks of 256
        TensorSpec("conv", (4, 3, 30), torch.float32),  # not 2-D: flat
        TensorSpec("none", (0,), torch.float32),
        TensorSpec("head", (40, 32), torch.float32),
        TensorSpec("small", (8, 8), torch.float32),     # fewer rows than a tile: flat
    ])


def deltas(lay: Layout, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    scale = torch.rand(1, generator=gen) + 0.5
    return [torch.randn(s.shape, generator=gen) * scale for s in lay.specs]


def test_cut_points_keep_each_tensor_chunked_as_a_whole() -> None:
    lay = layout()
    assert cut_points(lay.specs[0], TILE) == [16 * 48 * b for b in range(1, 6)]
    assert cut_points(lay.specs[1], TILE) == []
    assert cut_points(lay.specs[2], TILE) == [256, 512]
    assert cut_points(lay.specs[3], TILE) == [256]  # 360 elements, not 2-D: a flat chunk and a short one
    assert cut_points(lay.specs[0], TILE, per_chunk=False) == []


@pytest.mark.parametrize("ranks", [1, 2, 3, 4, 7])
def test_pieces_cover_the_layout_once_in_order(ranks: int) -> None:
    lay = layout()
    shares = split_layout(lay, ranks, TILE)
    assert len(shares) == ranks
    flat = [(p.tensor, p.start, p.stop) for share in shares for p in share]
    covered = {}
    for t, a, b in flat:
        covered.setdefault(t, []).append((a, b))
    for j, spec in enumerate(lay.specs):
        runs = covered.get(j, [])
        assert [a for a, _ in runs] == sorted(a for a, _ in runs)
        assert sum(b - a for a, b in runs) == spec.numel
        assert all(runs[i][1] == runs[i + 1][0] for i in range(len(runs) - 1))
    if ranks <= 4:  # enough cut points: no rank idle, shares within a band of each other
        held = [sum(p.numel for p in share) for share in shares]
        assert min(held) > 0


@pytest.mark.parametrize("backend", ["numba", "reference"])
@pytest.mark.parametrize("table", ["chunk", "tensor"])
@pytest.mark.parametrize("ranks", [2, 3, 5])  # 3: emb cut between bands; 5: b cut between flat chunks
def test_joined_frame_is_the_whole_compressors_byte_for_byte(backend: str, table: str, ranks: int) -> None:
    lay = layout()
    kw = dict(density=24 / 256, tile=TILE, table=table, backend=backend, undoable=True)
    whole = Compressor(lay, **kw)
    per_chunk = table == "chunk"
    shards = [ShardCompressor(lay, pieces, whole) for pieces in split_layout(lay, ranks, TILE, per_chunk)]
    assert sum(s.held for s in shards) == lay.numel
    for r in range(4):
        d = deltas(lay, r)
        want = whole.compress(d, round=r, sender=3)
        got = shards[0].join_frame([s.compress(d) for s in shards], round=r, sender=3)
        assert got == want, f"round {r}: the joined frame differs"
        frame = decode_frame(want, lay)
        if r == 1:  # RESTORE: as if never compressed
            whole.restore()
            for s in shards:
                s.restore()
        if r == 2:  # ADD_BACK, and a CREDIT's mate taken out
            whole.add_frame(frame, 1.0)
            for s in shards:
                s.add_frame(frame, 1.0)
            whole.add_frame(frame, -0.5)
            for s in shards:
                s.add_frame(frame, -0.5)
        for s in shards:
            for j, p in enumerate(s.pieces):
                mine = whole.error[p.tensor].reshape(-1)[p.start:p.stop]
                assert torch.equal(s.compressor.error[j], mine), f"round {r}: error feedback of {p} differs"


def test_density_follows_and_state_refuses_other_pieces() -> None:
    lay = layout()
    whole = Compressor(lay, density=24 / 256, tile=TILE)
    two = [ShardCompressor(lay, pieces, whole) for pieces in split_layout(lay, 2, TILE)]
    three = [ShardCompressor(lay, pieces, whole) for pieces in split_layout(lay, 3, TILE)]
    whole.set_density(48 / 256)
    for s in two:
        s.set_density(48 / 256)
    d = deltas(lay, 0)
    assert two[0].join_frame([s.compress(d) for s in two], round=0, sender=0) == whole.compress(d, round=0, sender=0)
    with pytest.raises(ValueError, match="another layout"):
        three[0].load_state_dict(two[0].state_dict())
    three[0].load_state_dict(three[0].state_dict())


@pytest.mark.parametrize("backend", ["numba", "reference"])
@pytest.mark.parametrize("mode", ["sum", "mean_kept", "dense"])
@pytest.mark.parametrize("ranks", [2, 3, 5])
def test_frames_applied_to_pieces_are_the_whole_apply_bit_for_bit(backend: str, mode: str, ranks: int) -> None:
    """A rank's pieces of θ after apply_to_pieces are its pieces of the whole θ after
    apply_frames, bit for bit: sparse frames of several workers (mean over keepers, or each
    applied alone in order as a worker sums them), or dense ones; the untouched coordinates
    keep their bits, a negative zero included."""
    lay = layout()
    comp = dict(density=24 / 256, tile=TILE, backend=backend)
    if mode == "dense":
        from geoloco.compression import encode_dense
        data = [encode_dense(lay, deltas(lay, 10 + s), round=0, sender=s) for s in range(3)]
    else:
        data = [Compressor(lay, **comp).compress(deltas(lay, 10 + s), round=0, sender=s) for s in range(3)]
    frames = [decode_frame(d, lay, backend=backend) for d in data]
    weights, alpha = [0.5, 0.25, 0.3], -0.7
    theta = deltas(lay, 99)
    theta[0].view(-1)[:7] = -0.0
    whole = [t.clone() for t in theta]
    split = split_layout(lay, ranks, TILE)
    pieces = [ShardCompressor(lay, share, Compressor(lay, **comp)).slices(theta) for share in split]
    pieces = [[t.clone() for t in share] for share in pieces]
    groups = [[(f, w)] for f, w in zip(frames, weights, strict=True)] if mode == "sum" else [list(zip(frames, weights, strict=True))]
    for group in groups:
        fs, ws = [f for f, _ in group], [w for _, w in group]
        apply_frames(whole, fs, ws, mode="sum" if mode == "dense" else mode, alpha=alpha)
        for share, mine in zip(split, pieces, strict=True):
            apply_to_pieces(mine, share, fs, ws, "sum" if mode == "dense" else mode, alpha)
    for share, mine in zip(split, pieces, strict=True):
        for piece, got in zip(share, mine, strict=True):
            want = whole[piece.tensor].reshape(-1)[piece.start:piece.stop]
            assert torch.equal(got.reshape(-1).view(torch.int32), want.view(torch.int32)), piece
