"""The segment decoder of sparse frames (numba): checks a frame's index and code sections
(docs/codec.md, "Validation"), and decodes them into indices and values or adds them
straight into parameters, one segment of chunks at a time so that threads can share a
frame.

A segment is ``SEGMENT_CHUNKS`` consecutive chunks in frame order (tensor by tensor); the
frame's offsets section says where each segment's index bytes start. Indices are read 64
bits at a time: an unaligned load, a trailing-zero count for the unary part of a Rice
code, a shift and a mask for its remainder. Every count, position, padding bit and
segment end is checked; the first violation is reported as one of ``format``'s problem
codes, the same one the reference decoder reports.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import njit

from ..format import (
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
)
from ..layout import (
    SEGMENT_CHUNKS,
    chunk_count,
    chunk_numel,
    code_bytes,
    fixed_width,
    flat_index,
    in_tile,
    kept_per_chunk,
    rice_max_quotient,
    rice_param,
    tile_origin,
    tile_shift,
)
from .intrinsics import (
    add_f32_at,
    ctz,
    f32_bits,
    fetch_add,
    load_acquire,
    load_u64,
    prefetch_f32_at,
    store_f32_at,
)

INDEX_PAD = 16       # readable bytes after the index section, so 64-bit loads stay inside
WINDOW = 56          # bits a load at any bit offset is sure to hold (64 - 7, rounded down)

VALIDATE, MATERIALIZE, APPLY, CHECK_APPLY, RESTORE, CHECK, VALUES, POSITIONS = range(8)  # what the kernels do


class FrameArrays(NamedTuple):
    """A sparse frame as the kernels read it: its sections (table and offsets checked and
    converted by ``prepare``) and its layout's geometry (``layout.FrameGeometry``).

    Like ApplyArrays, it goes into a kernel as a plain tuple (``tuple(fa)``) that the
    kernel turns back into the record: numba takes plain tuples about twice as fast as
    NamedTuples (see ``encode_kernels.EncodePlan``)."""

    buf: np.ndarray        # the index section, then INDEX_PAD readable bytes
    index_len: int
    offsets: np.ndarray    # where each segment starts in the index section, then index_len
    codes: np.ndarray
    levels: np.ndarray     # fp32 (hi, lo) pairs
    per_chunk: bool
    fixed: bool
    k_full: int
    tile: int
    grid: np.ndarray       # per tensor: rows, cols, row_tiles, col_tiles
    n_chunks: np.ndarray   # per tensor
    tab_off: np.ndarray    # first level pair of each tensor
    seg_start: np.ndarray  # per segment: tensor, chunk, first kept element, first code byte, full-size chunks
    positions: np.ndarray  # in-chunk position of every kept element (uint16), kept by VALIDATE
                           # at seg_start[s, 2] + j: a slab's (``decoder.add_frames``) starts at 0


class ApplyArrays(NamedTuple):
    """Where APPLY, CHECK_APPLY and RESTORE add ``p = p + a * (w * v)``, and what CHECK_APPLY
    keeps so that RESTORE can undo it."""

    addrs: np.ndarray      # per tensor, the address of its fp32 parameter data
    w: np.float32
    a: np.float32
    log_addr: np.ndarray   # address and old value of each update that does not subtract back
    log_val: np.ndarray    # exactly (segment s's n_log[s] entries from seg_start[s, 2])
    n_log: np.ndarray
    applied: np.ndarray    # per segment, how far it got (kept elements, from seg_start[s, 2])


@njit(cache=True, nogil=True)
def _read_bits(buf, pos):
    """The 64 bits starting at bit ``pos`` of buf, of which the low WINDOW are valid."""
    return load_u64(buf, pos >> 3) >> np.uint64(pos & 7)


@njit(cache=True, nogil=True)
def _rice_chunk(buf, pos, limit, n, k, out, o):
    """Decode k Rice-coded positions of an n-element chunk from bit pos into out[o:o+k].
    Returns (status, bit position after the last code). Which problem a bad code names
    does not depend on the bits past the segment (``limit``), nor on the load width."""
    b = rice_param(n, k)
    longest = rice_max_quotient(n, b)
    rmask = np.uint64((1 << b) - 1)
    wmask = np.uint64((1 << WINDOW) - 1)
    prev = -1
    for j in range(k):
        start = pos
        w = _read_bits(buf, pos) & wmask
        q = 0
        while w == 0:  # a unary run longer than the window: rare, only in very sparse chunks
            q += WINDOW
            pos += WINDOW
            if q > longest or pos > limit:
                return _rice_problem(q, start, pos, limit, longest), pos
            w = _read_bits(buf, pos) & wmask
        z = np.int64(ctz(w))
        q += z
        pos += z + 1
        r = np.int64((_read_bits(buf, pos) if z + 1 + b > WINDOW else w >> np.uint64(z + 1)) & rmask)
        pos += b
        p = prev + 1 + (q << b) + r
        if p >= n or pos > limit:
            return _rice_problem(q, start, pos, limit, longest), pos
        out[o + j] = p
        prev = p
    return OK, pos


@njit(cache=True, nogil=True)
def _rice_problem(q, start, pos, limit, longest):
    """A bad Rice code from bit start, with at least q zeros before its one (all of them
    when the one is found) and ending at pos or later: a unary run too long (counting the
    zeros inside the segment only), or else the code running past the segment, or else a
    position outside the chunk."""
    if min(q, limit - start) > longest:
        return UNARY_TOO_LONG
    if pos > limit:
        return INDEX_TRUNCATED
    return INDEX_RANGE


@njit(cache=True, nogil=True)
def _fixed_chunk(buf, pos, limit, n, k, out, o):
    """Decode k fixed-width positions (strictly increasing) of an n-element chunk."""
    w = fixed_width(n)
    mask = np.uint64((1 << w) - 1)
    prev = -1
    for j in range(k):
        p = np.int64(_read_bits(buf, pos) & mask)
        pos += w
        if pos > limit:
            return INDEX_TRUNCATED, pos
        if p >= n:
            return INDEX_RANGE, pos
        if p <= prev:
            return INDEX_ORDER, pos
        out[o + j] = p
        prev = p
    return OK, pos


@njit(cache=True, nogil=True)
def _chunk_values(codes, cpos, k, hi, lo, lv, out_val, o):
    """fp32 values of a chunk's k 2-bit codes (bit 0: high level, bit 1: negative), by
    table lookup (lv: scratch of 4); False when the padding bits are not zero."""
    lv[0] = lo
    lv[1] = hi
    lv[2] = -lo
    lv[3] = -hi
    for j in range(k):
        out_val[o + j] = lv[(np.int64(codes[cpos + (j >> 2)]) >> (2 * (j & 3))) & 3]
    return not (k % 4 and codes[cpos + k // 4] >> np.uint8(2 * (k % 4)))


@njit(cache=True, nogil=True)
def _to_flat(c, out_flat, o, k, rows, cols, tile, sh, row_tiles, col_tiles):
    """In-chunk positions out_flat[o:o+k] of chunk c -> flat indices in its tensor
    (sh = tile_shift(tile))."""
    if c < row_tiles * col_tiles and sh >= 0:
        base = tile_origin(c, cols, tile, col_tiles)
        for j in range(o, o + k):
            out_flat[j] = in_tile(base, cols, tile, sh, out_flat[j])
    else:
        for j in range(o, o + k):
            out_flat[j] = flat_index(c, out_flat[j], rows, cols, tile, row_tiles, col_tiles)


@njit(cache=True, nogil=True)
def _add_undoable(base, pos, val, k, w, a, log_addr, log_val, at):
    """p[pos[j]] += d_j = a * (w * val[j]) for the fp32 array at address base. Where
    subtracting d_j again would not give the old bits back (rounding lost some of them),
    the old value and its address go to the log at log_addr/log_val[at:]: then every
    element can be put back exactly. Returns where the next entry goes. (_segment_rest
    has the same few lines inline: a call per element there costs 40 %.)"""
    for j in range(k):
        d = a * (w * val[j])
        old = add_f32_at(base, pos[j], d)
        if f32_bits((old + d) - d) != f32_bits(old):  # rare: no store in the common case
            log_addr[at] = base + 4 * pos[j]
            log_val[at] = old
            at += 1
    return at


@njit(cache=True, nogil=True)
def decode_segments(mode, frame, s0, s1, out_flat, out_val, into, result):
    """Decode segments [s0, s1) of a sparse frame (FrameArrays), and per ``mode``:

    - VALIDATE: check everything, and keep each kept element's in-chunk position in
      ``positions`` (uint16), so that the other modes need not decode the indices again;
    - CHECK: check everything like VALIDATE, keeping nothing (what a frame holds until it
      is applied is its bytes);
    - POSITIONS: VALIDATE of a checked frame, without the values (their codes were checked);
    - MATERIALIZE: write flat indices (per tensor; out_flat is int32 or int64) and values;
    - VALUES: write the values alone, from the codes and the table (no positions needed);
    - APPLY: ``p_t[i] = p_t[i] + a * (w * v)`` in fp32 for every kept (i, v) of tensor t,
      whose fp32 data starts at address addrs[t] (``into``: ApplyArrays; the frame must
      have been validated).
      A chunk's cache lines are asked for before any of them is written, so the misses
      overlap;
    - CHECK_APPLY: check like VALIDATE (without keeping the positions), and APPLY each
      chunk as soon as it checks out (its lines asked for one chunk ahead), keeping how
      far segment s got in ``applied[s]`` (kept elements, from seg_start[s, 2]) and, for
      the elements whose update cannot be subtracted back exactly, their address and old
      value in log_addr/log_val (segment s's n_log[s] entries from seg_start[s, 2]);
    - RESTORE: after a CHECK_APPLY that found a problem, subtract every update below
      ``applied[s]`` again, then put the logged values back: the parameters are bit for
      bit as before.

    result = (status, tensor, chunk, segment) of the first problem, status OK when there
    is none.
    """
    fa, ap = FrameArrays(*frame), ApplyArrays(*into)
    buf, offsets, codes, levels, per_chunk, fixed, k_full, tile, grid, tab_off, seg_start, positions = (
        fa.buf, fa.offsets, fa.codes, fa.levels, fa.per_chunk, fa.fixed, fa.k_full, fa.tile, fa.grid, fa.tab_off,
        fa.seg_start, fa.positions)
    addrs, w, a, log_addr, log_val, n_log, applied = ap.addrs, ap.w, ap.a, ap.log_addr, ap.log_val, ap.n_log, ap.applied
    size = tile * tile
    limit = fa.index_len * 8
    lv = np.empty(4, dtype=np.float32)
    scratch_pos = np.empty(size, dtype=np.int64)
    scratch_val = np.empty(size, dtype=np.float32)
    pend_pos = np.empty(size, dtype=np.int64)  # CHECK_APPLY: the chunk whose lines are on their way
    pend_val = np.empty(size, dtype=np.float32)
    pend_k = pend_base = 0
    sh = tile_shift(tile)
    for s in range(s0, s1):
        t, c, o, cpos = seg_start[s, 0], seg_start[s, 1], seg_start[s, 2], seg_start[s, 3]
        pos = offsets[s] * 8
        end = offsets[s + 1] * 8
        done = 0
        while done < SEGMENT_CHUNKS and t < grid.shape[0]:
            rows, cols, row_tiles, col_tiles = grid[t, 0], grid[t, 1], grid[t, 2], grid[t, 3]
            if c >= chunk_count(rows, cols, tile, row_tiles, col_tiles):
                t += 1
                c = 0
                continue
            n = chunk_numel(c, rows, cols, tile, row_tiles, col_tiles)
            k = kept_per_chunk(n, k_full, size)
            if mode == RESTORE and o + k > applied[s]:
                break
            if mode == VALUES:  # checked: a value is its code's level, wherever it sits
                ti = tab_off[t] + (2 * c if per_chunk else 0)
                _chunk_values(codes, cpos, k, levels[ti], levels[ti + 1], lv, out_val, o)
                o += k
                cpos += code_bytes(k)
                c += 1
                done += 1
                continue
            if mode in (MATERIALIZE, APPLY):  # validated: the positions are known
                for j in range(k):
                    scratch_pos[j] = positions[o + j]
                ti = tab_off[t] + (2 * c if per_chunk else 0)
                _chunk_values(codes, cpos, k, levels[ti], levels[ti + 1], lv, scratch_val, 0)
                _to_flat(c, scratch_pos, 0, k, rows, cols, tile, sh, row_tiles, col_tiles)
                if mode == MATERIALIZE:
                    for j in range(k):
                        out_flat[o + j] = scratch_pos[j]
                        out_val[o + j] = scratch_val[j]
                else:  # APPLY
                    base = addrs[t]
                    for j in range(k):
                        prefetch_f32_at(base, scratch_pos[j])
                    for j in range(k):
                        add_f32_at(base, scratch_pos[j], a * (w * scratch_val[j]))
                o += k
                cpos += code_bytes(k)
                c += 1
                done += 1
                continue
            if fixed:
                status, pos = _fixed_chunk(buf, pos, end, n, k, scratch_pos, 0)
            else:
                status, pos = _rice_chunk(buf, pos, end, n, k, scratch_pos, 0)
            if status == OK and pos & 7:  # the bits up to the next byte must be zero
                if _read_bits(buf, pos) & np.uint64((1 << (8 - (pos & 7))) - 1):
                    status = INDEX_PADDING
                pos = (pos + 7) & ~7
            if status == OK and pos > limit:
                status = INDEX_TRUNCATED
            ti = tab_off[t] + (2 * c if per_chunk else 0)
            if status == OK and mode != POSITIONS and not _chunk_values(codes, cpos, k, levels[ti], levels[ti + 1],
                                                                        lv, scratch_val, 0):
                status = CODE_PADDING
            if status != OK:
                result[0], result[1], result[2], result[3] = status, t, c, s
                return
            if mode in (VALIDATE, POSITIONS):
                for j in range(k):
                    positions[o + j] = scratch_pos[j]
            elif mode == CHECK_APPLY:  # ask for this chunk's lines, add in the previous chunk's
                _to_flat(c, scratch_pos, 0, k, rows, cols, tile, sh, row_tiles, col_tiles)
                for j in range(k):
                    prefetch_f32_at(addrs[t], scratch_pos[j])
                n_log[s] = _add_undoable(pend_base, pend_pos, pend_val, pend_k, w, a, log_addr, log_val,
                                         seg_start[s, 2] + n_log[s]) - seg_start[s, 2]
                applied[s] = o
                scratch_pos, pend_pos = pend_pos, scratch_pos
                scratch_val, pend_val = pend_val, scratch_val
                pend_k, pend_base = k, addrs[t]
            elif mode == RESTORE:  # subtract this chunk's update again
                _to_flat(c, scratch_pos, 0, k, rows, cols, tile, sh, row_tiles, col_tiles)
                for j in range(k):
                    add_f32_at(addrs[t], scratch_pos[j], -(a * (w * scratch_val[j])))
            o += k
            cpos += code_bytes(k)
            c += 1
            done += 1
        if mode == CHECK_APPLY:  # the segment's last chunk
            n_log[s] = _add_undoable(pend_base, pend_pos, pend_val, pend_k, w, a, log_addr, log_val,
                                     seg_start[s, 2] + n_log[s]) - seg_start[s, 2]
            applied[s] = o
            pend_k = 0
        if mode == RESTORE:  # the values subtraction could not give back
            for i in range(seg_start[s, 2], seg_start[s, 2] + n_log[s]):
                store_f32_at(log_addr[i], 0, log_val[i])
            continue
        if mode in (VALIDATE, CHECK, POSITIONS, CHECK_APPLY) and pos != end:
            result[0], result[1], result[2], result[3] = SEGMENT_END, t, c, s
            return
    result[0] = OK


@njit(cache=True, nogil=True)
def code_magnitudes(frame, out):
    """out = (sum of the squared values, largest absolute value) of a checked frame's kept
    elements, in float64, from its codes and levels alone: a chunk's values are its two
    levels with signs, so the sum is n_hi hi^2 + (k - n_hi) lo^2 (levels are non-negative,
    the high one first). No position is decoded; one pass over the codes section."""
    fa = FrameArrays(*frame)
    codes, levels, per_chunk, k_full, tile, grid, tab_off = (
        fa.codes, fa.levels, fa.per_chunk, fa.k_full, fa.tile, fa.grid, fa.tab_off)
    size = tile * tile
    squares = 0.0
    largest = 0.0
    cpos = 0
    for t in range(grid.shape[0]):
        rows, cols, row_tiles, col_tiles = grid[t, 0], grid[t, 1], grid[t, 2], grid[t, 3]
        for c in range(chunk_count(rows, cols, tile, row_tiles, col_tiles)):
            k = kept_per_chunk(chunk_numel(c, rows, cols, tile, row_tiles, col_tiles), k_full, size)
            ti = tab_off[t] + (2 * c if per_chunk else 0)
            n_hi = 0
            for j in range(k):  # bit 0 of a code: the high level
                n_hi += (np.int64(codes[cpos + (j >> 2)]) >> (2 * (j & 3))) & 1
            hi, lo = np.float64(levels[ti]), np.float64(levels[ti + 1])
            squares += n_hi * (hi * hi) + (k - n_hi) * (lo * lo)
            if n_hi and hi > largest:
                largest = hi
            if k - n_hi and lo > largest:
                largest = lo
            cpos += code_bytes(k)
    out[0] = squares
    out[1] = largest


@njit(cache=True, nogil=True)
def _rice_pair(buf, pa, ea, pb, eb, n, k, b, out_a, out_b, o):
    """The Rice codes of two chunks (one in each of two segments) side by side: two
    independent chains of dependent shifts, which the CPU runs at once. Only the common
    case: (True, bit positions after each) when every code of both fits in one 64-bit
    load and lies inside its chunk and segment; else (False, ...) and the caller decodes
    them one by one. Positions go to out_a/out_b[o:o+k]."""
    rmask = np.uint64((1 << b) - 1)
    wmask = np.uint64((1 << WINDOW) - 1)
    stop = np.uint64(1) << np.uint64(WINDOW)  # a sentinel: ctz is WINDOW when no 1 is in the window
    prev_a = prev_b = -1
    bad = False
    for j in range(k):
        wa = _read_bits(buf, pa) & wmask
        wb = _read_bits(buf, pb) & wmask
        za = np.int64(ctz(wa | stop))
        zb = np.int64(ctz(wb | stop))
        xa = prev_a + 1 + (za << b) + np.int64((wa >> np.uint64(za + 1)) & rmask)
        xb = prev_b + 1 + (zb << b) + np.int64((wb >> np.uint64(zb + 1)) & rmask)
        pa += za + 1 + b
        pb += zb + 1 + b
        bad |= (za + 1 + b > WINDOW) | (zb + 1 + b > WINDOW) | (xa >= n) | (xb >= n) | (pa > ea) | (pb > eb)
        out_a[o + j] = xa
        out_b[o + j] = xb
        prev_a = xa
        prev_b = xb
    return not bad, pa, pb


@njit(cache=True, nogil=True)
def _index_tail(status, buf, pos, limit):
    """After a chunk's index codes: zero bits up to the next byte, still inside the index
    section. Returns (status, bit position of the next chunk)."""
    if status == OK and pos & 7:
        if _read_bits(buf, pos) & np.uint64((1 << (8 - (pos & 7))) - 1):
            status = INDEX_PADDING
        pos = (pos + 7) & ~7
    if status == OK and pos > limit:
        status = INDEX_TRUNCATED
    return status, pos


@njit(cache=True, nogil=True)
def _decode_run(buf, pos, end, limit, n, k, b, fixed, count, out, o):
    """Decode the indices of count consecutive chunks (n elements, k kept each) into
    out[o:o + count*k]. Returns (status, chunks decoded without a problem, bit position)."""
    for i in range(count):
        if fixed:
            status, pos = _fixed_chunk(buf, pos, end, n, k, out, o + i * k)
        else:
            status, pos = _rice_chunk(buf, pos, end, n, k, out, o + i * k)
        status, pos = _index_tail(status, buf, pos, limit)
        if status != OK:
            return status, i, pos
    return OK, count, pos


@njit(cache=True, nogil=True)
def _decode_pair(buf, pa, ea, pb, eb, limit, n, k, b, out_a, out_b):
    """_decode_run over two segments of SEGMENT_CHUNKS full chunks at once, chunk by chunk
    with _rice_pair; from the first chunk that is not the common case on, one by one.
    Returns (status, chunks done, position) for each."""
    for i in range(SEGMENT_CHUNKS):
        ok, na, nb = _rice_pair(buf, pa, ea, pb, eb, n, k, b, out_a, out_b, i * k)
        if ok:
            sa, na = _index_tail(OK, buf, na, limit)
            sb, nb = _index_tail(OK, buf, nb, limit)
            if sa == OK and sb == OK:
                pa, pb = na, nb
                continue
        sa, da, pa = _decode_run(buf, pa, ea, limit, n, k, b, False, SEGMENT_CHUNKS - i, out_a, i * k)
        sb, db, pb = _decode_run(buf, pb, eb, limit, n, k, b, False, SEGMENT_CHUNKS - i, out_b, i * k)
        return sa, i + da, pa, sb, i + db, pb
    return OK, SEGMENT_CHUNKS, pa, OK, SEGMENT_CHUNKS, pb


PREFETCH_AHEAD = 48  # kept elements between asking for a parameter's cache line and adding to it


class SegmentWork(NamedTuple):
    """A thread's room for two segments of SEGMENT_CHUNKS full chunks (``check_segments``)."""

    dec_a: np.ndarray    # decoded in-chunk positions of the first segment ...
    dec_b: np.ndarray    # ... and of the second
    where: np.ndarray    # CHECK_APPLY: the parameter address of each kept element
    vals: np.ndarray     # the values of the kept elements
    lv: np.ndarray       # the four values of a chunk's 2-bit codes


@njit(cache=True, nogil=True)
def _segment_rest(mode, fa, ap, work, s, outcome, end, dec, k, sh, problems):
    """What follows the index decoding of segment s, of SEGMENT_CHUNKS full chunks: chunk by
    chunk the 2-bit code padding and values, VALIDATE keeping the positions; then
    CHECK_APPLY adds the chunks that checked out in, element by element, asking for each
    parameter's cache line PREFETCH_AHEAD elements ahead. The segment's problem, in the
    order the checks come one chunk after the other, goes to problems[s]. dec: the
    decoded positions, k per chunk; outcome: how decoding went (status, chunks decoded,
    bit position after them)."""
    status, done, pos = outcome
    codes, levels, per_chunk, tile, grid, n_chunks, tab_off, seg_start, positions = (
        fa.codes, fa.levels, fa.per_chunk, fa.tile, fa.grid, fa.n_chunks, fa.tab_off, fa.seg_start, fa.positions)
    where, vals, lv = work.where, work.vals, work.lv
    t, c, o, cpos = seg_start[s, 0], seg_start[s, 1], seg_start[s, 2], seg_start[s, 3]
    for i in range(done + (status != OK)):
        while c >= n_chunks[t]:  # the next tensor's chunks (empty ones have none)
            t += 1
            c = 0
        if i == done:  # the chunk whose indices failed
            break
        ti = tab_off[t] + (2 * c if per_chunk else 0)
        if mode != POSITIONS and not _chunk_values(codes, cpos, k, levels[ti], levels[ti + 1], lv, vals, i * k):
            status = CODE_PADDING
            break
        if mode in (VALIDATE, POSITIONS):
            for j in range(k):
                positions[o + j] = dec[i * k + j]
        elif mode == CHECK_APPLY:  # the parameter's address of each kept element
            for j in range(k):
                where[i * k + j] = dec[i * k + j]
            _to_flat(c, where, i * k, k, grid[t, 0], grid[t, 1], tile, sh, grid[t, 2], grid[t, 3])
            for j in range(i * k, i * k + k):
                where[j] = ap.addrs[t] + 4 * where[j]
        o += k
        cpos += code_bytes(k)
        c += 1
    if mode == CHECK_APPLY:
        w, a, log_addr, log_val = ap.w, ap.a, ap.log_addr, ap.log_val
        m = o - seg_start[s, 2]  # the elements that checked out
        for j in range(min(m, PREFETCH_AHEAD)):
            prefetch_f32_at(where[j], 0)
        at = seg_start[s, 2] + ap.n_log[s]
        for j in range(m):
            if j + PREFETCH_AHEAD < m:
                prefetch_f32_at(where[j + PREFETCH_AHEAD], 0)
            d = a * (w * vals[j])
            old = add_f32_at(where[j], 0, d)
            if f32_bits((old + d) - d) != f32_bits(old):  # rare: see _add_undoable
                log_addr[at] = where[j]
                log_val[at] = old
                at += 1
        ap.n_log[s] = at - seg_start[s, 2]
        ap.applied[s] = o
    if status == OK and pos != end:
        status = SEGMENT_END
    if status != OK:
        problems[s, 0], problems[s, 1], problems[s, 2], problems[s, 3] = status, t, c, s


@njit(cache=True, nogil=True)
def check_segments(mode, frame, shared, wait, into, problems):
    """VALIDATE, CHECK or CHECK_APPLY (see ``decode_segments``) over the segments of a frame
    from shared[0] on, on as many threads as call it: each takes the next two segments from
    shared[0] until none are left, counting itself in shared[1] while it works; the call with wait set returns
    only when no thread is at work any more (spinning, not sleeping: a thread that joins
    late finds nothing left and is never waited for). Two segments of SEGMENT_CHUNKS full
    chunks (the usual case) have their indices decoded side by side first
    (_decode_pair), then the rest chunk by chunk; others go through ``decode_segments``.
    problems[s] = (status, tensor, chunk, s) of segment s's first problem, status OK
    when it has none."""
    fa, ap = FrameArrays(*frame), ApplyArrays(*into)
    buf, offsets, fixed, tile, seg_start = fa.buf, fa.offsets, fa.fixed, fa.tile, fa.seg_start
    n_seg = seg_start.shape[0]
    size = tile * tile
    k = kept_per_chunk(size, fa.k_full, size)
    b = rice_param(size, k)
    limit = fa.index_len * 8
    work = SegmentWork(np.empty(SEGMENT_CHUNKS * k, dtype=np.int64), np.empty(SEGMENT_CHUNKS * k, dtype=np.int64),
                       np.empty(SEGMENT_CHUNKS * k, dtype=np.int64), np.empty(SEGMENT_CHUNKS * k, dtype=np.float32),
                       np.empty(4, dtype=np.float32))
    no_flat = np.empty(0, dtype=np.int64)
    no_val = np.empty(0, dtype=np.float32)
    sh = tile_shift(tile)
    while True:
        fetch_add(shared, 1, 1)
        s = fetch_add(shared, 0, 2)
        if s >= n_seg:
            fetch_add(shared, 1, -1)
            break
        pair = s + 1 < n_seg and seg_start[s, 4] == SEGMENT_CHUNKS and seg_start[s + 1, 4] == SEGMENT_CHUNKS
        if pair:
            e_a, e_b = offsets[s + 1] * 8, offsets[s + 2] * 8
            if fixed:
                st_a, d_a, p_a = _decode_run(buf, offsets[s] * 8, e_a, limit, size, k, b, True, SEGMENT_CHUNKS,
                                             work.dec_a, 0)
                st_b, d_b, p_b = _decode_run(buf, offsets[s + 1] * 8, e_b, limit, size, k, b, True, SEGMENT_CHUNKS,
                                             work.dec_b, 0)
            else:
                st_a, d_a, p_a, st_b, d_b, p_b = _decode_pair(buf, offsets[s] * 8, e_a, offsets[s + 1] * 8, e_b, limit,
                                                              size, k, b, work.dec_a, work.dec_b)
            _segment_rest(mode, fa, ap, work, s, (st_a, d_a, p_a), e_a, work.dec_a, k, sh, problems)
            _segment_rest(mode, fa, ap, work, s + 1, (st_b, d_b, p_b), e_b, work.dec_b, k, sh, problems)
        else:
            for q in range(s, min(s + 2, n_seg)):
                decode_segments(mode, frame, q, q + 1, no_flat, no_val, into, problems[q])
        fetch_add(shared, 1, -1)
    while wait and load_acquire(shared, 1) != 0:
        pass


@njit(cache=True, nogil=True)
def wait_flag(flag, polls):
    """Poll flag[0] (outside the GIL) until it is nonzero, at most polls times; returns it
    (0 when the polls ran out)."""
    for _ in range(polls):
        v = load_acquire(flag, 0)
        if v != 0:
            return v
    return 0


@njit(cache=True, nogil=True)
def prepare(table, offsets_raw, index_len, levels, offsets):
    """Check a sparse frame's table and offsets sections and bring them into the form
    decode_segments reads, in one call: levels = the table's bfloat16 (hi, lo) pairs as
    fp32 (finite, non-negative, hi >= lo); offsets = the u32 segment starts (from 0,
    inside the index section of index_len bytes, never decreasing) and then index_len.
    Returns (status, segment or 0, value, other value): the first problem in the order
    offsets (start, beyond the section, backwards), then levels."""
    n_seg = offsets_raw.shape[0] // 4
    for s in range(n_seg):
        q = 4 * s
        offsets[s] = (np.int64(offsets_raw[q]) | (np.int64(offsets_raw[q + 1]) << 8)
                      | (np.int64(offsets_raw[q + 2]) << 16) | (np.int64(offsets_raw[q + 3]) << 24))
    offsets[n_seg] = index_len
    if n_seg and offsets[0] != 0:
        return OFFSETS_START, 0, offsets[0], 0
    for s in range(n_seg):
        if offsets[s] > index_len:
            return OFFSETS_BEYOND, s, offsets[s], index_len
    for s in range(1, n_seg):
        if offsets[s] < offsets[s - 1]:
            return OFFSETS_BACK, s, offsets[s], offsets[s - 1]
    bits = levels.view(np.uint32)
    order = OK
    for j in range(levels.shape[0]):
        t = np.uint32(table[2 * j]) | (np.uint32(table[2 * j + 1]) << np.uint32(8))
        if (t >> np.uint32(7)) & np.uint32(0xFF) == np.uint32(0xFF) or t >> np.uint32(15):
            return LEVELS_BAD, 0, 0, 0
        bits[j] = t << np.uint32(16)
        if j & 1 and bits[j - 1] < bits[j]:  # (hi, lo) pairs: non-negative, so bits order as values
            order = LEVELS_ORDER
    return order, 0, 0, 0


@njit(cache=True, nogil=True)
def scatter_add(p, idx, step, start, stop):
    """p[idx[j]] += step[j] for j in [start, stop) (fp32; indices unique)."""
    for j in range(start, stop):
        p[idx[j]] += step[j]
