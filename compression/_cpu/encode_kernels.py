"""The fused CPU encoder (numba): error feedback, exact per-chunk top-k and 2-bit codes in
one pass over memory, the SparseLoCo compressor of Sarfi et al. 2025 (arXiv 2508.15706)
with the frame format of docs/codec.md.

Per band of tile rows: one streaming pass computes ``e = beta*prev + d`` into the spare
error buffer (``prev``, the current one, is only read: a NaN or Inf found anywhere leaves
the state as it was, with no separate check pass) and, for every segment of ``SEG``
consecutive elements of a tile row, the largest ``|e|`` bit pattern. The k-th largest
segment maximum is a lower bound of the chunk's k-th largest ``|e|`` (k segments hold an
element at least that large), so exact top-k only has to look inside the few segments
whose maximum reaches it, while the band is still in cache. Lower position wins ties. The
output is byte for byte the reference's (``reference.py``); the parity tests compare them.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import njit

from ..layout import (
    FIRST_CODE,
    FIRST_KEPT,
    KEPT,
    NUMEL,
    ChunkGrid,
    chunk_count,
    chunk_numel,
    chunk_table,
    code_bytes,
    fixed_width,
    flat_index,
    in_tile,
    index_bytes_max,
    leftover_flat,
    rice_param,
    tile_origin,
    tile_shift,
)
from .intrinsics import LANES, bits_f32, f32_bits, ge_mask16, popcount, put8_plus, store_u64

MAGNITUDE = np.int32(0x7FFFFFFF)  # fp32 bits without the sign: ordered like |x|
INF = np.int32(0x7F800000)        # |x| bits at or above: Inf or NaN
SEG = LANES         # elements per segment of a tile row (one ge_mask16)
HINT_MARGIN = np.int32(1 << 20)  # try the previous tile's k-th largest / 2**(1/8) first
COARSE_BIT = 19     # coarse rank values keep the exponent and the top 4 mantissa bits
EF_BLOCK = 8192     # elements per error-feedback block (32 KB: the L1 data cache)
GROUP_COLS = 4096   # a work unit spans up to this many columns of one band of tile rows


class EncodePlan(NamedTuple):
    """One tensor's grid and codec parameters, and the output arrays ``encode_units`` and
    ``encode_finish`` write (every one rewritten by each call, so they serve call after
    call). The kept values and flat indices are kept for the whole tensor only with a
    table per tensor (its levels need every chunk first).

    Like every record here, it goes into a kernel as a plain tuple (``tuple(plan)``) that
    the kernel turns back into the record: numba takes a plain tuple in 2.5 us, a NamedTuple
    of these fields in 5.3 us, their 28 fields as arguments in 3.0 us (measured)."""

    rows: int
    cols: int
    tile: int
    row_tiles: int
    col_tiles: int
    k_full: int
    per_chunk: bool
    fixed: bool
    n_units: int         # bands of up to GROUP_COLS columns of tiles, then leftover chunks
    kc: np.ndarray       # kept per chunk
    koff: np.ndarray     # first kept element of each chunk, then the total
    coff: np.ndarray     # first code byte of each chunk, then the total
    vals: np.ndarray     # table per tensor: the kept values (fp32) ...
    flats: np.ndarray    # ... and their flat indices
    codes: np.ndarray    # the codes section's share of this tensor
    table: np.ndarray    # (hi, lo) bfloat16 bits per chunk, or one pair
    nbits: np.ndarray    # index bits per chunk
    bad: np.ndarray      # per chunk: NaN or Inf seen, or a level that rounds to Inf
    islot: np.ndarray    # per chunk, its coded positions (+ 8 bytes of room for 8-byte stores)


class Scratch(NamedTuple):
    """One thread's working buffers for ``encode_units`` (``scratch`` makes them)."""

    segmax: np.ndarray   # segment maxima, each tile's together
    rowmax: np.ndarray   # segment maxima of a block of rows, before they are spread over the tiles
    gbuf: np.ndarray     # a leftover chunk gathered
    cand: np.ndarray     # candidate positions, then the kept ones
    keys: np.ndarray     # their |x| bits
    tmp: np.ndarray      # segment list
    cvals: np.ndarray    # table per chunk: one chunk's kept values ...
    cflats: np.ndarray   # ... and flat indices
    found: np.ndarray    # _topk's results: the largest key, a lower bound of the kept keys


@njit(cache=True, nogil=True)
def _ef_span(prev, d, beta, e):
    """``e = beta*prev + d`` over a contiguous span (vectorizes)."""
    for i in range(e.shape[0]):
        e[i] = prev[i] * beta + d[i]


@njit(cache=True, nogil=True)
def _seg16_max(keys, out):
    """out[q] = the largest |x| bit pattern of keys[16q:16q+16] (keys: fp32 bits; vectorizes)."""
    for q in range(out.shape[0]):
        m = np.int32(0)
        for i in range(SEG):
            m = max(m, keys[q * SEG + i] & MAGNITUDE)
        out[q] = m


@njit(cache=True, nogil=True)
def _ef_rows(prev, d, beta, e, row0, nrows, cols, c0, c1, tile, spr, segmax, rowmax):
    """``e = beta*prev + d`` over rows [row0, row0+nrows), columns [c0, c1) (whole
    tiles), and the segment maxima of |e|, each tile's together:
    segmax[tc*tile*spr + r*spr + s] for tile tc (from c0), tile row r, segment s. Rows
    spanning the whole width are one contiguous stream, taken in blocks of about L1 size;
    each block's maxima are taken while it is still in L1 (all at once into rowmax, then
    spread over the tiles)."""
    eb = e.view(np.int32)
    nt = (c1 - c0) // tile
    per_tile = tile * spr
    width = c1 - c0
    block = max(1, EF_BLOCK // width) if width == cols else 1
    for r0 in range(0, nrows, block):
        r1 = min(nrows, r0 + block)
        a = (row0 + r0) * cols + c0
        span = (r1 - r0) * cols if width == cols else width  # contiguous
        _ef_span(prev[a:a + span], d[a:a + span], beta, e[a:a + span])
        if tile % SEG == 0:  # the block's rows are back to back: their maxima at once
            w = nt * spr
            _seg16_max(eb[a:a + span], rowmax[:(r1 - r0) * w])
            for r in range(r0, r1):
                for tc in range(nt):
                    for s in range(spr):
                        segmax[tc * per_tile + r * spr + s] = rowmax[(r - r0) * w + tc * spr + s]
            continue
        for r in range(r0, r1):
            a = (row0 + r) * cols + c0
            for tc in range(nt):
                for s in range(spr):
                    m = np.int32(0)
                    for i in range(a + tc * tile + s * SEG, a + tc * tile + min(tile, s * SEG + SEG)):
                        m = max(m, eb[i] & MAGNITUDE)
                    segmax[tc * per_tile + r * spr + s] = m


@njit(cache=True, nogil=True)
def _segmax_flat(x, n, tile, spr, segmax):
    """Segment maxima of |x[:n]| seen as rows of ``tile`` (the last one may be short)."""
    nrows = (n + tile - 1) // tile
    for r in range(nrows):
        rowlen = min(tile, n - r * tile)
        for s in range(spr):
            m = np.int32(0)
            for q in range(r * tile + s * SEG, r * tile + min(rowlen, s * SEG + SEG)):
                m = max(m, f32_bits(x[q]) & MAGNITUDE)
            segmax[r * spr + s] = m


@njit(cache=True, nogil=True)
def _count_ge(keys, o, m, c):
    """How many of keys[o:o+m] are >= c (vector compares and popcounts, no branches per
    key). Reads up to 15 entries past the end, which must exist; they are not counted."""
    cnt = np.uint64(0)
    full = m // SEG * SEG
    for j in range(0, full, SEG):
        cnt += popcount(ge_mask16(keys, o + j, c))
    if full < m:
        cnt += popcount(ge_mask16(keys, o + full, c) & ((np.uint64(1) << np.uint64(m - full)) - np.uint64(1)))
    return np.int64(cnt)


@njit(cache=True, nogil=True)
def _rank_value(keys, o, m, r, t, high_bit, low_bit):
    """The r-th largest (0-based) of the non-negative int32 keys[o:o+m], found bit by bit:
    the largest value with count(keys >= value) > r, given that it starts with the bits
    of t above high_bit. Bits below low_bit stay zero (a lower bound within a factor
    1 + 2**(low_bit - 23) for floats). Counting is branch-free (vector compares and
    popcounts), unlike quickselect, whose comparisons mispredict half the time."""
    for bit in range(high_bit, low_bit - 1, -1):
        c = t | np.int32(1 << bit)
        if _count_ge(keys, o, m, c) > r:
            t = c
    return t


@njit(cache=True, nogil=True)
def _common_prefix(least, most):
    """(the leading bits shared by every int32 in [least, most] with the rest zero, the
    highest bit below them); high is -1 when least == most."""
    diff = least ^ most
    high = -1
    while diff >> (high + 1):
        high += 1
    return least & ~np.int32((1 << (high + 1)) - 1), high


@njit(cache=True, nogil=True)
def _rank_bf16(keys, m, r, prefix, high):
    """bfloat16 bits (round to nearest even) of the r-th largest of keys[:m] (fp32
    magnitude bits sharing the bits of prefix above high). Only the bits that decide the
    rounding are searched: down to bit 16, then whether the low half is above, at or
    below one half."""
    t = _rank_value(keys, 0, m, r, prefix, high, 16) & ~np.int32(0xFFFF)
    if _count_ge(keys, 0, m, t | np.int32(0x8001)) > r:
        return (t >> 16) + 1
    if _count_ge(keys, 0, m, t | np.int32(0x8000)) > r:  # exactly half: to even
        return (t >> 16) + ((t >> 16) & 1)
    return t >> 16


@njit(cache=True, nogil=True)
def _chunk_levels(keys, m, least, most):
    """(hi, lo) bfloat16 bits of the quantizer from m kept magnitude bit patterns, all in
    [least, most]: the same values as ``kernels._levels``, without reordering keys."""
    h = m // 2
    r1 = h // 2
    r2 = h + (m - h) // 2
    prefix, high = _common_prefix(least, most)
    hi = _rank_bf16(keys, m, r1, prefix, high)
    lo = _rank_bf16(keys, m, r2, prefix, high) if r2 > r1 else hi
    return hi, lo


# BYTE_BITS[b, :popcount(b)] = positions of the set bits of byte b, ascending
BYTE_BITS = np.zeros((256, 8), dtype=np.int32)
for _b in range(256):
    _set = [j for j in range(8) if _b >> j & 1]
    BYTE_BITS[_b, :len(_set)] = _set


@njit(cache=True, nogil=True)
def _put_set_bits(out, m, bits, p0):
    """Append p0 + j for every set bit j of the 16-bit mask bits to out[m:]; returns the
    new length. Two table rows stored whole (out needs 16 entries of room past m)."""
    lo = bits & np.uint64(255)
    put8_plus(out, m, BYTE_BITS, lo, p0)
    m += np.int64(popcount(lo))
    hi = bits >> np.uint64(8)
    put8_plus(out, m, BYTE_BITS, hi, p0 + 8)
    return m + np.int64(popcount(hi))


@njit(cache=True, nogil=True)
def _scan(arr, base, stride, tile, shift, n, segmax, s0, spr, t, cand, keys, segs):
    """Positions (ascending) and keys of the elements with |x| bits >= t, looking only in
    the segments whose maximum reaches t; returns how many. Branch-free where it counts:
    the segments are listed from compare masks over their maxima, each one's hits from a
    compare mask over its elements, set-bit positions from a table. cand and segs need
    n + 2*SEG room, segmax 16 readable entries past the chunk's."""
    nseg = (n + tile - 1) // tile * spr
    ns = 0
    for j in range(0, nseg, SEG):
        bits = ge_mask16(segmax, s0 + j, t)
        if nseg - j < SEG:
            bits &= (np.uint64(1) << np.uint64(nseg - j)) - np.uint64(1)
        ns = _put_set_bits(segs, ns, bits, j)
    sps = -1  # log2(spr) when a power of two
    if spr & (spr - 1) == 0:
        sps = 0
        while (1 << sps) < spr:
            sps += 1
    m = 0
    for i in range(ns):
        g = segs[i]
        r = g >> sps if sps >= 0 else g // spr
        q0 = (g - r * spr) * SEG
        p0 = r * tile + q0
        if q0 + SEG <= min(tile, n - r * tile):
            m = _put_set_bits(cand, m, ge_mask16(arr, base + r * stride + q0, t), p0)
        else:
            off = base + r * stride
            for q in range(q0, min(tile, n - r * tile)):
                cand[m] = r * tile + q
                m += (f32_bits(arr[off + q]) & MAGNITUDE) >= t
    for j in range(m):
        keys[j] = f32_bits(arr[in_tile(base, stride, tile, shift, cand[j])]) & MAGNITUDE
    return m


@njit(cache=True, nogil=True)
def _topk(arr, base, stride, tile, shift, n, k, segmax, s0, spr, hint, cand, keys, tmp, out):
    """Positions of the k largest |x| of a chunk, ascending, into cand[:k] (lower position
    wins ties). Element p of the chunk is at ``in_tile(base, stride, tile, shift, p)`` in arr;
    the maxima of its segments are segmax[s0 + r*spr + s] (chunk row r, segment s).
    hint: a guess at a lower bound of the k-th largest key (0: none), tried first. Sets
    out[0] to the largest key (Inf/NaN check) and out[1] to a lower bound of the kept
    keys. Scratch: cand, keys and tmp of n + 2*SEG."""
    nseg = (n + tile - 1) // tile * spr
    top = np.int32(0)
    seg = segmax[s0:s0 + nseg]
    for g in range(seg.shape[0]):
        top = max(top, seg[g])
    out[0] = top
    if k >= n:
        for p in range(n):
            cand[p] = p
        out[1] = 0
        return
    t = hint
    m = _scan(arr, base, stride, tile, shift, n, segmax, s0, spr, t, cand, keys, tmp) if 0 < t <= top else 0
    if m < k:  # no hint, or a wrong one: k segments reach the k-th largest segment maximum
        t = np.int32(0)
        if nseg > k:
            t = _rank_value(segmax, s0, nseg, k - 1, np.int32(0), 30, COARSE_BIT)
        m = _scan(arr, base, stride, tile, shift, n, segmax, s0, spr, t, cand, keys, tmp)
    # every key lies in [t, top]: the k-th largest shares their common leading bits. Fix
    # its bits from the top until exactly k keys reach the prefix, or down to bit 0
    t, high = _common_prefix(t, top)
    at_least = m  # keys >= t
    bit = high
    while bit >= 0 and at_least > k:
        c = t | np.int32(1 << bit)
        cnt = _count_ge(keys, 0, m, c)
        if cnt >= k:
            t = c
            at_least = cnt
        bit -= 1
    out[1] = t
    w = 0
    if at_least == k:  # the k keys >= t
        for j in range(m):
            cand[w] = cand[j]
            w += keys[j] >= t
        return
    # t is the k-th largest exactly, held by several keys: the lower positions win
    need = k - _count_ge(keys, 0, m, t + 1)
    for j in range(m):
        kk = keys[j]
        take = kk > t or (kk == t and need > 0)
        need -= kk == t and need > 0
        cand[w] = cand[j]
        w += take


@njit(cache=True, nogil=True)
def _quantize_kept(vals, k, hi16, lo16, e, flats, codes, coff):
    """2-bit codes of vals[:k] with levels (hi16, lo16) into codes[coff:], and the
    residual e[flats[j]] = vals[j] - decoded (bit selects, no branches per value)."""
    hi_bits = np.int32(hi16) << 16
    lo_bits = np.int32(lo16) << 16
    mid = (bits_f32(lo_bits) + bits_f32(hi_bits)) * np.float32(0.5)
    sign = np.int32(-0x80000000)
    byte = 0
    for j in range(k):
        x = vals[j]
        b = f32_bits(x)
        is_hi = np.int32(abs(x) >= mid)
        mag = lo_bits ^ ((lo_bits ^ hi_bits) & -is_hi)
        e[flats[j]] = x - bits_f32(mag | (b & sign))
        byte |= (is_hi | ((b >> 30) & 2)) << (2 * (j & 3))
        if (j & 3) == 3:
            codes[coff + (j >> 2)] = np.uint8(byte)
            byte = 0
    if k & 3:
        codes[coff + (k >> 2)] = np.uint8(byte)


@njit(cache=True, nogil=True)
def _code_positions(out, pos, k, n, fixed):
    """Writes the coded positions pos[:k] (ascending) at the start of out; returns the bit
    count. One unaligned 8-byte store per position: out needs 8 bytes of room past the
    code."""
    acc = np.uint64(0)
    nacc = 0
    o = 0
    if fixed:
        w = fixed_width(n)
        for j in range(k):
            acc |= np.uint64(pos[j]) << np.uint64(nacc)
            nacc += w
            store_u64(out, o, acc)
            o += nacc >> 3
            acc >>= np.uint64(nacc & ~7)
            nacc &= 7
        return 8 * o + nacc
    b = rice_param(n, k)
    room = 63 - b - 1  # zero bits that still leave room for the remainder in acc
    prev = -1
    for j in range(k):
        g = pos[j] - prev - 1
        prev = pos[j]
        nacc += g >> b  # the quotient in unary: zeros, then the one below
        while nacc > room:  # a long gap (rare): flush whole zero bytes
            out[o] = np.uint8(acc & np.uint64(255))
            o += 1
            acc = np.uint64(0)
            nacc -= 8
        acc |= np.uint64(((g & ((1 << b) - 1)) << 1) | 1) << np.uint64(nacc)
        nacc += b + 1
        store_u64(out, o, acc)
        o += nacc >> 3
        acc >>= np.uint64(nacc & ~7)
        nacc &= 7
    return 8 * o + nacc


@njit(cache=True, nogil=True)
def _finish_chunk(c, n, k, arr, base, stride, shift, cand, found, e, vals, flats, s, codes, coff, table,
                  nbits, islot, rows, cols, tile, row_tiles, col_tiles, per_chunk, fixed, keys):
    """Kept values of chunk c, its per-chunk levels and codes (the residual goes to e), and
    its coded positions (into islot[c], their bit count into nbits[c]). With a table per
    tensor, the values and flat indices go to vals[s:s+k] and flats[s:s+k] for later;
    with one per chunk, vals and flats are scratch (s = 0). found: (largest key, a lower
    bound of the kept keys) from _topk. False when the levels overflow."""
    for j in range(k):
        vals[s + j] = arr[in_tile(base, stride, tile, shift, cand[j])]
    if c < row_tiles * col_tiles:
        fb = tile_origin(c, cols, tile, col_tiles)
        for j in range(k):
            flats[s + j] = in_tile(fb, cols, tile, shift, cand[j])
    else:
        for j in range(k):
            flats[s + j] = flat_index(c, cand[j], rows, cols, tile, row_tiles, col_tiles)
    if per_chunk:
        for j in range(k):
            keys[j] = f32_bits(vals[j]) & MAGNITUDE
        hi16, lo16 = _chunk_levels(keys, k, found[1], found[0])
        table[2 * c] = hi16
        table[2 * c + 1] = lo16
        if hi16 >= 0x7F80:
            return False
        _quantize_kept(vals, k, hi16, lo16, e, flats, codes, coff)
    nbits[c] = _code_positions(islot[c], cand, k, n, fixed)
    return True


def encode_plan(rows: int, cols: int, tile: int, row_tiles: int, col_tiles: int, k_full: int, per_chunk: bool,
                fixed: bool) -> EncodePlan:
    """A tensor's EncodePlan, its arrays sized from the layout's formulas."""
    chunks = chunk_table((ChunkGrid(rows, cols, tile, row_tiles, col_tiles),), k_full)
    n_chunks = len(chunks)
    kc = np.ascontiguousarray(chunks[:, KEPT])
    koff = np.append(chunks[:, FIRST_KEPT], kc.sum()).astype(np.int64)
    coff = np.append(chunks[:, FIRST_CODE], chunks[-1, FIRST_CODE] + code_bytes(int(kc[-1])) if n_chunks else 0)
    total_k = 0 if per_chunk else int(koff[-1])
    sizes = set(map(tuple, chunks[:, [NUMEL, KEPT]].tolist()))  # the most index bytes one chunk can take
    slot = max([1] + [index_bytes_max(n, k, fixed) for n, k in sizes for fixed in (False, True)])
    group = max(1, GROUP_COLS // tile)
    n_units = row_tiles * ((col_tiles + group - 1) // group) + (n_chunks - row_tiles * col_tiles)
    return EncodePlan(rows, cols, tile, row_tiles, col_tiles, k_full, per_chunk, fixed, n_units, kc, koff, coff,
                      np.empty(total_k, dtype=np.float32), np.empty(total_k, dtype=np.int64),
                      np.zeros(coff[-1], dtype=np.uint8),
                      np.zeros(2 * n_chunks if per_chunk else (2 if n_chunks else 0), dtype=np.uint16),
                      np.zeros(n_chunks, dtype=np.int64), np.zeros(n_chunks, dtype=np.uint8),
                      np.empty((n_chunks, slot + 8), dtype=np.uint8))


def scratch(tile: int) -> Scratch:
    """A thread's Scratch for chunks of this tile."""
    size = tile * tile
    spr = -(-tile // SEG)
    group = max(1, GROUP_COLS // tile)
    room = size + 2 * SEG
    return Scratch(np.zeros(group * tile * spr + SEG, dtype=np.int32),
                   np.empty(max(group * spr, EF_BLOCK // SEG), dtype=np.int32), np.empty(size + 1, dtype=np.float32),
                   np.empty(room, dtype=np.int32), np.zeros(room, dtype=np.int32), np.empty(room, dtype=np.int32),
                   np.empty(size, dtype=np.float32), np.empty(size, dtype=np.int64), np.empty(2, dtype=np.int32))


@njit(cache=True, nogil=True)
def encode_units(prev, d, beta, e, plan, u0, u1, sc):
    """Error feedback ``e = beta*prev + d`` (prev is left as it was), top-k and (per-chunk
    table) quantization for work units [u0, u1) of a tensor (plan: its EncodePlan; sc:
    this thread's Scratch).

    A unit is a group of up to GROUP_COLS columns of tiles in one band of tile rows, or
    one leftover chunk (1-D tensors, and the right and bottom strips of 2-D ones).
    """
    plan, sc = EncodePlan(*plan), Scratch(*sc)
    # the records' fields as locals, once: the per-chunk helpers take plain arrays (records
    # passed down to them cost 1-8 %, measured)
    rows, cols, tile, row_tiles, col_tiles = plan.rows, plan.cols, plan.tile, plan.row_tiles, plan.col_tiles
    per_chunk, fixed = plan.per_chunk, plan.fixed
    kc, koff, coff, codes, table, nbits, bad, islot = (plan.kc, plan.koff, plan.coff, plan.codes, plan.table,
                                                       plan.nbits, plan.bad, plan.islot)
    vals, flats = plan.vals, plan.flats
    segmax, rowmax, gbuf, cand, keys, tmp, cvals, cflats, found = sc
    size = tile * tile
    n_tiles = row_tiles * col_tiles
    spr = (tile + SEG - 1) // SEG
    group = max(1, GROUP_COLS // tile)
    gpb = (col_tiles + group - 1) // group
    shift = tile_shift(tile)
    if per_chunk:  # one chunk's values and flat indices at a time, in scratch
        vals, flats = cvals, cflats
    hint = np.int32(0)  # the previous tile's k-th largest, lowered: usually still k candidates
    for u in range(u0, u1):
        if u < row_tiles * gpb:
            tr = u // gpb
            tc0 = (u - tr * gpb) * group
            tc1 = min(col_tiles, tc0 + group)
            _ef_rows(prev, d, beta, e, tr * tile, tile, cols, tc0 * tile, tc1 * tile, tile, spr, segmax, rowmax)
            for tc in range(tc0, tc1):
                c = tr * col_tiles + tc
                base = tr * tile * cols + tc * tile
                _topk(e, base, cols, tile, shift, size, kc[c], segmax, (tc - tc0) * tile * spr, spr,
                      hint, cand, keys, tmp, found)
                hint = max(np.int32(0), found[1] - HINT_MARGIN)
                bad[c] = found[0] >= INF or not _finish_chunk(
                    c, size, kc[c], e, base, cols, shift, cand, found, e, vals, flats,
                    0 if per_chunk else koff[c], codes, coff[c], table, nbits, islot, rows, cols, tile,
                    row_tiles, col_tiles, per_chunk, fixed, keys)
        else:
            c = n_tiles + u - row_tiles * gpb
            n = chunk_numel(c, rows, cols, tile, row_tiles, col_tiles)
            q0 = (c - n_tiles) * size
            if col_tiles == 0:  # a 1-D tensor: the chunk is contiguous
                _ef_span(prev[q0:q0 + n], d[q0:q0 + n], beta, e[q0:q0 + n])
                _segmax_flat(e[q0:q0 + n], n, tile, spr, segmax)
                arr, base = e, q0
            else:
                for p in range(n):
                    f = leftover_flat(q0 + p, rows, cols, tile, row_tiles, col_tiles)
                    x = prev[f] * beta + d[f]
                    e[f] = x
                    gbuf[p] = x
                _segmax_flat(gbuf, n, tile, spr, segmax)
                arr, base = gbuf, 0
            _topk(arr, base, tile, tile, shift, n, kc[c], segmax, 0, spr, np.int32(0), cand, keys, tmp, found)
            bad[c] = found[0] >= INF or not _finish_chunk(
                c, n, kc[c], arr, base, tile, shift, cand, found, e, vals, flats,
                0 if per_chunk else koff[c], codes, coff[c], table, nbits, islot, rows, cols, tile,
                row_tiles, col_tiles, per_chunk, fixed, keys)


@njit(cache=True, nogil=True)
def encode_finish(e, plan):
    """Per-tensor quantizer levels (table per tensor) and the index section, joined from
    the chunks' slots.

    Returns (index bytes, nonfinite flag)."""
    plan = EncodePlan(*plan)
    n_chunks = chunk_count(plan.rows, plan.cols, plan.tile, plan.row_tiles, plan.col_tiles)
    kc, koff, coff, vals, flats, codes, table, nbits, islot = (plan.kc, plan.koff, plan.coff, plan.vals, plan.flats,
                                                               plan.codes, plan.table, plan.nbits, plan.islot)
    vbits = vals.view(np.uint32)
    nonfinite = plan.bad.any()
    total_k = koff[n_chunks]
    if not plan.per_chunk and n_chunks and not nonfinite:
        mk = np.empty(total_k, dtype=np.uint32)
        for j in range(total_k):
            mk[j] = vbits[j] & np.uint32(0x7FFFFFFF)
        hi16, lo16 = _levels(mk, total_k)
        table[0] = hi16
        table[1] = lo16
        if hi16 >= 0x7F80:
            nonfinite = True
        else:
            sc = np.empty(2, dtype=np.uint32)
            for c in range(n_chunks):
                _quantize_chunk(e, vals, vbits, flats, koff[c], kc[c], hi16, lo16, codes, coff[c], sc)
    ioff = np.zeros(n_chunks + 1, dtype=np.int64)
    for c in range(n_chunks):
        ioff[c + 1] = ioff[c] + (nbits[c] + 7) // 8
    index = np.zeros(ioff[n_chunks], dtype=np.uint8)
    if nonfinite:
        return index, True
    for c in range(n_chunks):
        index[ioff[c]:ioff[c + 1]] = islot[c, :ioff[c + 1] - ioff[c]]
    return index, False


# ----------------------------------------------------------------------------- table per tensor


@njit(cache=True, nogil=True)
def _bf16_rne(bits):
    """fp32 bit pattern (non-negative, finite) -> bfloat16 bits, round to nearest even."""
    return (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)


@njit(cache=True, nogil=True)
def _kth_largest(a, lo, hi, r):
    """Partially order a[lo:hi] so that a[r] is the (r-lo)-th largest (0-based); returns it."""
    while hi - lo > 1:
        mid = (lo + hi) // 2
        # median of three as the pivot
        x, y, z = a[lo], a[mid], a[hi - 1]
        if x < y:
            x, y = y, x
        if y < z:
            y = z
            if x < y:
                y = x
        pivot = y
        i, j = lo, hi - 1
        while i <= j:
            while a[i] > pivot:
                i += 1
            while a[j] < pivot:
                j -= 1
            if i <= j:
                t = a[i]
                a[i] = a[j]
                a[j] = t
                i += 1
                j -= 1
        if r <= j:
            hi = j + 1
        elif r >= i:
            lo = i
        else:
            return a[r]
    return a[r]


@njit(cache=True, nogil=True)
def _levels(mk, m):
    """(hi, lo) bfloat16 bits from m kept magnitude bit patterns in mk[:m] (reordered)."""
    h = m // 2
    r1 = h // 2
    r2 = h + (m - h) // 2
    hi = _kth_largest(mk, 0, m, r1)
    lo = _kth_largest(mk, r1 + 1, m, r2) if r2 > r1 else hi
    return _bf16_rne(hi), _bf16_rne(lo)


@njit(cache=True, nogil=True)
def _quantize_chunk(e, vals, vbits, flats, start, k, hi16, lo16, codes, coff, sc):
    """Codes for vals[start:start+k] with levels (hi16, lo16); e[flats[j]] = vals[j] - decoded."""
    sc[0] = np.uint32(hi16) << np.uint32(16)
    sc[1] = np.uint32(lo16) << np.uint32(16)
    scf = sc.view(np.float32)
    hi = scf[0]
    lo = scf[1]
    mid = (lo + hi) * np.float32(0.5)
    byte = 0
    for j in range(k):
        x = vals[start + j]
        neg = np.int64(vbits[start + j] >> np.uint32(31))
        is_hi = np.int64(abs(x) >= mid)
        mag = hi if is_hi else lo
        e[flats[start + j]] = x - (-mag if neg else mag)
        byte |= (is_hi | (neg << 1)) << (2 * (j & 3))
        if (j & 3) == 3 or j == k - 1:
            codes[coff + (j >> 2)] = np.uint8(byte)
            byte = 0


@njit(cache=True, nogil=True)
def count_nonfinite(x, start, stop):
    """How many of the fp32 values x[start:stop] are NaN or Inf."""
    bits = x[start:stop].view(np.uint32)
    bad = 0
    for i in range(bits.shape[0]):
        bad += (bits[i] & np.uint32(0x7F800000)) == np.uint32(0x7F800000)
    return bad
