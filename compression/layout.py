"""Parameter layout (names, shapes, dtypes) and how each tensor is cut into chunks.

Chunking follows SparseLoCo (Sarfi et al. 2025, arXiv 2508.15706): 2-D tensors are cut
into ``tile x tile`` tiles; 1-D, 0-d and >2-D tensors and the leftovers of 2-D tensors
are cut into flat chunks of ``tile * tile`` elements. See docs/codec.md for the exact
element order, which is part of the wire format.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch

DIGEST_BYTES = 16


@dataclass(frozen=True)
class TensorSpec:
    """Name, shape and dtype of one parameter tensor."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        if any(s < 0 for s in self.shape):
            raise ValueError(f"tensor {self.name!r}: negative dimension in shape {self.shape}")

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class Layout:
    """An ordered list of tensor specs; ``digest`` identifies it on the wire."""

    def __init__(self, specs: Iterable[TensorSpec]) -> None:
        self.specs: tuple[TensorSpec, ...] = tuple(specs)
        names = [s.name for s in self.specs]
        if len(set(names)) != len(names):
            raise ValueError("layout has duplicate tensor names")
        self.numel: int = sum(s.numel for s in self.specs)
        h = hashlib.sha256(b"geoloco-layout-v1\0")
        for s in self.specs:
            h.update(f"{s.name}\0{list(s.shape)}\0{str(s.dtype)}\n".encode())
        self.digest: bytes = h.digest()[:DIGEST_BYTES]

    @classmethod
    def from_named_tensors(cls, named: Iterable[tuple[str, torch.Tensor]]) -> Layout:
        return cls(TensorSpec(n, tuple(t.shape), t.dtype) for n, t in named)

    def __len__(self) -> int:
        return len(self.specs)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Layout) and self.digest == other.digest

    def __hash__(self) -> int:
        return hash(self.digest)

    def __repr__(self) -> str:
        return f"Layout({len(self.specs)} tensors, {self.numel} elements, digest={self.digest.hex()})"


@dataclass(frozen=True)
class ChunkGrid:
    """How one tensor is cut into chunks of at most ``size = tile*tile`` elements.

    The tensor is viewed as ``rows x cols`` (non-2-D tensors as ``1 x numel``). The first
    ``row_tiles * col_tiles`` chunks are tiles in row-major tile order, each read row by
    row. The remaining elements ("leftovers") are, in order, the right strip
    (all rows, columns ``col_tiles*tile ..``) row by row, then the bottom strip
    (rows ``row_tiles*tile ..``, columns ``.. col_tiles*tile``) row by row; they are cut
    into flat chunks of ``size`` elements, the last one shorter.
    """

    rows: int
    cols: int
    tile: int
    row_tiles: int
    col_tiles: int

    @staticmethod
    def of(shape: tuple[int, ...], tile: int) -> ChunkGrid:
        if len(shape) == 2:
            rows, cols = shape
            rt, ct = rows // tile, cols // tile
            if rt == 0 or ct == 0:
                rt = ct = 0
        else:
            rows, cols, rt, ct = 1, math.prod(shape), 0, 0
        return ChunkGrid(rows, cols, tile, rt, ct)

    @property
    def size(self) -> int:
        return self.tile * self.tile

    @property
    def numel(self) -> int:
        return self.rows * self.cols

    @property
    def n_tiles(self) -> int:
        return self.row_tiles * self.col_tiles

    @property
    def leftover(self) -> int:
        return self.numel - self.n_tiles * self.size

    @property
    def n_chunks(self) -> int:
        return self.n_tiles + -(-self.leftover // self.size)

    @property
    def last_size(self) -> int:
        """Size of the last chunk (``size`` when there is no short chunk)."""
        rem = self.leftover % self.size
        return rem if rem else self.size

    def chunk_sizes(self) -> list[int]:
        n = self.n_chunks
        return [self.size] * (n - 1) + [self.last_size] if n else []

    def flat_index(self, chunk: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Flat element index of position ``pos`` inside chunk ``chunk`` (int64 tensors)."""
        t, s = self.tile, self.size
        out = torch.empty_like(pos)
        is_tile = chunk < self.n_tiles
        if self.n_tiles:
            c, p = chunk[is_tile], pos[is_tile]
            tr, tc = torch.div(c, self.col_tiles, rounding_mode="floor"), c % self.col_tiles
            r, col = torch.div(p, t, rounding_mode="floor"), p % t
            out[is_tile] = (tr * t + r) * self.cols + tc * t + col
        left = ~is_tile
        q = (chunk[left] - self.n_tiles) * s + pos[left]
        out[left] = self.leftover_flat(q)
        return out

    def leftover_flat(self, q: torch.Tensor) -> torch.Tensor:
        """Flat element index of leftover position ``q`` (int64 tensor)."""
        cw = self.col_tiles * self.tile
        cr = self.cols - cw
        if cw == 0:
            return q
        right = q < self.rows * cr
        out = torch.empty_like(q)
        qr = q[right]
        out[right] = torch.div(qr, cr, rounding_mode="floor") * self.cols + cw + qr % cr
        qb = q[~right] - self.rows * cr
        out[~right] = (self.row_tiles * self.tile + torch.div(qb, cw, rounding_mode="floor")) * self.cols + qb % cw
        return out


def kept_per_chunk(n: int, k_full: int, size: int) -> int:
    """Elements kept in a chunk of ``n`` elements when a full chunk of ``size`` keeps ``k_full``."""
    return min(n, -(-k_full * n // size))
