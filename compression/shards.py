"""A layout's chunks split over the ranks of an island, so that each rank keeps the error
feedback of its own part and compresses it, and one frame of the whole layout is joined
from the parts (docs/codec.md, "Islands").

A sparse frame's sections are, tensor after tensor and chunk after chunk, each chunk's
table levels, 2-bit codes and coded positions, every chunk starting on a byte. So the
frame of a layout is the concatenation, section by section, of the frames of consecutive
runs of its chunks, provided each run is cut where a tensor's own chunking does not
change: a rank owns one contiguous run of the model's elements in layout order, cut only
between two tensors or at a cut point inside one (``cut_points``), and compresses it as a
layout of its own (its ``Piece``s, each a slice of one tensor with its own shape). Under
the per-tensor quantizers (``table`` ``tensor`` or ``bins``), whose levels come from the
whole tensor, tensors are never cut.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from .apply import _check, _dense_update, _f32
from .compressor import Compressor
from .format import KIND_SPARSE, index_offsets_section, write_frame
from .frame import Frame
from .layout import ChunkGrid, Layout, TensorSpec
from .reference import _sparse_update


@dataclass(frozen=True)
class Piece:
    """Elements [start, stop) of tensor ``tensor`` of a layout, flat, compressed as a tensor
    of ``shape`` (rows of the whole tensor, or a flat run)."""

    tensor: int
    start: int
    stop: int
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return self.stop - self.start


class Parts(NamedTuple):
    """One rank's part of a sparse frame: its chunks' sections, and the index bytes of each
    chunk (what ``join_frame`` puts together)."""

    table: bytes
    codes: bytes
    index: bytes
    chunk_index_bytes: np.ndarray


def cut_points(spec: TensorSpec, tile: int, per_chunk: bool = True) -> list[int]:
    """Flat offsets inside the tensor where it may be cut so that both sides chunk as the
    whole tensor does: between two bands of ``tile`` rows of a 2-D tensor whose columns are
    whole tiles (the bottom rows that fill no band stay with the last band), between two
    chunks of a flat one. None for a 2-D tensor with a right strip (its leftover chunks run
    across every row), or where the quantizer's levels are per tensor."""
    grid = ChunkGrid.of(spec.shape, tile)
    if not per_chunk or spec.numel == 0:
        return []
    if grid.row_tiles == 0:  # flat chunks of tile**2 elements
        size = tile * tile
        return list(range(size, spec.numel, size))
    if grid.cols % tile:
        return []
    band = tile * grid.cols
    return [b * band for b in range(1, grid.row_tiles)]


def split_layout(layout: Layout, ranks: int, tile: int, per_chunk: bool = True) -> list[list[Piece]]:
    """Each rank's pieces: consecutive runs of the layout's elements, rank 0's first, cut at
    the cut points nearest to equal shares (a rank may get nothing when there are fewer
    places to cut than ranks)."""
    if ranks < 1:
        raise ValueError(f"ranks must be at least 1, got {ranks}")
    cuts, base = [0], 0  # every place the model may be cut, as global element offsets
    for spec in layout.specs:
        cuts.extend(base + c for c in cut_points(spec, tile, per_chunk))
        base += spec.numel
        cuts.append(base)
    cuts = sorted(set(cuts))
    total = base
    bounds = [0]
    for r in range(1, ranks):
        want = total * r / ranks
        best = min(cuts, key=lambda c: (abs(c - want), c))
        bounds.append(max(best, bounds[-1]))
    bounds.append(total)
    return [_pieces(layout, tile, bounds[r], bounds[r + 1]) for r in range(ranks)]


def _pieces(layout: Layout, tile: int, lo: int, hi: int) -> list[Piece]:
    out, base = [], 0
    for j, spec in enumerate(layout.specs):
        start, stop = max(lo, base), min(hi, base + spec.numel)
        if start < stop:
            a, b = start - base, stop - base
            if (a, b) == (0, spec.numel):
                shape = spec.shape
            elif ChunkGrid.of(spec.shape, tile).row_tiles == 0:
                shape = (b - a,)
            else:
                cols = spec.shape[1]
                shape = ((b - a) // cols, cols)
            out.append(Piece(j, a, b, shape))
        base += spec.numel
    return out


def piece_layout(layout: Layout, pieces: Sequence[Piece]) -> Layout:
    """The layout a rank compresses: its pieces as tensors of their own."""
    return Layout(TensorSpec(f"{layout.specs[p.tensor].name}[{p.start}:{p.stop}]", p.shape, torch.float32)
                  for p in pieces)


def apply_to_pieces(pieces_params: Sequence[torch.Tensor], pieces: Sequence[Piece], frames: Sequence[Frame],
                    weights: Sequence[float], mode: str = "sum", alpha: float = 1.0) -> None:
    """``apply_frames`` of frames of the whole layout to a rank's pieces of its params (fp32
    CPU tensors shaped as ``pieces``): each element updated as apply_frames updates it in
    the whole tensor (the reference's arithmetic, which every backend matches bit for bit):
    a sparse update only where a frame kept the coordinate, a dense one everywhere."""
    frames = list(frames)
    if not frames:
        return
    layout = frames[0].layout
    weights = _check(layout, frames, weights, mode)
    if len(pieces_params) != len(pieces):
        raise ValueError(f"{len(pieces_params)} params for {len(pieces)} pieces")
    dense = any(f.kind == "dense" for f in frames)
    decoded = None if dense else [(f.indices, f.values) for f in frames]
    by_tensor: dict[int, list[int]] = {}
    for i, piece in enumerate(pieces):
        by_tensor.setdefault(piece.tensor, []).append(i)
    cpu = torch.device("cpu")
    with torch.no_grad():
        for j, mine in by_tensor.items():
            numel = layout.specs[j].numel
            if numel == 0:
                continue
            if dense:
                step = _dense_update(layout, frames, weights, j, mode, cpu) * _f32(alpha, cpu)
                for i in mine:
                    p, piece = pieces_params[i], pieces[i]
                    p.copy_(p + step[piece.start:piece.stop].view(p.shape))
                continue
            idx, u = _sparse_update(decoded, weights, j, mode, cpu, numel)
            step = u * _f32(alpha, cpu)
            for i in mine:
                p, piece = pieces_params[i], pieces[i]
                inside = (idx >= piece.start) & (idx < piece.stop)
                p.view(-1).index_add_(0, idx[inside] - piece.start, step[inside])  # each index once


class ShardCompressor:
    """One rank's share of an island's SparseLoCo compressor: the error feedback of its
    pieces of ``layout`` (``split_layout``), as a Compressor of their own layout with the
    codec parameters of ``like`` (a Compressor of the whole layout, which is not used
    otherwise). ``compress`` takes the whole message and returns this rank's ``Parts``;
    ``join_frame`` puts every rank's into the frame the whole compressor would send, byte
    for byte, and the error feedback of the pieces is the whole one's, element for element."""

    def __init__(self, layout: Layout, pieces: Sequence[Piece], like: Compressor) -> None:
        self.layout = layout
        self.pieces = list(pieces)
        self.compressor = Compressor(piece_layout(layout, self.pieces), density=like.density, beta=like.beta,
                                     tile=like.tile, index_coding=like.index_coding, zstd=like.zstd,
                                     device=like.device, table=like.table, backend=like.backend,
                                     undoable=like.undoable)

    @property
    def held(self) -> int:
        """Elements of error feedback this rank holds."""
        return sum(p.numel for p in self.pieces)

    def slices(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """This rank's pieces of whole tensors of the layout, shaped as its layout's."""
        return [tensors[p.tensor].detach().reshape(-1)[p.start:p.stop].view(p.shape) for p in self.pieces]

    def compress(self, deltas: Sequence[torch.Tensor]) -> Parts:
        """Add this rank's pieces of ``deltas`` (whole tensors of the layout) into its error
        feedback and encode them."""
        return self.compress_pieces(self.slices(deltas))

    def compress_pieces(self, pieces: Sequence[torch.Tensor]) -> Parts:
        """``compress`` of this rank's pieces (``slices``) alone."""
        encoded = self.compressor.encode(list(pieces))
        return Parts(encoded.table, encoded.codes, encoded.index, np.asarray(encoded.chunk_index_bytes, np.int64))

    def join_frame(self, parts: Sequence[Parts], *, round: int, sender: int) -> bytes:
        """The frame of the whole layout from every rank's parts, in rank order."""
        c = self.compressor
        chunk_bytes = np.concatenate([p.chunk_index_bytes for p in parts]) if parts else np.zeros(0, np.int64)
        sections = [b"".join(p.table for p in parts), b"".join(p.codes for p in parts),
                    b"".join(p.index for p in parts), index_offsets_section(chunk_bytes)]
        return write_frame(KIND_SPARSE, c.table_mode, c.index_mode, self.layout, round, sender, c.tile, c.k,
                           sections, c.zstd)

    def add_frame(self, frame: Frame, weight: float = 1.0) -> None:
        """``Compressor.add_frame`` of a frame of the whole layout, for this rank's pieces."""
        if frame.kind != "sparse" or frame.layout != self.layout:
            raise ValueError(f"{frame!r} is not a sparse frame of this island's layout")
        self.add_kept(frame.indices, frame.values, weight)

    def add_kept(self, indices: Sequence[torch.Tensor], values: Sequence[torch.Tensor], weight: float) -> None:
        """``e += fp32(weight) * v`` at each kept (flat index, value) of the whole layout's
        tensors (a sparse frame's ``indices`` and ``values``) that falls in this rank's pieces."""
        for j, p in enumerate(self.pieces):
            idx, vals = indices[p.tensor], values[p.tensor]
            mine = (idx >= p.start) & (idx < p.stop)
            self.compressor.add_kept(j, idx[mine] - p.start, vals[mine], weight)

    def reset(self) -> None:
        """Error feedback from zero (a restore the island could not make on every rank)."""
        self.compressor.reset()

    def restore(self) -> None:
        self.compressor.restore()

    def set_density(self, density: float) -> None:
        self.compressor.set_density(density)

    def state_dict(self) -> dict:
        return self.compressor.state_dict()

    def load_state_dict(self, d: dict) -> None:
        """ValueError if ``d`` was saved for other pieces (another island size or layout)."""
        self.compressor.load_state_dict(d)
