"""Parameter layout (names, shapes, dtypes) and the chunk geometry: how each tensor is cut
into chunks, and every size the frame format derives from that.

Chunking follows SparseLoCo (Sarfi et al. 2025, arXiv 2508.15706); docs/codec.md gives the
exact element order, which is part of the wire format. The scalar formulas here are the
only place these numbers are computed: they run as plain Python, and numba compiles the
same functions into the CPU kernels (``register_jitable``). Numba's on-disk cache checks
only a kernel's own file: after changing a formula, delete ``compression/_cpu/__pycache__``.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

try:
    from numba.extending import register_jitable as jitable
except ImportError:  # without numba the formulas are plain Python only
    def jitable(fn):
        return fn

DIGEST_BYTES = 16
SEGMENT_CHUNKS = 64  # chunks per segment of the index offsets section (frame version 2)


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

    def check_tensors(self, tensors: Sequence[torch.Tensor]) -> None:
        """ValueError naming the tensor unless ``tensors`` are float tensors of the layout's shapes."""
        if len(tensors) != len(self.specs):
            raise ValueError(f"expected {len(self.specs)} tensors for the layout, got {len(tensors)}")
        for spec, t in zip(self.specs, tensors, strict=True):
            if tuple(t.shape) != spec.shape:
                raise ValueError(f"tensor {spec.name!r} has shape {tuple(t.shape)}, layout says {spec.shape}")
            if not t.dtype.is_floating_point:
                raise ValueError(f"tensor {spec.name!r} has dtype {t.dtype}, expected a float dtype")

    def __len__(self) -> int:
        return len(self.specs)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Layout) and self.digest == other.digest

    def __hash__(self) -> int:
        return hash(self.digest)

    def __repr__(self) -> str:
        return f"Layout({len(self.specs)} tensors, {self.numel} elements, digest={self.digest.hex()})"


# ----------------------------------------------------------------------------- formulas
# A tensor's grid is (rows, cols, tile, row_tiles, col_tiles), see ChunkGrid. Integer
# arithmetic only, and no Python-only built-ins, so that numba compiles the same code.


@jitable
def kept_per_chunk(n, k_full, size):
    """Elements kept in a chunk of ``n`` elements when a full chunk of ``size`` keeps ``k_full``."""
    return min(n, (k_full * n + size - 1) // size)


@jitable
def code_bytes(k):
    """Bytes of a chunk's ``k`` 2-bit codes (each chunk starts on a byte)."""
    return (k + 3) // 4


@jitable
def rice_param(n, k):
    """Golomb-Rice parameter ``b`` for ``k`` sorted positions out of ``n``: ``2**b`` close
    to ln 2 times the mean gap (the optimum for geometric gaps), in integers so that the
    encoder and the decoder derive the same value."""
    if k <= 0:
        return 0
    v = (n - k) * 177 // (k * 256)
    b = 0
    while v > 1:
        v >>= 1
        b += 1
    return b


@jitable
def fixed_width(n):
    """Bits per position in the fixed-width index coding (12 for 4096-element chunks)."""
    v = n - 1
    w = 0
    while v > 0:
        v >>= 1
        w += 1
    return max(1, w)


@jitable
def rice_max_quotient(n, b):
    """The longest unary run a Rice code of an ``n``-element chunk may hold."""
    return (n - 1) >> b


@jitable
def index_bytes_max(n, k, fixed):
    """The most bytes a chunk's coded positions can take: exactly this for fixed width; for
    Rice, ``k(b+1)`` bits of terminators and remainders plus at most ``(n-k) >> b`` unary zeros."""
    if fixed:
        return (k * fixed_width(n) + 7) // 8
    b = rice_param(n, k)
    return (k * (b + 1) + ((n - k) >> b) + 7) // 8


@jitable
def leftover_numel(rows, cols, tile, row_tiles, col_tiles):
    """Elements outside the whole tiles (the right and bottom strips, or a whole flat tensor)."""
    return rows * cols - row_tiles * col_tiles * tile * tile


@jitable
def chunk_count(rows, cols, tile, row_tiles, col_tiles):
    size = tile * tile
    return row_tiles * col_tiles + (leftover_numel(rows, cols, tile, row_tiles, col_tiles) + size - 1) // size


@jitable
def chunk_numel(c, rows, cols, tile, row_tiles, col_tiles):
    """Elements of chunk ``c``: ``tile**2``, but for a short last chunk."""
    size = tile * tile
    short = leftover_numel(rows, cols, tile, row_tiles, col_tiles) % size
    if short and c == chunk_count(rows, cols, tile, row_tiles, col_tiles) - 1:
        return short
    return size


@jitable
def tile_shift(tile):
    """log2(tile) when tile is a power of two (positions then split by shift and mask), else -1."""
    if tile & (tile - 1):
        return -1
    s = 0
    while (1 << s) < tile:
        s += 1
    return s


@jitable
def tile_origin(c, cols, tile, col_tiles):
    """Flat index of the first element of tile ``c`` (row-major tile order)."""
    tr = c // col_tiles
    return tr * tile * cols + (c - tr * col_tiles) * tile


@jitable
def in_tile(base, stride, tile, shift, p):
    """Where position ``p`` of a chunk read in rows of ``tile`` elements, ``stride`` apart from
    ``base``, lies; shift from ``tile_shift``."""
    if shift >= 0:
        return base + (p >> shift) * stride + (p & (tile - 1))
    return base + (p // tile) * stride + p % tile


@jitable
def leftover_flat(q, rows, cols, tile, row_tiles, col_tiles):
    """Flat index of leftover element ``q``: the right strip row by row, then the bottom strip."""
    cw = col_tiles * tile
    if cw == 0:
        return q
    cr = cols - cw
    if q < rows * cr:
        return (q // cr) * cols + cw + q % cr
    q -= rows * cr
    return (row_tiles * tile + q // cw) * cols + q % cw


@jitable
def flat_index(c, p, rows, cols, tile, row_tiles, col_tiles):
    """Flat index of position ``p`` of chunk ``c``."""
    if c < row_tiles * col_tiles:
        return in_tile(tile_origin(c, cols, tile, col_tiles), cols, tile, -1, p)
    return leftover_flat((c - row_tiles * col_tiles) * tile * tile + p, rows, cols, tile, row_tiles, col_tiles)


# ----------------------------------------------------------------------------- one tensor


@dataclass(frozen=True)
class ChunkGrid:
    """How one tensor is cut into chunks of at most ``size = tile*tile`` elements.

    The tensor is viewed as ``rows x cols`` (non-2-D tensors as ``1 x numel``; a 2-D one
    with fewer than ``tile`` rows or columns has no tiles). The first ``row_tiles * col_tiles`` chunks
    are tiles in row-major tile order, each read row by row. The remaining elements
    ("leftovers") are, in order, the right strip (all rows, columns ``col_tiles*tile ..``)
    row by row, then the bottom strip (rows ``row_tiles*tile ..``, columns
    ``.. col_tiles*tile``) row by row; they are cut into flat chunks of ``size`` elements,
    the last one shorter.
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
    def dims(self) -> tuple[int, int, int, int, int]:
        """(rows, cols, tile, row_tiles, col_tiles): the formulas' grid arguments."""
        return self.rows, self.cols, self.tile, self.row_tiles, self.col_tiles

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
        return leftover_numel(*self.dims)

    @property
    def n_chunks(self) -> int:
        return chunk_count(*self.dims)

    @property
    def last_size(self) -> int:
        """Size of the last chunk (``size`` when there is no short chunk)."""
        return chunk_numel(self.n_chunks - 1, *self.dims)

    def chunk_sizes(self) -> list[int]:
        n = self.n_chunks
        return [self.size] * (n - 1) + [self.last_size] if n else []

    def flat_index(self, chunk: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """``flat_index`` for int64 tensors of chunks and positions (any device)."""
        t = self.tile
        out = torch.empty_like(pos)
        is_tile = chunk < self.n_tiles
        if self.n_tiles:
            c, p = chunk[is_tile], pos[is_tile]
            tr, tc = torch.div(c, self.col_tiles, rounding_mode="floor"), c % self.col_tiles
            r, col = torch.div(p, t, rounding_mode="floor"), p % t
            out[is_tile] = (tr * t + r) * self.cols + tc * t + col
        left = ~is_tile
        out[left] = self.leftover_flat((chunk[left] - self.n_tiles) * self.size + pos[left])
        return out

    def leftover_flat(self, q: torch.Tensor) -> torch.Tensor:
        """``leftover_flat`` for an int64 tensor of leftover positions."""
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


# ----------------------------------------------------------------------------- one frame

# columns of FrameGeometry.chunks
TENSOR, CHUNK, NUMEL, KEPT, FIRST_KEPT, FIRST_CODE = range(6)


@dataclass(frozen=True, eq=False)
class FrameGeometry:
    """What a sparse frame for one layout and codec parameters holds where, from the layout
    alone: its chunks, the sections' sizes and the segments of the index offsets section.
    Arrays are read-only; ``frame_geometry`` makes each one once."""

    layout: Layout
    tile: int
    k_full: int
    per_chunk: bool
    fixed: bool
    grids: tuple[ChunkGrid, ...]
    chunks: np.ndarray     # per chunk in frame order: tensor, chunk in tensor, numel, kept, first kept element, first code byte
    grid: np.ndarray       # per tensor: rows, cols, row_tiles, col_tiles
    n_chunks: np.ndarray   # per tensor
    kept_off: np.ndarray   # first kept element of each tensor, then the total
    tab_off: np.ndarray    # first table level of each tensor (bfloat16; bins: fp32), then the total
    seg_start: np.ndarray  # per segment: tensor, chunk in tensor, first kept element, first code byte, full-size chunks
    table_bytes: int
    code_bytes: int
    index_bytes_max: int
    index_dtype: type      # of flat indices: int32 where every tensor allows
    bins: bool = False     # the 4-bin quantizer: 4 fp32 values per non-empty tensor

    @property
    def kept(self) -> int:
        return int(self.kept_off[-1])


BINS = 4  # values in a tensor's table under the 4-bin quantizer


@lru_cache(maxsize=64)
def frame_geometry(layout: Layout, tile: int, k_full: int, per_chunk: bool, fixed: bool,
                   bins: bool = False) -> FrameGeometry:
    grids = tuple(ChunkGrid.of(s.shape, tile) for s in layout.specs)
    chunks = chunk_table(grids, k_full)
    n_chunks = np.array([g.n_chunks for g in grids], dtype=np.int64)
    kept = np.bincount(chunks[:, TENSOR], weights=chunks[:, KEPT], minlength=len(grids))
    # 4 fp32 bin values per tensor; or a (hi, lo) bfloat16 pair per chunk, or per tensor
    per_tensor = BINS if bins else 2
    levels = 2 * n_chunks if per_chunk and not bins else per_tensor * (n_chunks > 0)
    sizes, counts = np.unique(chunks[:, [NUMEL, KEPT]], axis=0, return_counts=True)  # few distinct chunk sizes
    geo = FrameGeometry(
        layout, tile, k_full, per_chunk, fixed, grids, chunks,
        grid=np.array([[g.rows, g.cols, g.row_tiles, g.col_tiles] for g in grids], dtype=np.int64).reshape(-1, 4),
        n_chunks=n_chunks, kept_off=_running_total(kept), tab_off=_running_total(levels),
        seg_start=_segment_starts(chunks, tile * tile), table_bytes=(4 if bins else 2) * int(levels.sum()),
        code_bytes=sum(code_bytes(int(k)) * int(c) for (_, k), c in zip(sizes, counts, strict=True)),
        index_bytes_max=sum(index_bytes_max(int(n), int(k), fixed) * int(c)
                            for (n, k), c in zip(sizes, counts, strict=True)),
        index_dtype=np.int32 if max((s.numel for s in layout.specs), default=0) < 2**31 else np.int64,
        bins=bins)
    for a in (geo.chunks, geo.grid, geo.n_chunks, geo.kept_off, geo.tab_off, geo.seg_start):
        a.setflags(write=False)
    return geo


def chunk_table(grids: Sequence[ChunkGrid], k_full: int) -> np.ndarray:
    """FrameGeometry.chunks: every chunk of every tensor, in frame order."""
    parts = []
    for t, g in enumerate(grids):
        numel = np.full(g.n_chunks, g.size, dtype=np.int64)
        numel[-1:] = g.last_size
        full_k, last_k = kept_per_chunk(g.size, k_full, g.size), kept_per_chunk(g.last_size, k_full, g.size)
        kept = np.where(numel == g.size, full_k, last_k)
        codes = np.where(numel == g.size, code_bytes(full_k), code_bytes(last_k))
        parts.append(np.column_stack([np.full(g.n_chunks, t), np.arange(g.n_chunks), numel, kept, kept, codes]))
    table = np.concatenate(parts).astype(np.int64) if parts else np.zeros((0, 6), dtype=np.int64)
    table[:, FIRST_KEPT] = np.cumsum(table[:, KEPT]) - table[:, KEPT]
    table[:, FIRST_CODE] = np.cumsum(table[:, FIRST_CODE]) - table[:, FIRST_CODE]  # the column held code bytes
    return table


def _running_total(x: np.ndarray) -> np.ndarray:
    """0, then the cumulative sums of x, as int64."""
    return np.concatenate([[0], np.cumsum(x, dtype=np.int64)]).astype(np.int64)


def _segment_starts(chunks: np.ndarray, size: int) -> np.ndarray:
    """FrameGeometry.seg_start from the chunk table."""
    firsts = np.arange(0, len(chunks), SEGMENT_CHUNKS)
    full = (chunks[:, NUMEL] == size).astype(np.int64)
    full_per_segment = np.add.reduceat(full, firsts) if len(full) else full
    starts = chunks[firsts][:, [TENSOR, CHUNK, FIRST_KEPT, FIRST_CODE]]
    return np.column_stack([starts, full_per_segment]).astype(np.int64).reshape(-1, 5)
