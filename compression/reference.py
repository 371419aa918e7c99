"""The executable specification of the sparse codec, in plain torch on any device:
SparseLoCo's chunked top-k with error feedback and 2-bit values (Sarfi et al. 2025,
arXiv 2508.15706), coded into the sections of the frame format of docs/codec.md, the
checking decoder of those sections, and the sum or mean over keepers of several frames.

Encoding: the ``k`` largest ``|e|`` of each chunk, equal magnitudes to the lower in-chunk
position; 2-bit codes ``sign x {lo, hi}`` where, with the kept magnitudes sorted in
descending order ``m[0] >= m[1] >= ...`` and ``h = k // 2``, ``hi = m[h // 2]`` and
``lo = m[h + (k - h) // 2]`` (order statistics, so that every implementation agrees bit
for bit), both rounded to bfloat16; a value codes as hi when ``|x| >= fp32(lo + hi) * 0.5``;
then ``e[kept] -= decoded``. Or, with ``bins``, the SparseLoCo reference's 4-bin quantizer
over a tensor's kept values (``bin_quantize``). Only this backend encodes bins frames. Decoding checks every level, offset, code and padding bit,
segment by segment and chunk by chunk, and names the first problem found.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .backend import ApplyInto, Encoded, NotFinite
from .format import (
    BINS_BAD,
    CODE_PADDING,
    INDEX_ORDER,
    INDEX_PADDING,
    INDEX_RANGE,
    INDEX_TRUNCATED,
    LEVELS_BAD,
    LEVELS_ORDER,
    OFFSETS_BACK,
    OFFSETS_BEYOND,
    OFFSETS_START,
    OK,
    SEGMENT_END,
    UNARY_TOO_LONG,
    SparseSections,
    index_error,
    table_error,
)
from .layout import (
    BINS,
    CHUNK,
    FIRST_CODE,
    FIRST_KEPT,
    KEPT,
    NUMEL,
    SEGMENT_CHUNKS,
    TENSOR,
    ChunkGrid,
    FrameGeometry,
    Layout,
    fixed_width,
    kept_per_chunk,
    rice_max_quotient,
    rice_param,
)

# ----------------------------------------------------------------------------- encode


@dataclass
class TensorPayload:
    """One tensor's share of a sparse frame's sections."""

    table: bytes  # bfloat16 bit patterns (hi, lo) per chunk or per tensor, little-endian
    codes: bytes  # 2-bit codes, 4 per byte, each chunk starting on a byte
    index: bytes  # coded in-chunk positions, each chunk starting on a byte
    index_chunk_bytes: np.ndarray  # bytes of each chunk's coded positions


def chunk_matrix(x: torch.Tensor, g: ChunkGrid) -> tuple[torch.Tensor, torch.Tensor]:
    """(full chunks as an (n, size) matrix, the short last chunk as a vector, maybe empty)."""
    t, s = g.tile, g.size
    x2 = x.reshape(g.rows, g.cols)
    parts = []
    if g.n_tiles:
        tiles = x2[: g.row_tiles * t, : g.col_tiles * t].reshape(g.row_tiles, t, g.col_tiles, t)
        parts.append(tiles.permute(0, 2, 1, 3).reshape(-1, s))
    cw = g.col_tiles * t
    left = torch.cat([x2[:, cw:].reshape(-1), x2[g.row_tiles * t:, :cw].reshape(-1)])
    n_full_left = left.numel() // s
    parts.append(left[: n_full_left * s].reshape(-1, s))
    return torch.cat(parts), left[n_full_left * s:]


def select_topk(x: torch.Tensor, k: int) -> torch.Tensor:
    """Boolean mask of the k largest |x| per row; ties go to the lower column."""
    a = x.abs()
    if k >= a.shape[1]:
        return torch.ones_like(a, dtype=torch.bool)
    thr = torch.topk(a, k, dim=1).values[:, -1:]
    gt = a > thr
    eq = a == thr
    need = k - gt.sum(1, keepdim=True)
    return gt | (eq & (torch.cumsum(eq, 1, dtype=torch.int32) <= need))


def levels_from(mags: torch.Tensor) -> torch.Tensor:
    """(rows, 2) bfloat16 (hi, lo) from kept magnitudes (rows, k)."""
    k = mags.shape[1]
    h = k // 2
    srt = torch.sort(mags, dim=1, descending=True).values
    return torch.stack([srt[:, h // 2], srt[:, h + (k - h) // 2]], 1).to(torch.bfloat16)


def quantize(vals: torch.Tensor, levels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """2-bit codes (bit 0: hi level, bit 1: negative) and decoded values for rows of vals."""
    lv = levels.float()
    hi, lo = lv[:, :1], lv[:, 1:]
    mid = (lo + hi) * 0.5
    is_hi = vals.abs() >= mid
    neg = torch.signbit(vals)
    mag = torch.where(is_hi, hi, lo)
    dec = torch.where(neg, -mag, mag)
    return is_hi.to(torch.uint8) | (neg.to(torch.uint8) << 1), dec


BIN_RANGE_SIGMAS = 6.0  # the 4-bin quantizer's range: 6 standard deviations over 4 bins


def bin_quantize(vals: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The SparseLoCo reference's quantizer (templar's ``TopKCompressor._quantize_values``
    with 4 bins): centre the values on their mean, scale = 6 sigma / 4 (sigma: the centred
    values' norm / sqrt(n - 1); 1 where that is 0, NaN or Inf), bin = round(centred /
    scale + 2) clamped to 0..3, each bin's value = the mean of its centred values (0 when
    empty) + the mean. Returns (the 4 bin values, codes, decoded values), all fp32."""
    shift = vals.mean()
    centred = vals - shift
    n = vals.numel()
    std = centred.norm() / math.sqrt(n - 1) if n > 1 else torch.tensor(math.inf, device=vals.device)
    scale = BIN_RANGE_SIGMAS * std / BINS
    if not bool(torch.isfinite(scale)) or float(scale) == 0.0:
        scale = torch.tensor(1.0, device=vals.device)
    q = (centred / scale + BINS // 2).round().clamp(0, BINS - 1).to(torch.int64)
    sums = torch.zeros(BINS, device=vals.device).scatter_add_(0, q, centred)
    counts = torch.zeros(BINS, device=vals.device).scatter_add_(0, q, torch.ones_like(centred))
    table = torch.where(counts > 0, sums / counts, torch.zeros_like(sums)) + shift
    return table, q.to(torch.uint8), table[q]


def encode_tensor(e: torch.Tensor, g: ChunkGrid, k_full: int, per_chunk: bool, fixed: bool,
                  bins: bool = False) -> TensorPayload | None:
    """Select, quantize and code one error-feedback tensor (fp32, flat); subtracts the decoded
    values from ``e`` in place. None (``e`` untouched) when a level rounds to Inf in bfloat16
    (bins: a bin value is not finite)."""
    full, short = chunk_matrix(e, g)
    groups = [(full, kept_per_chunk(g.size, k_full, g.size))]
    if short.numel():
        groups.append((short.view(1, -1), kept_per_chunk(short.numel(), k_full, g.size)))
    sel = [(x, select_topk(x, k)) for x, k in groups if x.shape[0]]
    pos = [m.nonzero()[:, 1].view(x.shape[0], -1) for x, m in sel]
    vals = [x[m].view(x.shape[0], -1) for x, m in sel]
    if bins:
        table, codes_flat, decoded = bin_quantize(torch.cat([v.reshape(-1) for v in vals]))
        if not bool(torch.isfinite(table).all()):
            return None
        return _payload(e, g, full, short, pos, vals, [(codes_flat, decoded)], fixed,
                        table.cpu().numpy().astype("<f4").tobytes())
    if per_chunk:
        levels = [levels_from(v.abs()) for v in vals]
    else:
        flat = torch.cat([v.reshape(-1) for v in vals]).abs().view(1, -1)
        levels = [levels_from(flat).expand(v.shape[0], 2) for v in vals]
    table = torch.cat(levels) if per_chunk else levels[0][:1]
    if torch.isinf(table[:, 0]).any():  # hi >= lo: overflow shows in hi
        return None
    q = [quantize(v, lv) for v, lv in zip(vals, levels, strict=True)]
    return _payload(e, g, full, short, pos, vals, q, fixed, table.contiguous().view(torch.int16).cpu().numpy().tobytes())


def _payload(e, g: ChunkGrid, full, short, pos, vals, q, fixed: bool, table: bytes) -> TensorPayload:
    """e -= decoded at the kept coordinates; the tensor's codes and index sections."""
    chunk_ids = torch.cat([
        torch.arange(p.shape[0], device=e.device).repeat_interleave(p.shape[1]) + off
        for p, off in zip(pos, (0, full.shape[0]), strict=False)
    ])
    flat_idx = g.flat_index(chunk_ids, torch.cat([p.reshape(-1) for p in pos]))
    e[flat_idx] = torch.cat([v.reshape(-1) for v in vals]) - torch.cat([d.reshape(-1) for _, d in q])
    ks = [p.shape[1] for p in pos]
    counts = [p.shape[0] for p in pos]
    codes = _pack_codes(torch.cat([c.reshape(-1) for c, _ in q]), ks, counts)
    sizes = [g.size] * full.shape[0] + ([short.numel()] if short.numel() else [])
    index, chunk_bytes = _pack_index(pos, sizes, fixed)
    return TensorPayload(table, codes, index, chunk_bytes)


def write_fields(nbytes: int, starts: torch.Tensor, values: torch.Tensor, widths: torch.Tensor,
                 max_width: int) -> torch.Tensor:
    """Pack ``values[i]`` (``widths[i]`` bits, LSB first) at bit ``starts[i]`` into a uint8 tensor.

    Fields must not overlap; bits not covered by a field are zero.
    """
    bits = torch.zeros(nbytes * 8, dtype=torch.uint8, device=values.device)
    for t in range(max_width):
        m = widths > t
        bits[starts[m] + t] = ((values[m] >> t) & 1).to(torch.uint8)
    weights = (1 << torch.arange(8, device=values.device, dtype=torch.int32))
    return (bits.view(-1, 8).to(torch.int32) * weights).sum(1).to(torch.uint8)


def segment_exclusive_cumsum(x: torch.Tensor, seg_start: torch.Tensor, seg_len: torch.Tensor) -> torch.Tensor:
    """Exclusive cumulative sum of ``x`` restarting at each segment (segments are contiguous)."""
    c = torch.cumsum(x, 0) - x
    base = torch.repeat_interleave(c[seg_start.clamp(max=max(len(x) - 1, 0))] if len(x) else c, seg_len)
    return c - base


def _kvec(ks: list[int], counts: list[int], device: torch.device) -> torch.Tensor:
    return torch.cat([torch.full((c,), k, dtype=torch.int64, device=device) for k, c in zip(ks, counts, strict=True)])


def _pack_codes(codes: torch.Tensor, ks: list[int], counts: list[int]) -> bytes:
    """Per chunk its k 2-bit codes, code j at bits 2*(j%4) of byte j//4, from a byte."""
    kc = _kvec(ks, counts, codes.device)
    chunk_bytes = (kc + 3) // 4
    chunk_start = torch.cumsum(chunk_bytes, 0) - chunk_bytes
    j = segment_exclusive_cumsum(torch.ones_like(codes, dtype=torch.int64), torch.cumsum(kc, 0) - kc, kc)
    starts = torch.repeat_interleave(chunk_start, kc) * 8 + j * 2
    return write_fields(int(chunk_bytes.sum()), starts, codes.to(torch.int64), torch.full_like(starts, 2),
                        2).cpu().numpy().tobytes()


def _pack_index(pos: list[torch.Tensor], sizes: list[int], fixed: bool) -> tuple[bytes, np.ndarray]:
    """Per chunk its sorted positions, fixed width or as Rice codes of the gaps (``g >> b``
    zeros, a one, the low ``b`` bits of g), from a byte."""
    dev = pos[0].device
    kc = _kvec([p.shape[1] for p in pos], [p.shape[0] for p in pos], dev)
    p = torch.cat([x.reshape(-1) for x in pos])
    seg_start = torch.cumsum(kc, 0) - kc
    if fixed:
        w = torch.tensor([fixed_width(n) for n in sizes], dtype=torch.int64, device=dev)
        wv = torch.repeat_interleave(w, kc)
        chunk_bits = kc * w
        values, widths, maxw = p, wv, int(w.max())
        offsets = segment_exclusive_cumsum(wv, seg_start, kc)
    else:
        b = torch.tensor([rice_param(n, k) for n, k in zip(sizes, kc.tolist(), strict=True)], dtype=torch.int64,
                         device=dev)
        bv = torch.repeat_interleave(b, kc)
        gaps = torch.cat([(x - _previous(x) - 1).reshape(-1) for x in pos])
        q = gaps >> bv
        r = gaps & ((1 << bv) - 1)
        lengths = q + 1 + bv
        chunk_bits = torch.zeros(len(sizes), dtype=torch.int64, device=dev).index_add_(
            0, torch.arange(len(sizes), device=dev).repeat_interleave(kc), lengths)
        # the terminating one after q zeros, then r in b bits: one field (r << 1 | 1) at start + q
        values, widths, maxw = (r << 1) | 1, bv + 1, int(b.max()) + 1
        offsets = segment_exclusive_cumsum(lengths, seg_start, kc) + q
    chunk_bytes = (chunk_bits + 7) // 8
    chunk_start = torch.cumsum(chunk_bytes, 0) - chunk_bytes
    starts = torch.repeat_interleave(chunk_start, kc) * 8 + offsets
    packed = write_fields(int(chunk_bytes.sum()), starts, values, widths, maxw).cpu().numpy().tobytes()
    return packed, chunk_bytes.cpu().numpy()


def _previous(x: torch.Tensor) -> torch.Tensor:
    """Each row's previous position, -1 before the first."""
    return torch.cat([torch.full((x.shape[0], 1), -1, device=x.device, dtype=x.dtype), x[:, :-1]], 1)


class ReferenceEncoder:
    """Encodes in place: on NotFinite the error feedback already updated stays so."""

    in_place = True

    def __init__(self, grids: Sequence[ChunkGrid], k_full: int, per_chunk: bool, fixed: bool,
                 bins: bool = False) -> None:
        self.grids, self.k_full, self.per_chunk, self.fixed = list(grids), k_full, per_chunk, fixed
        self.bins = bins

    def encode(self, errors: list[torch.Tensor], deltas: list[torch.Tensor], beta: float) -> Encoded:
        bad = next((j for j, d in enumerate(deltas) if not bool(torch.isfinite(d).all())), None)
        if bad is not None:
            raise NotFinite(bad, in_delta=True)
        parts = []
        for j, (e, d, g) in enumerate(zip(errors, deltas, self.grids, strict=True)):
            e.mul_(torch.tensor(beta, dtype=torch.float32, device=e.device)).add_(d)
            part = encode_tensor(e, g, self.k_full, self.per_chunk, self.fixed, self.bins) \
                if torch.isfinite(e).all() else None
            if part is None:
                raise NotFinite(j, in_delta=False)
            parts.append(part)
        chunk_bytes = np.concatenate([p.index_chunk_bytes for p in parts]) if parts else np.zeros(0, np.int64)
        return Encoded(errors, b"".join(p.table for p in parts), b"".join(p.codes for p in parts),
                       b"".join(p.index for p in parts), chunk_bytes)


# ----------------------------------------------------------------------------- decode


class ReferenceBody:
    """A checked sparse frame: per tensor, flat indices and values."""

    def __init__(self, indices: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        self.indices, self.values = indices, values
        self.kept = sum(len(i) for i in indices)

    def materialize(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        return self.indices, self.values

    def kept_values(self) -> list[torch.Tensor]:
        return self.values

    def magnitudes(self) -> tuple[float, float]:
        return value_magnitudes(self.values)

    def add_into(self, params: Sequence[torch.Tensor], weight: float, alpha: float) -> bool:
        return False  # apply_frames' own path gives these bits


def value_magnitudes(values: Sequence[torch.Tensor]) -> tuple[float, float]:
    """(L2 norm, largest absolute value) of all the tensors' elements, summed in float64."""
    squares = sum(float(torch.linalg.vector_norm(v, dtype=torch.float64)) ** 2 for v in values)
    largest = max((max(float(v.max()), -float(v.min())) for v in values if v.numel()), default=0.0)
    return squares ** 0.5, largest


def decode_sparse(sections: SparseSections) -> ReferenceBody:
    """Check a sparse frame's table, offsets, index and code sections, then decode them;
    raises the FrameError of the first problem."""
    geo = sections.geometry
    levels, offsets = check_table_and_offsets(sections)
    codes = torch.frombuffer(bytearray(sections.codes), dtype=torch.uint8) if len(sections.codes) else \
        torch.zeros(0, dtype=torch.uint8)
    values, padded = code_values(geo, codes, levels)
    positions = torch.zeros(geo.kept, dtype=torch.int64)
    for s in range(len(geo.seg_start)):
        problem = check_segment(geo, s, bytes(sections.index[offsets[s]:offsets[s + 1]]), padded, positions)
        if problem is not None:
            raise index_error(geo, *problem, s)
    return ReferenceBody(*_per_tensor(geo, positions, values))


def check_table_and_offsets(sections: SparseSections) -> tuple[torch.Tensor, list[int]]:
    """(the table's levels as fp32, the segment offsets followed by the index length), after
    the checks: offsets from 0, inside the index section, never decreasing; then levels
    finite and non-negative, and ``lo <= hi`` in every pair."""
    offsets = np.frombuffer(sections.offsets, dtype="<u4").astype(np.int64).tolist() + [len(sections.index)]
    n_seg = len(offsets) - 1
    if n_seg and offsets[0] != 0:
        raise table_error(OFFSETS_START, 0, offsets[0], 0)
    beyond = [s for s in range(n_seg) if offsets[s] > offsets[-1]]
    if beyond:
        raise table_error(OFFSETS_BEYOND, beyond[0], offsets[beyond[0]], offsets[-1])
    back = [s for s in range(1, n_seg) if offsets[s] < offsets[s - 1]]
    if back:
        raise table_error(OFFSETS_BACK, back[0], offsets[back[0]], offsets[back[0] - 1])
    if sections.geometry.bins:
        bins = torch.frombuffer(bytearray(sections.table), dtype=torch.float32) if len(sections.table) else \
            torch.zeros(0)
        if not bool(torch.isfinite(bins).all()):
            raise table_error(BINS_BAD, 0, 0, 0)
        return bins, offsets
    bits = torch.frombuffer(bytearray(sections.table), dtype=torch.int16).to(torch.int32) & 0xFFFF \
        if len(sections.table) else torch.zeros(0, dtype=torch.int32)
    if (((bits >> 7) & 0xFF) == 0xFF).any() or (bits >> 15).any():  # Inf or NaN, or negative
        raise table_error(LEVELS_BAD, 0, 0, 0)
    levels = (bits << 16).view(torch.float32)
    if (levels[1::2] > levels[0::2]).any():
        raise table_error(LEVELS_ORDER, 0, 0, 0)
    return levels, offsets


def code_values(geo: FrameGeometry, codes: torch.Tensor, levels: torch.Tensor) -> tuple[torch.Tensor, np.ndarray]:
    """(the value of every kept element, from its 2-bit code and its chunk's levels, or its
    tensor's bin values; per chunk whether padding bits after its codes are set)."""
    chunks = torch.from_numpy(geo.chunks.copy())
    kept = chunks[:, KEPT]
    chunk_of = torch.repeat_interleave(torch.arange(len(chunks)), kept)
    j = torch.arange(geo.kept) - chunks[chunk_of, FIRST_KEPT]
    code = (codes[chunks[chunk_of, FIRST_CODE] + j // 4].to(torch.int64) >> (2 * (j % 4))) & 3
    pair = torch.from_numpy(geo.tab_off[:-1].copy())[chunks[:, TENSOR]]
    if geo.bins:
        values = levels[pair[chunk_of] + code]
    else:
        if geo.per_chunk:
            pair = pair + 2 * chunks[:, CHUNK]
        hi, lo = levels[pair[chunk_of]], levels[pair[chunk_of] + 1]
        mag = torch.where((code & 1).bool(), hi, lo)
        values = torch.where((code & 2).bool(), -mag, mag)
    tail = kept % 4 != 0
    last = codes[chunks[tail, FIRST_CODE] + kept[tail] // 4].to(torch.int64)
    padded = torch.zeros(len(chunks), dtype=torch.bool)
    padded[tail] = (last >> (2 * (kept[tail] % 4))) != 0
    return values, padded.numpy()


def check_segment(geo: FrameGeometry, s: int, index: bytes, padded: np.ndarray,
                  positions: torch.Tensor) -> tuple[int, int, int] | None:
    """Decode the positions of segment s's chunks from its index bytes into ``positions``;
    (problem, tensor, chunk) of the first problem, or None. The codes are a bit stream
    (LSB first) whose lengths depend on their bits, so they are read one by one."""
    stream, end, pos = int.from_bytes(index, "little"), 8 * len(index), 0
    for i in range(s * SEGMENT_CHUNKS, min(len(geo.chunks), (s + 1) * SEGMENT_CHUNKS)):
        t, c, n, k, first = (int(x) for x in geo.chunks[i, [TENSOR, CHUNK, NUMEL, KEPT, FIRST_KEPT]])
        read = _fixed_positions if geo.fixed else _rice_positions
        status, pos, found = read(stream, pos, end, n, k)
        if status == OK and pos % 8:  # the bits up to the next byte must be zero
            status = INDEX_PADDING if (stream >> pos) & ((1 << (-pos % 8)) - 1) else OK
            pos += -pos % 8
        if status == OK and padded[i]:
            status = CODE_PADDING
        if status != OK:
            return status, t, c
        positions[first:first + k] = torch.tensor(found, dtype=torch.int64)
    return (SEGMENT_END, 0, 0) if pos != end else None


def _rice_positions(stream: int, pos: int, end: int, n: int, k: int) -> tuple[int, int, list[int]]:
    """(problem, bit position after the codes, positions) of k Rice codes from bit ``pos``.
    Per code: its unary run (the zeros before a one, counted inside the segment only) at
    most rice_max_quotient, then the code inside the segment, then the position inside
    the chunk."""
    b = rice_param(n, k)
    longest = rice_max_quotient(n, b)
    found, prev = [], -1
    for _ in range(k):
        rest = stream >> pos
        zeros = (rest & -rest).bit_length() - 1 if rest else end - pos
        if zeros > longest:
            return UNARY_TOO_LONG, pos, found
        pos += zeros + 1 + b
        if not rest or pos > end:
            return INDEX_TRUNCATED, pos, found
        p = prev + 1 + (zeros << b) + ((stream >> (pos - b)) & ((1 << b) - 1))
        if p >= n:
            return INDEX_RANGE, pos, found
        found.append(p)
        prev = p
    return OK, pos, found


def _fixed_positions(stream: int, pos: int, end: int, n: int, k: int) -> tuple[int, int, list[int]]:
    """Like _rice_positions for fixed-width positions: each inside the segment, inside the
    chunk, and above the previous one."""
    w = fixed_width(n)
    found, prev = [], -1
    for _ in range(k):
        p = (stream >> pos) & ((1 << w) - 1)
        pos += w
        if pos > end:
            return INDEX_TRUNCATED, pos, found
        if p >= n:
            return INDEX_RANGE, pos, found
        if p <= prev:
            return INDEX_ORDER, pos, found
        found.append(p)
        prev = p
    return OK, pos, found


def _per_tensor(geo: FrameGeometry, positions: torch.Tensor, values: torch.Tensor):
    """Per tensor, the flat indices of the kept elements and their values."""
    chunks = torch.from_numpy(geo.chunks.copy())
    chunk = torch.repeat_interleave(chunks[:, CHUNK], chunks[:, KEPT])
    indices, vals = [], []
    for t, g in enumerate(geo.grids):
        a, b = int(geo.kept_off[t]), int(geo.kept_off[t + 1])
        indices.append(g.flat_index(chunk[a:b], positions[a:b]))
        vals.append(values[a:b])
    return indices, vals


# ----------------------------------------------------------------------------- apply


def add_frames(layout: Layout, params: Sequence[torch.Tensor], bodies: Sequence, weights: Sequence[float],
               mode: str, alpha: float) -> None:
    """``params[j] += alpha * U[j]`` for checked sparse frames (any backend's bodies), params
    of any float dtype on any device: with one frame ``U = fp32(w * v)``; with several,
    per coordinate ``U = ((0 + fp32(w_0 v_0)) + fp32(w_1 v_1)) + ...`` over the frames that
    kept it, in frame order, and for ``mean_kept`` then ``U / count`` in fp32; each
    coordinate updated once, ``p = cast(fp32(p) + fp32(U * fp32(alpha)))``."""
    decoded = [b.materialize() for b in bodies]
    for j, (spec, p) in enumerate(zip(layout.specs, params, strict=True)):
        if spec.numel == 0:
            continue
        with torch.no_grad():
            idx, u = _sparse_update(decoded, weights, j, mode, p.device, spec.numel)
            step = u * _f32(alpha, p.device)
            if not p.is_contiguous():  # update a flat copy, write it back
                tmp = p.reshape(-1).clone()
                tmp[idx] = (tmp[idx].float() + step).to(p.dtype)
                p.copy_(tmp.view(spec.shape))
            elif p.dtype == torch.float32:
                p.data.view(-1).index_add_(0, idx, step)  # indices unique: one addition each
            else:
                flat = p.data.view(-1)
                flat[idx] = (flat[idx].float() + step).to(p.dtype)


def _f32(x: float, device) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float32, device=device)


def _sparse_update(decoded, weights, j: int, mode: str, device, numel: int):
    """(indices, U values) of tensor j over the union of kept coordinates, each once (in
    the order frames first keep them); decoded: per frame, (indices, values) per tensor.
    Several frames are gathered in zeroed scratch tensors of the tensor's size, kept from
    call to call and zeroed again where they were used: the cost is proportional to the
    kept elements."""
    idx = [ind[j].to(device) for ind, _ in decoded]
    vals = [val[j].to(device) * _f32(w, device) for (_, val), w in zip(decoded, weights, strict=True)]
    if len(decoded) == 1:
        return idx[0], vals[0]
    u, cnt = _scratch(numel, device)
    firsts = []
    for i, v in zip(idx, vals, strict=True):
        firsts.append(i[cnt[i] == 0])  # coordinates no earlier frame kept
        u.index_add_(0, i, v)  # indices unique within a frame: deterministic
        cnt.index_add_(0, i, torch.ones_like(v))
    kept = torch.cat(firsts)
    out = u[kept] / cnt[kept] if mode == "mean_kept" else u[kept]
    u[kept] = 0.0
    cnt[kept] = 0.0
    return kept, out


_SCRATCH = threading.local()


def _scratch(numel: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Two zeroed fp32 tensors of ``numel`` elements on ``device``, this thread's own (the
    caller zeroes what it used before it returns)."""
    held = getattr(_SCRATCH, "buffers", None)
    if held is None:
        held = _SCRATCH.buffers = {}
    key = torch.device(device)
    if key not in held or held[key][0].numel() < numel:
        held[key] = (torch.zeros(numel, dtype=torch.float32, device=key),
                     torch.zeros(numel, dtype=torch.float32, device=key))
    u, cnt = held[key]
    return u[:numel], cnt[:numel]


# ----------------------------------------------------------------------------- backend


class ReferenceBackend:
    """The reference as a codec backend: any device, in place, decoding then applying."""

    name = "reference"

    def encodes(self, device: torch.device) -> bool:
        return True

    def encoder(self, grids: Sequence[ChunkGrid], k_full: int, per_chunk: bool, fixed: bool,
                bins: bool = False) -> ReferenceEncoder:
        return ReferenceEncoder(grids, k_full, per_chunk, fixed, bins)

    def decode(self, sections: SparseSections, into: ApplyInto | None = None,
               keep_positions: bool = False) -> ReferenceBody:
        return decode_sparse(sections)  # into is only ever this backend's start_apply's: None; indices kept

    def start_apply(self, data: bytes, layout: Layout, params: Sequence[torch.Tensor], weight: float,
                    alpha: float) -> None:
        return None

    def add_frames(self, layout: Layout, params: Sequence[torch.Tensor], bodies: Sequence,
                   weights: Sequence[float], mode: str, alpha: float, on_final=None) -> bool:
        add_frames(layout, params, bodies, weights, mode, alpha)
        return True

    def add_at(self, updates: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> None:
        for p, idx, step in updates:
            p.view(-1).index_add_(0, idx, step)
