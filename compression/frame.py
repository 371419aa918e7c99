"""The frame format: header, sections, checksum; writing frames and validating them.

Byte layout (little-endian; docs/codec.md is the spec):

    header   magic "GLCF", version, kind, p1, p2, layout digest (16), round u64,
             sender u32, tensors u32, elements u64, tile u16, k u32, body length u64
    body     sections, each: codec u8 (0 raw, 1 zstd), raw length u64, stored length u64,
             stored bytes. Sparse: table, codes, index, index offsets (u32 per segment of
             64 chunks, so that threads can decode a frame together). Dense: values.
    trailer  CRC-32 of everything before it, u32

Every count and length read from a frame is checked against what the layout allows
before anything is allocated; violations raise ``FrameError`` naming the problem.
"""

from __future__ import annotations

import struct
import threading
import zlib
from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

import numpy as np
import torch

from . import decode_kernel, kernels
from .bits import fixed_width, rice_param
from .errors import FrameError
from .layout import ChunkGrid, Layout, kept_per_chunk
from .threadpool import pieces, run_tasks, submit

MAGIC = b"GLCF"
VERSION = 2  # 2: sparse frames carry index offsets per segment of chunks
KIND_SPARSE, KIND_DENSE = 1, 2
TABLE_PER_TENSOR, TABLE_PER_CHUNK = 0, 1
INDEX_FIXED, INDEX_RICE = 0, 1
DTYPE_FP32, DTYPE_BF16 = 0, 1
MAX_TILE = 256

_HEADER = struct.Struct("<4sBBBB16sQIIQHIQ")
_SECTION = struct.Struct("<BQQ")
_CRC = struct.Struct("<I")
HEADER_BYTES = _HEADER.size

_DENSE_DTYPES = {DTYPE_FP32: (torch.float32, 4, "fp32"), DTYPE_BF16: (torch.bfloat16, 2, "bf16")}
DENSE_DTYPE_CODES = {"fp32": DTYPE_FP32, "bf16": DTYPE_BF16}

_DECODE_ERRORS = {
    kernels.ERR_INDEX_TRUNCATED: "index section ends inside chunk {c}",
    kernels.ERR_UNARY_TOO_LONG: "Rice code in chunk {c} has a unary run longer than the chunk allows",
    kernels.ERR_INDEX_RANGE: "index in chunk {c} is outside the chunk",
    kernels.ERR_INDEX_ORDER: "indices in chunk {c} are not strictly increasing",
    kernels.ERR_INDEX_PADDING: "nonzero padding bits after the indices of chunk {c}",
    kernels.ERR_CODE_PADDING: "nonzero padding bits after the 2-bit codes of chunk {c}",
    kernels.ERR_SEGMENT_END: "the indices of segment {s} do not end where the next segment's offset says",
}
SEGMENTS_PER_TASK = 8  # decoding work handed to a thread at a time (8 x 64 chunks)

try:
    import zstandard
except ImportError:  # pragma: no cover
    zstandard = None


# ----------------------------------------------------------------------------- plan


@dataclass(frozen=True)
class TensorPlan:
    """Sizes one tensor occupies in each section, derived from the layout alone."""

    grid: ChunkGrid
    kept: int          # elements kept in this tensor
    table_bytes: int
    code_bytes: int
    index_bytes_max: int
    index_bytes_exact: bool


@lru_cache(maxsize=64)
def sparse_plan(layout: Layout, tile: int, k_full: int, per_chunk: bool, fixed: bool) -> tuple[TensorPlan, ...]:
    plans = []
    size = tile * tile
    for spec in layout.specs:
        g = ChunkGrid.of(spec.shape, tile)
        kept = codes = idx = 0
        n_full = g.n_chunks - 1 if g.n_chunks else 0
        for n, count in ((size, n_full), (g.last_size, 1 if g.n_chunks else 0)):
            if not count:
                continue
            k = kept_per_chunk(n, k_full, size)
            kept += k * count
            codes += (k + 3) // 4 * count
            if fixed:
                idx += (k * fixed_width(n) + 7) // 8 * count
            else:
                b = rice_param(n, k)
                idx += (k * (b + 1) + ((n - k) >> b) + 7) // 8 * count
        table = 4 * g.n_chunks if per_chunk else (4 if g.n_chunks else 0)
        plans.append(TensorPlan(g, kept, table, codes, idx, fixed))
    return tuple(plans)


class _Geometry(NamedTuple):
    """What decoding a sparse frame needs from the layout alone (computed once per layout
    and codec parameters)."""

    grid: np.ndarray      # rows, cols, row_tiles, col_tiles per tensor
    kept_off: np.ndarray  # first kept element of each tensor, then the total
    tab_off: np.ndarray   # first table pair of each tensor
    seg_start: np.ndarray  # decode_kernel.segment_starts
    n_chunks: np.ndarray  # chunks per tensor
    table_bytes: int
    code_bytes: int
    index_bytes_max: int
    index_dtype: type     # of flat indices: int32 where every tensor allows


@lru_cache(maxsize=64)
def _decode_arrays(layout: Layout, tile: int, k_full: int, per_chunk: bool, fixed: bool) -> _Geometry:
    """The layout's ``_Geometry`` for these codec parameters."""
    plans = sparse_plan(layout, tile, k_full, per_chunk, fixed)
    grid = np.array([[p.grid.rows, p.grid.cols, p.grid.row_tiles, p.grid.col_tiles] for p in plans],
                    dtype=np.int64).reshape(-1, 4)
    kept_off = np.zeros(len(plans) + 1, dtype=np.int64)
    tab_off = np.zeros(len(plans) + 1, dtype=np.int64)
    for j, p in enumerate(plans):
        kept_off[j + 1] = kept_off[j] + p.kept
        tab_off[j + 1] = tab_off[j] + p.table_bytes // 2
    n_chunks = np.array([p.grid.n_chunks for p in plans], dtype=np.int64)
    for a in (grid, kept_off, tab_off, n_chunks):
        a.setflags(write=False)
    index_dtype = np.int32 if max(layout_sizes(layout), default=0) < 2**31 else np.int64
    return _Geometry(grid, kept_off, tab_off, decode_kernel.segment_starts(grid, k_full, tile), n_chunks,
                     sum(p.table_bytes for p in plans), sum(p.code_bytes for p in plans),
                     sum(p.index_bytes_max for p in plans), index_dtype)


@lru_cache(maxsize=64)
def layout_sizes(layout: Layout) -> tuple[int, ...]:
    return tuple(s.numel for s in layout.specs)


def index_offsets_section(chunk_index_bytes: np.ndarray) -> bytes:
    """The index offsets section from the index bytes of every chunk, in frame order."""
    starts = decode_kernel.segment_offsets(chunk_index_bytes)[:-1]
    if len(starts) and starts[-1] >= 2**32:
        raise ValueError("index section over 4 GiB: cut the model into several layouts")
    return starts.astype("<u4").tobytes()


# ----------------------------------------------------------------------------- writing


def _section(raw: bytes, use_zstd: bool) -> bytes:
    stored, codec = raw, 0
    if use_zstd and raw and zstandard is not None:
        z = zstandard.ZstdCompressor(level=3).compress(raw)
        if len(z) < len(raw):
            stored, codec = z, 1
    return _SECTION.pack(codec, len(raw), len(stored)) + stored


def write_frame(kind: int, p1: int, p2: int, layout: Layout, round: int, sender: int,
                tile: int, k_full: int, sections: list[bytes], use_zstd: bool) -> bytes:
    if not 0 <= round < 2**64 or not 0 <= sender < 2**32:
        raise ValueError(f"round must be in [0, 2**64) and sender in [0, 2**32), got {round}, {sender}")
    body = b"".join(_section(s, use_zstd) for s in sections)
    head = _HEADER.pack(MAGIC, VERSION, kind, p1, p2, layout.digest, round, sender,
                        len(layout.specs), layout.numel, tile, k_full, len(body))
    crc = zlib.crc32(body, zlib.crc32(head))
    return head + body + _CRC.pack(crc)


def encode_dense(layout: Layout, tensors, *, round: int, sender: int, dtype: str = "fp32",
                 zstd: bool = False) -> bytes:
    """A dense frame carrying ``tensors`` (any float dtype, any device) as fp32 or bf16."""
    if dtype not in DENSE_DTYPE_CODES:
        raise ValueError(f"dense dtype must be 'fp32' or 'bf16', got {dtype!r}")
    tensors = list(tensors)
    _check_tensors(layout, tensors)
    code = DENSE_DTYPE_CODES[dtype]
    tdtype = _DENSE_DTYPES[code][0]
    parts = []
    for spec, t in zip(layout.specs, tensors, strict=False):
        if not torch.isfinite(t).all():
            raise ValueError(f"tensor {spec.name!r} contains NaN or Inf")
        x = t.detach().reshape(-1).to(tdtype).cpu().contiguous()
        parts.append(x.view(torch.int16 if tdtype == torch.bfloat16 else torch.int32).numpy().tobytes())
    return write_frame(KIND_DENSE, code, 0, layout, round, sender, 0, 0, [b"".join(parts)], zstd)


def _check_tensors(layout: Layout, tensors) -> None:
    if len(tensors) != len(layout.specs):
        raise ValueError(f"expected {len(layout.specs)} tensors for the layout, got {len(tensors)}")
    for spec, t in zip(layout.specs, tensors, strict=False):
        if tuple(t.shape) != spec.shape:
            raise ValueError(f"tensor {spec.name!r} has shape {tuple(t.shape)}, layout says {spec.shape}")
        if not t.dtype.is_floating_point:
            raise ValueError(f"tensor {spec.name!r} has dtype {t.dtype}, expected a float dtype")


# ----------------------------------------------------------------------------- reading


@dataclass(slots=True, eq=False)
class SparseBody:
    """A validated sparse frame's sections, in the form ``decode_kernel`` reads."""

    buf: np.ndarray        # index section + INDEX_PAD readable bytes (read-only)
    index_len: int
    offsets: np.ndarray    # segment starts in the index section, then its length
    codes: np.ndarray
    levels: np.ndarray     # fp32 (hi, lo) pairs
    per_chunk: bool
    fixed: bool
    k_full: int
    tile: int
    grid: np.ndarray
    n_chunks: np.ndarray   # per tensor
    tab_off: np.ndarray
    seg_start: np.ndarray
    kept_off: np.ndarray
    index_dtype: type
    positions: np.ndarray  # in-chunk position of every kept element (uint16), found by VALIDATE
    ready: bool            # VALIDATE has filled positions (CHECK_APPLY does not)

    def run(self, mode: int, out_flat=None, out_val=None, addrs=None, w: float = 1.0, a: float = 1.0,
            log=None, applied=None, helper=None) -> tuple:
        """Run ``decode_kernel.decode_segments`` over all segments on the codec threads;
        returns the first problem (status, tensor, chunk, segment) or None. log: (addresses,
        values, per-segment counts) for CHECK_APPLY and RESTORE; helper: a waiting pool
        thread (``_Helper``) to take one thread's share (VALIDATE and CHECK_APPLY)."""
        if mode in (decode_kernel.MATERIALIZE, decode_kernel.APPLY) and not self.ready:
            problem = self.run(decode_kernel.VALIDATE)  # CHECK_APPLY did not keep the positions
            if problem is not None:  # validated by CHECK_APPLY: cannot happen
                raise AssertionError(f"validating a checked frame failed: {problem}")
        n_seg = len(self.seg_start)
        if mode in (decode_kernel.VALIDATE, decode_kernel.CHECK_APPLY):
            return self._check(mode, addrs, w, a, log, applied, helper)
        ranges = pieces(n_seg, SEGMENTS_PER_TASK) if n_seg else []
        results = np.zeros((len(ranges), 4), dtype=np.int64)
        out_flat = _EMPTY_I64 if out_flat is None else out_flat
        out_val = _EMPTY_F32 if out_val is None else out_val
        addrs = _EMPTY_I64 if addrs is None else addrs
        log_addr, log_val, n_log = (_EMPTY_I64, _EMPTY_F32, _EMPTY_I64) if log is None else log
        applied = _EMPTY_I64 if applied is None else applied
        w32, a32 = np.float32(w), np.float32(a)

        def task(i: int, s0: int, s1: int):
            def run() -> None:
                decode_kernel.decode_segments(mode, self.buf, self.index_len, self.offsets, self.codes, self.levels,
                                              self.per_chunk, self.fixed, self.k_full, self.tile, self.grid,
                                              self.tab_off, self.seg_start, s0, s1, self.positions, out_flat,
                                              out_val, addrs, w32, a32, log_addr, log_val, n_log, applied,
                                              results[i])
            return run

        run_tasks([task(i, s0, s1) for i, (s0, s1) in enumerate(ranges)], torch.get_num_threads())
        bad = [tuple(int(x) for x in r) for r in results if r[0] != kernels.OK]
        return min(bad, key=lambda r: r[3]) if bad else None

    def _check(self, mode: int, addrs, w: float, a: float, log, applied, helper) -> tuple | None:
        """VALIDATE or CHECK_APPLY: ``decode_kernel.check_segments`` on this thread and on
        the pool's, sharing out the segments; this thread's call returns once every
        segment is done, without waiting for a pool thread that had nothing left to do.
        Returns the first segment's problem, or None."""
        n_threads = max(1, min(torch.get_num_threads(), -(-len(self.seg_start) // 2)))
        problems = np.zeros((len(self.seg_start), 4), dtype=np.int64)
        shared = np.zeros(2, dtype=np.int64)  # next segment, threads at work
        addrs = _EMPTY_I64 if addrs is None else addrs
        log_addr, log_val, n_log = (_EMPTY_I64, _EMPTY_F32, _EMPTY_I64) if log is None else log
        applied = _EMPTY_I64 if applied is None else applied
        w32, a32 = np.float32(w), np.float32(a)

        def task(wait: bool) -> None:
            decode_kernel.check_segments(mode, self.buf, self.index_len, self.offsets, self.codes, self.levels,
                                         self.per_chunk, self.fixed, self.k_full, self.tile, self.grid, self.n_chunks,
                                         self.tab_off, self.seg_start, shared, wait, self.positions, addrs, w32, a32,
                                         log_addr, log_val, n_log, applied, problems)

        others = n_threads - 1
        if others and helper is not None and helper.hand(lambda: task(False)):
            others -= 1
        for _ in range(others):
            submit(lambda: task(False), n_threads)
        task(True)
        if mode == decode_kernel.VALIDATE:
            self.ready = True
        bad = np.flatnonzero(problems[:, 0] != kernels.OK)
        return tuple(int(x) for x in problems[bad[0]]) if len(bad) else None


_EMPTY_I64 = np.zeros(0, dtype=np.int64)
_NORM_PIECE = 1 << 20  # values squared in float64 at a time by Frame.magnitudes
_EMPTY_F32 = np.zeros(0, dtype=np.float32)


class Frame:
    """A validated frame.

    Sparse frames give, per tensor, the flat indices (int64, increasing within each
    chunk) and fp32 values of the kept elements; they are decoded on first use (and
    ``apply_frames`` applies one without materializing them). Dense frames hold fp32
    tensors.
    """

    def __init__(self, kind: str, round: int, sender: int, nbytes: int, layout: Layout,
                 indices=None, values=None, dense=None, params=None, body: SparseBody | None = None) -> None:
        self.kind = kind
        self.round = round
        self.sender = sender
        self.nbytes = nbytes
        self.layout = layout
        self._indices: list[torch.Tensor] | None = indices
        self._values: list[torch.Tensor] | None = values
        self.body = body
        self._packed: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
        self.dense: list[torch.Tensor] | None = dense
        self.params: dict = params or {}
        self._magnitudes: tuple[float, float] | None = None

    @property
    def packed(self) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """(flat indices (int32 where every tensor allows), values, kept offsets per tensor)
        of all tensors end to end, decoded on first use; None for other frames."""
        if self._packed is None and self.body is not None:
            self._packed = (*self._materialize(), self.body.kept_off)
        return self._packed

    def _materialize(self) -> tuple[np.ndarray, np.ndarray]:
        """The flat indices and values of a validated sparse body, in new buffers."""
        b = self.body
        flat = np.empty(b.kept_off[-1], dtype=b.index_dtype)
        vals = np.empty(b.kept_off[-1], dtype=np.float32)
        problem = b.run(decode_kernel.MATERIALIZE, flat, vals)
        if problem is not None:  # validated by decode_frame: cannot happen
            raise AssertionError(f"decoding a validated frame failed: {problem}")
        return flat, vals

    def _unpack(self) -> None:
        flat, vals, kept_off = self.packed
        flat_t, vals_t = torch.from_numpy(flat).long(), torch.from_numpy(vals)
        bounds = kept_off.tolist()
        self._indices = [flat_t[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
        self._values = [vals_t[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]

    @property
    def indices(self) -> list[torch.Tensor] | None:
        if self._indices is None and self.packed is not None:
            self._unpack()
        return self._indices

    @property
    def values(self) -> list[torch.Tensor] | None:
        if self._values is None and self.packed is not None:
            self._unpack()
        return self._values

    @property
    def kept(self) -> int:
        if self.kind == "dense":
            return self.layout.numel
        return int(self.body.kept_off[-1]) if self.body is not None else sum(len(i) for i in self.indices)

    def magnitudes(self) -> tuple[float, float]:
        """(L2 norm, largest absolute value) of the frame's values, summed in float64; a
        sparse frame's values are decoded into buffers that are not kept. Cached."""
        if self._magnitudes is None:
            if self.kind == "dense":
                squares = sum(float(torch.linalg.vector_norm(d, dtype=torch.float64)) ** 2 for d in self.dense)
                largest = max((float(d.abs().max()) for d in self.dense if d.numel()), default=0.0)
            else:
                vals = self._values_array()
                squares = sum(float(np.square(vals[i:i + _NORM_PIECE], dtype=np.float64).sum())
                              for i in range(0, len(vals), _NORM_PIECE))
                largest = max(float(vals.max()), -float(vals.min())) if len(vals) else 0.0
            self._magnitudes = (squares ** 0.5, largest)
        return self._magnitudes

    def _values_array(self) -> np.ndarray:
        if self._packed is not None:
            return self._packed[1]
        if self.body is None:
            return torch.cat([v.reshape(-1) for v in self.values]).numpy() if self.values else _EMPTY_F32
        return self._materialize()[1]

    def to_dense(self, device=None) -> list[torch.Tensor]:
        out = []
        for j, spec in enumerate(self.layout.specs):
            if self.kind == "dense":
                out.append(self.dense[j].to(device).reshape(spec.shape).clone())
                continue
            x = torch.zeros(spec.numel, dtype=torch.float32, device=device)
            x[self.indices[j].to(device)] = self.values[j].to(device)
            out.append(x.view(spec.shape))
        return out

    def __repr__(self) -> str:
        return f"Frame({self.kind}, round={self.round}, sender={self.sender}, {self.nbytes} bytes)"


def decode_frame(data: bytes, layout: Layout, *, _apply_to: tuple | None = None) -> Frame:
    """Validate and decode a frame made for ``layout``; raises FrameError on any problem.

    (_apply_to: (param addresses, weight, alpha) for ``aggregate.decode_apply``: a sparse
    frame's chunks are added into the fp32 params as they check out, and put back bit for
    bit before FrameError is raised. The checksum is then computed on a pool thread beside
    the parsing and the first chunks; a mismatch puts the params back too, and wins over
    any other problem, as it does here otherwise.)"""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise FrameError(f"frame must be bytes, got {type(data).__name__}")
    data = bytes(data)
    crc = None
    if _apply_to is not None and len(data) >= HEADER_BYTES + _CRC.size:
        crc = _Helper(data, torch.get_num_threads())
        _apply_to = (*_apply_to, crc)
    try:
        head = _read_header(data, check_crc=crc is None)
    except FrameError:  # a problem found before the checksum's turn
        if crc is not None:
            crc.release()
        raise
    try:
        (_, _, kind, p1, p2, digest, round_, sender, n_tensors, numel, tile, k_full, _) = head
        if kind not in (KIND_SPARSE, KIND_DENSE):
            raise FrameError(f"unknown frame kind {kind}")
        _check_layout(layout, digest, n_tensors, numel)
        body = memoryview(data)[HEADER_BYTES:-_CRC.size]
        if kind == KIND_DENSE:
            frame = _decode_dense(data, body, layout, p1, p2, tile, k_full, round_, sender)
        else:
            frame = _decode_sparse(data, body, layout, p1, p2, tile, k_full, round_, sender, _apply_to)
    except FrameError:
        if crc is not None and not crc.result():
            raise FrameError(_CRC_MISMATCH) from None
        raise
    finally:
        if crc is not None:
            crc.release()
    if crc is not None and not crc.result():
        raise FrameError(_CRC_MISMATCH)
    return frame


_CRC_MISMATCH = "checksum mismatch: frame corrupted"


class _Helper:
    """A pool thread taken at the top of ``decode_apply``: it checks the frame's checksum
    while the caller reads the frame, then waits (spinning outside the GIL, for about a
    millisecond at most) to be handed its share of the checking and adding, so that
    neither its wake-up nor the checksum is on the way. ``result`` is the checksum's
    verdict (computed here if the helper has not got to it)."""

    GO, STOP = 1, 2
    POLLS = 2_000_000

    def __init__(self, data: bytes, n_threads: int) -> None:
        self.data = data
        self.ok: bool | None = None
        self.flag = np.zeros(1, dtype=np.int64)
        self.work = None
        self.running = n_threads > 1
        if self.running:
            submit(self._run, n_threads)

    def _run(self) -> None:
        self.compute()
        if decode_kernel.wait_flag(self.flag, self.POLLS) == self.GO and self.work is not None:
            self.work()

    def compute(self) -> None:
        if self.ok is None:
            self.ok = _crc_matches(self.data)

    def result(self) -> bool:
        self.compute()
        return bool(self.ok)

    def hand(self, work) -> bool:
        """Give the helper work (False when there is no helper thread)."""
        if not self.running:
            return False
        self.work = work
        self.flag[0] = self.GO
        return True

    def release(self) -> None:
        if self.flag[0] == 0:
            self.flag[0] = self.STOP


def _crc_matches(data: bytes) -> bool:
    (crc,) = _CRC.unpack_from(data, len(data) - _CRC.size)
    return zlib.crc32(memoryview(data)[:-_CRC.size]) == crc


def _read_header(data: bytes, check_crc: bool = True) -> tuple:
    if len(data) < HEADER_BYTES + _CRC.size:
        raise FrameError(f"frame truncated: {len(data)} bytes, shorter than the {HEADER_BYTES + _CRC.size}-byte header and checksum")
    head = _HEADER.unpack_from(data)
    magic, version = head[0], head[1]
    if magic != MAGIC:
        raise FrameError(f"bad magic {magic!r}: not a GeoLoCo frame")
    if version != VERSION:
        raise FrameError(f"unsupported frame version {version} (this codec reads version {VERSION})")
    expected = HEADER_BYTES + head[-1] + _CRC.size
    if len(data) < expected:
        raise FrameError(f"frame truncated: {len(data)} bytes, header says {expected}")
    if len(data) > expected:
        raise FrameError(f"{len(data) - expected} trailing bytes after the frame (concatenated or oversized frame)")
    if check_crc and not _crc_matches(data):  # otherwise the caller checks it, then the kind
        raise FrameError(_CRC_MISMATCH)
    return head


def _check_layout(layout: Layout, digest: bytes, n_tensors: int, numel: int) -> None:
    if n_tensors != len(layout.specs) or numel != layout.numel:
        raise FrameError(f"frame is for another layout: {n_tensors} tensors / {numel} elements, "
                         f"this layout has {len(layout.specs)} / {layout.numel}")
    if digest != layout.digest:
        raise FrameError(f"frame is for another layout: digest {digest.hex()} != {layout.digest.hex()} "
                         "(tensor names, shapes or dtypes differ)")


def _read_sections(body: memoryview, expected: list[tuple[str, int, bool]],
                   starts: list[int] | None = None) -> list[bytes | memoryview]:
    """Read sections named in ``expected`` as (name, length, exact); length is a maximum
    unless exact. Raw sections come back as views of body, zstd ones as bytes; where each
    one's stored bytes start in body goes to starts."""
    out, pos = [], 0
    for name, length, exact in expected:
        if len(body) - pos < _SECTION.size:
            raise FrameError(f"{name} section header missing: body ends at byte {pos}")
        codec, raw_len, stored_len = _SECTION.unpack_from(body, pos)
        pos += _SECTION.size
        if codec not in (0, 1):
            raise FrameError(f"{name} section has unknown codec {codec}")
        if (raw_len != length) if exact else (raw_len > length):
            want = f"{length}" if exact else f"at most {length}"
            raise FrameError(f"{name} section claims {raw_len} bytes, the layout allows {want}")
        if stored_len > len(body) - pos:
            raise FrameError(f"{name} section claims {stored_len} stored bytes, only {len(body) - pos} left")
        stored = body[pos:pos + stored_len]
        if starts is not None:
            starts.append(pos)
        pos += stored_len
        if codec == 0:
            if stored_len != raw_len:
                raise FrameError(f"{name} section: raw section stores {stored_len} bytes, not {raw_len}")
            out.append(stored)  # a view of the frame: no copy
        else:
            out.append(_unzstd(name, stored, raw_len))
    if pos != len(body):
        raise FrameError(f"{len(body) - pos} unexpected bytes after the last section")
    return out


def _unzstd(name: str, stored: memoryview, raw_len: int) -> bytes:
    if zstandard is None:
        raise FrameError(f"{name} section is zstd-compressed but the zstandard package is missing")
    try:
        size = zstandard.frame_content_size(bytes(stored[:18]))
        if size != raw_len:
            raise FrameError(f"{name} section: zstd content size {size} != declared {raw_len}")
        raw = zstandard.ZstdDecompressor().decompress(bytes(stored), max_output_size=raw_len)
    except zstandard.ZstdError as exc:
        raise FrameError(f"{name} section: corrupt zstd data ({exc})") from None
    if len(raw) != raw_len:
        raise FrameError(f"{name} section: zstd data decompresses to {len(raw)} bytes, not {raw_len}")
    return raw


def _decode_dense(data, body, layout, p1, p2, tile, k_full, round_, sender) -> Frame:
    if p1 not in _DENSE_DTYPES or p2 or tile or k_full:
        raise FrameError(f"dense frame has invalid parameters (dtype {p1}, {p2}, {tile}, {k_full})")
    tdtype, width, _ = _DENSE_DTYPES[p1]
    (raw,) = _read_sections(body, [("values", layout.numel * width, True)])
    flat = torch.frombuffer(bytearray(raw), dtype=torch.int16 if width == 2 else torch.int32) if raw else \
        torch.empty(0, dtype=torch.int16 if width == 2 else torch.int32)
    flat = flat.view(tdtype).float()
    if not torch.isfinite(flat).all():
        raise FrameError("dense frame contains NaN or Inf values")
    dense, off = [], 0
    for spec in layout.specs:
        dense.append(flat[off:off + spec.numel])
        off += spec.numel
    return Frame("dense", round_, sender, len(data), layout, dense=dense,
                 params={"dtype": _DENSE_DTYPES[p1][2]})


def _decode_sparse(data, body, layout, p1, p2, tile, k_full, round_, sender, apply_to=None) -> Frame:
    if p1 not in (TABLE_PER_TENSOR, TABLE_PER_CHUNK) or p2 not in (INDEX_FIXED, INDEX_RICE):
        raise FrameError(f"sparse frame has unknown table mode {p1} or index coding {p2}")
    if not 1 <= tile <= MAX_TILE:
        raise FrameError(f"tile {tile} outside [1, {MAX_TILE}]")
    if not 1 <= k_full <= tile * tile:
        raise FrameError(f"kept per chunk {k_full} outside [1, {tile * tile}]")
    per_chunk, fixed = p1 == TABLE_PER_CHUNK, p2 == INDEX_FIXED
    geo = _decode_arrays(layout, tile, k_full, per_chunk, fixed)
    grid, kept_off, tab_off, seg_start, n_chunks = geo.grid, geo.kept_off, geo.tab_off, geo.seg_start, geo.n_chunks
    starts: list[int] = []
    table_raw, codes_raw, index_raw, offsets_raw = _read_sections(
        body, [("table", geo.table_bytes, True), ("codes", geo.code_bytes, True), ("index", geo.index_bytes_max, fixed),
               ("index offsets", 4 * len(seg_start), True)], starts)
    offsets = np.empty(len(seg_start) + 1, dtype=np.int64)
    levels = np.empty(len(table_raw) // 2, dtype=np.float32)
    _prepare(np.frombuffer(table_raw, np.uint8), np.frombuffer(offsets_raw, np.uint8), len(index_raw), levels,
             offsets)
    buf = _index_buffer(data, index_raw, HEADER_BYTES + starts[2])
    sparse = SparseBody(buf, len(index_raw), offsets,
                        np.frombuffer(codes_raw, np.uint8), levels, per_chunk, fixed, k_full, tile, grid,
                        n_chunks, tab_off, seg_start, kept_off, geo.index_dtype,
                        np.empty(kept_off[-1], dtype=np.uint16), False)
    if apply_to is None:
        problem = sparse.run(decode_kernel.VALIDATE)
    else:
        addrs, w, a, crc = apply_to
        log = (*_log_buffers(int(kept_off[-1])), np.zeros(len(seg_start), dtype=np.int64))
        applied = seg_start[:, 2].copy()  # nothing applied yet
        problem = sparse.run(decode_kernel.CHECK_APPLY, addrs=addrs, w=w, a=a, log=log, applied=applied,
                             helper=crc)
        if problem is not None or not crc.result():
            sparse.run(decode_kernel.RESTORE, addrs=addrs, w=w, a=a, log=log, applied=applied)
            if problem is None:
                raise FrameError(_CRC_MISMATCH)
    if problem is not None:
        status, t, c, s = problem
        # t is one past the last tensor when the last segment's bytes go on after its last chunk
        name = layout.specs[min(t, len(layout.specs) - 1)].name
        raise FrameError(f"tensor {name!r}: " + _DECODE_ERRORS[status].format(c=c, s=s))
    params = {"tile": tile, "k": k_full, "table": "chunk" if per_chunk else "tensor",
              "index_coding": "fixed" if fixed else "rice"}
    return Frame("sparse", round_, sender, len(data), layout, params=params, body=sparse)


def _index_buffer(data: bytes, index_raw, at: int) -> np.ndarray:
    """The index section as decode_kernel reads it, followed by INDEX_PAD readable bytes
    (its 64-bit loads may reach past the last code; bits past the section are never used
    but to report a problem). A raw section is read in place: the offsets section and
    the checksum follow it in the frame. A decompressed one is copied, zeros after it."""
    n = len(index_raw)
    if isinstance(index_raw, memoryview) and at + n + decode_kernel.INDEX_PAD <= len(data):
        return np.frombuffer(data, np.uint8, count=n + decode_kernel.INDEX_PAD, offset=at)
    buf = np.zeros(n + decode_kernel.INDEX_PAD, dtype=np.uint8)
    buf[:n] = np.frombuffer(index_raw, np.uint8)
    buf.setflags(write=False)  # one array type for the kernels either way
    return buf


_local = threading.local()


def _log_buffers(n: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-thread room for n entries of CHECK_APPLY's log (addresses, old values), kept
    between calls; rarely written, so mostly never touched."""
    bufs = getattr(_local, "log", None)
    if bufs is None or len(bufs[0]) < n:
        bufs = _local.log = (np.empty(max(n, 1024), dtype=np.int64), np.empty(max(n, 1024), dtype=np.float32))
    return bufs[0][:n], bufs[1][:n]


_PREPARE_ERRORS = {
    decode_kernel.OFFSETS_START: "index offsets start at {v}, not 0",
    decode_kernel.OFFSETS_BEYOND: "index offset of segment {s} ({v}) lies beyond the index section ({w} bytes)",
    decode_kernel.OFFSETS_BACK: "index offset of segment {s} ({v}) lies before segment {s1}'s ({w})",
    decode_kernel.LEVELS_BAD: "quantizer table holds a negative, NaN or Inf level",
    decode_kernel.LEVELS_ORDER: "quantizer table has a low level above the high level",
}


def _prepare(table, offsets_raw, index_len: int, levels, offsets) -> None:
    """``decode_kernel.prepare`` (offsets and table checked and converted), its problem
    raised as a FrameError."""
    status, s, v, w = decode_kernel.prepare(table, offsets_raw, index_len, levels, offsets)
    if status != kernels.OK:
        raise FrameError(_PREPARE_ERRORS[status].format(s=s, s1=s - 1, v=v, w=w))
