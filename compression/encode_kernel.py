"""Fused CPU encoder (numba): error feedback, exact per-chunk top-k, 2-bit codes, in one
pass over memory.

Per band of tile rows: one streaming pass computes ``e = beta*e + d`` in place and, for
every segment of ``SEG`` consecutive elements of a tile row, the largest ``|e|`` bit
pattern. The k-th largest segment maximum is a lower bound of the chunk's k-th largest
``|e|`` (k segments hold an element at least that large), so exact top-k only has to look
inside the few segments whose maximum reaches it, while the band is still in cache. Lower
position wins ties. The output is byte for byte the one of ``sparse_torch.py``; tests
compare the two.
"""

from __future__ import annotations

import numpy as np

from .intrinsics import LANES, f32_bits, ge_mask16, popcount
from .kernels import (
    _bf16_rne,
    _fixed_width,
    _flat,
    _kept,
    _leftover_flat,
    _levels,
    _quantize_chunk,
    _rice_param,
    _write_index,
    njit,
)

MAGNITUDE = np.int32(0x7FFFFFFF)  # fp32 bits without the sign: ordered like |x|
INF = np.int32(0x7F800000)        # |x| bits at or above: Inf or NaN
SEG = LANES         # elements per segment of a tile row (one ge_mask16)
HINT_MARGIN = np.int32(1 << 20)  # try the previous tile's k-th largest / 2**(1/8) first
COARSE_BIT = 19     # coarse rank values keep the exponent and the top 4 mantissa bits
EF_BLOCK = 8192     # elements per error-feedback block (32 KB: the L1 data cache)
GROUP_COLS = 4096   # a work unit spans up to this many columns of one band of tile rows

@njit(cache=True, nogil=True)
def _ef_span(e, d, beta):
    """``e = beta*e + d`` in place over a contiguous span (vectorizes)."""
    for i in range(e.shape[0]):
        e[i] = e[i] * beta + d[i]


@njit(cache=True, nogil=True)
def _seg16_max(keys, out):
    """out[q] = the largest |x| bit pattern of keys[16q:16q+16] (keys: fp32 bits; vectorizes)."""
    for q in range(out.shape[0]):
        m = np.int32(0)
        for i in range(SEG):
            m = max(m, keys[q * SEG + i] & MAGNITUDE)
        out[q] = m


@njit(cache=True, nogil=True)
def _ef_rows(e, d, beta, row0, nrows, cols, c0, c1, tile, spr, segmax):
    """``e = beta*e + d`` in place over rows [row0, row0+nrows), columns [c0, c1) (whole
    tiles), and the segment maxima of |e|, row by row: segmax[r*w + tc*spr + s] for tile
    row r, tile tc (from c0), segment s, with w = spr * (c1 - c0) // tile. Rows spanning
    the whole width are one contiguous stream, taken in blocks of about L1 size; each
    block's maxima are taken while it is still in L1."""
    eb = e.view(np.int32)
    nt = (c1 - c0) // tile
    w = spr * nt
    width = c1 - c0
    block = max(1, EF_BLOCK // width) if width == cols else 1
    for r0 in range(0, nrows, block):
        r1 = min(nrows, r0 + block)
        a = (row0 + r0) * cols + c0
        if width == cols:
            _ef_span(e[a:a + (r1 - r0) * cols], d[a:a + (r1 - r0) * cols], beta)
        else:
            _ef_span(e[a:a + width], d[a:a + width], beta)
        for r in range(r0, r1):
            a = (row0 + r) * cols + c0
            if tile % SEG == 0:
                _seg16_max(eb[a:a + width], segmax[r * w:(r + 1) * w])
                continue
            for tc in range(nt):
                for s in range(spr):
                    m = np.int32(0)
                    for i in range(a + tc * tile + s * SEG, a + tc * tile + min(tile, s * SEG + SEG)):
                        m = max(m, eb[i] & MAGNITUDE)
                    segmax[r * w + tc * spr + s] = m


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
def _rank_value(keys, m, r, t, high_bit, low_bit):
    """The r-th largest (0-based) of the non-negative int32 keys[:m], found bit by bit:
    the largest value with count(keys >= value) > r, given that it starts with the bits
    of t above high_bit. Bits below low_bit stay zero (a lower bound within a factor
    1 + 2**(low_bit - 23) for floats). Counting is branch-free (vector compares and
    popcounts), unlike quickselect, whose comparisons mispredict half the time. keys must
    have room for m rounded up to 16; the padding is overwritten."""
    m16 = (m + SEG - 1) // SEG * SEG
    for j in range(m, m16):
        keys[j] = -1
    for bit in range(high_bit, low_bit - 1, -1):
        c = t | np.int32(1 << bit)
        cnt = 0
        for j in range(0, m16, SEG):
            cnt += popcount(ge_mask16(keys, j, c))
        if cnt > r:
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
def _chunk_levels(keys, m, least, most):
    """(hi, lo) bfloat16 bits of the quantizer from m kept magnitude bit patterns, all in
    [least, most]: the same values as ``kernels._levels``, without reordering keys."""
    h = m // 2
    r1 = h // 2
    r2 = h + (m - h) // 2
    prefix, high = _common_prefix(least, most)
    hi = _rank_value(keys, m, r1, prefix, high, 0)
    lo = _rank_value(keys, m, r2, prefix, high, 0) if r2 > r1 else hi
    return _bf16_rne(np.uint32(hi)), _bf16_rne(np.uint32(lo))


# BYTE_BITS[b, :popcount(b)] = positions of the set bits of byte b, ascending
BYTE_BITS = np.zeros((256, 8), dtype=np.int32)
for _b in range(256):
    _set = [j for j in range(8) if _b >> j & 1]
    BYTE_BITS[_b, :len(_set)] = _set


@njit(cache=True, nogil=True)
def _at(base, stride, tile, shift, p):
    """Where element p of a chunk (rows of ``tile`` elements, ``stride`` apart) lies;
    shift = log2(tile) when tile is a power of two, else -1."""
    if shift >= 0:
        return base + (p >> shift) * stride + (p & (tile - 1))
    return base + (p // tile) * stride + p % tile


@njit(cache=True, nogil=True)
def _scan(arr, base, stride, tile, shift, n, segmax, s0, sstride, spr, t, cand, keys, segs):
    """Positions (ascending) and keys of the elements with |x| bits >= t, looking only in
    the segments whose maximum reaches t; returns how many. Branch-free where it counts:
    the segments are listed first, each one's hits come from a compare mask and a table
    of set-bit positions. cand needs n + 2*SEG room, segs one slot per segment."""
    nrows = (n + tile - 1) // tile
    ns = 0
    for r in range(nrows):
        for s in range(spr):
            segs[ns] = r * SEG + s
            ns += segmax[s0 + r * sstride + s] >= t
    m = 0
    for i in range(ns):
        r = segs[i] // SEG
        q0 = (segs[i] % SEG) * SEG
        rowlen = min(tile, n - r * tile)
        p0 = r * tile + q0
        if q0 + SEG <= rowlen:
            bits = ge_mask16(arr, base + r * stride + q0, t)
            lo = bits & np.uint64(255)
            hi = bits >> np.uint64(8)
            for j in range(8):
                cand[m + j] = p0 + BYTE_BITS[lo, j]
            m += popcount(lo)
            for j in range(8):
                cand[m + j] = p0 + 8 + BYTE_BITS[hi, j]
            m += popcount(hi)
        else:
            off = base + r * stride
            for q in range(q0, rowlen):
                cand[m] = r * tile + q
                m += (f32_bits(arr[off + q]) & MAGNITUDE) >= t
    for j in range(m):
        keys[j] = f32_bits(arr[_at(base, stride, tile, shift, cand[j])]) & MAGNITUDE
    return m


@njit(cache=True, nogil=True)
def _topk(arr, base, stride, tile, shift, n, k, segmax, s0, sstride, spr, hint, cand, keys, tmp, out):
    """Positions of the k largest |x| of a chunk, ascending, into cand[:k] (lower position
    wins ties). Element p of the chunk is at ``_at(base, stride, tile, shift, p)`` in arr; the
    maximum of segment s of chunk row r is segmax[s0 + r*sstride + s]. hint: a guess at a
    lower bound of the k-th largest key (0: none), tried first. Sets out[0] to the largest
    key (Inf/NaN check) and out[1] to the k-th largest. Scratch: cand, keys and tmp of
    n + 2*SEG."""
    nrows = (n + tile - 1) // tile
    nseg = nrows * spr
    top = np.int32(0)
    for r in range(nrows):
        for s in range(spr):
            top = max(top, segmax[s0 + r * sstride + s])
    out[0] = top
    if k >= n:
        for p in range(n):
            cand[p] = p
        out[1] = 0
        return
    t = hint
    m = _scan(arr, base, stride, tile, shift, n, segmax, s0, sstride, spr, t, cand, keys, tmp) if 0 < t <= top else 0
    if m < k:  # no hint, or a wrong one: k segments reach the k-th largest segment maximum
        t = np.int32(0)
        if nseg > k:
            for r in range(nrows):
                for s in range(spr):
                    tmp[r * spr + s] = segmax[s0 + r * sstride + s]
            t = _rank_value(tmp, nseg, k - 1, np.int32(0), 30, COARSE_BIT)
        m = _scan(arr, base, stride, tile, shift, n, segmax, s0, sstride, spr, t, cand, keys, tmp)
    # every key lies in [t, top]: the k-th largest shares their common leading bits
    prefix, high = _common_prefix(t, top)
    kth = _rank_value(keys, m, k - 1, prefix, high, 0)
    out[1] = kth
    n_gt = 0
    for j in range(m):
        n_gt += keys[j] > kth
    need = k - n_gt
    w = 0
    for j in range(m):
        kk = keys[j]
        take = kk > kth or (kk == kth and need > 0)
        need -= kk == kth and need > 0
        cand[w] = cand[j]
        w += take


@njit(cache=True, nogil=True)
def _finish_chunk(c, n, k, arr, base, stride, shift, cand, found, e, vals, flats, poss, s, codes, coff, table,
                  nbits, islot, rows, cols, tile, row_tiles, col_tiles, per_chunk, fixed, keys, sc):
    """Kept values and flat indices of chunk c, its per-chunk levels and codes (the residual
    goes to e), and its coded positions (into islot[c], their bit count into nbits[c]).
    found: (largest, k-th largest) key from _topk. False when the levels overflow."""
    n_tiles = row_tiles * col_tiles
    vbits = vals.view(np.uint32)
    for j in range(k):
        p = cand[j]
        poss[s + j] = p
        vals[s + j] = arr[_at(base, stride, tile, shift, p)]
    if c < n_tiles:
        tr = c // col_tiles
        fb = tr * tile * cols + (c - tr * col_tiles) * tile
        for j in range(k):
            flats[s + j] = _at(fb, cols, tile, shift, cand[j])
    else:
        for j in range(k):
            flats[s + j] = _flat(c, cand[j], rows, cols, tile, row_tiles, col_tiles)
    if per_chunk:
        for j in range(k):
            keys[j] = f32_bits(vals[s + j]) & MAGNITUDE
        hi16, lo16 = _chunk_levels(keys, k, found[1], found[0])
        table[2 * c] = hi16
        table[2 * c + 1] = lo16
        if hi16 >= 0x7F80:
            return False
        _quantize_chunk(e, vals, vbits, flats, s, k, hi16, lo16, codes, coff, sc)
    if fixed:
        nbits[c] = k * _fixed_width(n)
    else:
        b = _rice_param(n, k)
        tot = k * (1 + b)
        prev = -1
        for j in range(k):
            tot += (cand[j] - prev - 1) >> b
            prev = cand[j]
        nbits[c] = tot
    _write_index(islot[c], 0, poss, s, k, n, fixed)
    return True


@njit(cache=True, nogil=True)
def encode_plan(rows, cols, tile, row_tiles, col_tiles, k_full, per_chunk):
    """Per-tensor output arrays and the number of work units (see ``encode_units``)."""
    size = tile * tile
    n_tiles = row_tiles * col_tiles
    left = rows * cols - n_tiles * size
    n_chunks = n_tiles + (left + size - 1) // size
    kc = np.empty(n_chunks, dtype=np.int64)
    koff = np.zeros(n_chunks + 1, dtype=np.int64)
    coff = np.zeros(n_chunks + 1, dtype=np.int64)
    for c in range(n_chunks):
        n = size if c < n_chunks - 1 or left % size == 0 else left % size
        kc[c] = _kept(n, k_full, size)
        koff[c + 1] = koff[c] + kc[c]
        coff[c + 1] = coff[c] + (kc[c] + 3) // 4
    total_k = koff[n_chunks]
    vals = np.empty(total_k, dtype=np.float32)
    flats = np.empty(total_k, dtype=np.int64)
    poss = np.empty(total_k, dtype=np.int32)
    codes = np.zeros(coff[n_chunks], dtype=np.uint8)
    table = np.zeros(2 * n_chunks if per_chunk else (2 if n_chunks else 0), dtype=np.uint16)
    nbits = np.zeros(n_chunks, dtype=np.int64)
    bad = np.zeros(n_chunks, dtype=np.uint8)
    slot = 1  # the most index bytes one chunk can take
    for n in (size, left % size):
        if n:
            k = _kept(n, k_full, size)
            b = _rice_param(n, k)
            slot = max(slot, (k * _fixed_width(n) + 7) // 8, (k * (b + 1) + ((n - k) >> b) + 7) // 8)
    islot = np.empty((n_chunks, slot), dtype=np.uint8)
    group = max(1, GROUP_COLS // tile)
    n_units = row_tiles * ((col_tiles + group - 1) // group) + (n_chunks - n_tiles)
    return n_units, kc, koff, coff, vals, flats, poss, codes, table, nbits, bad, islot


def scratch(tile: int) -> tuple:
    """Per-thread scratch buffers for ``encode_units``."""
    size = tile * tile
    spr = -(-tile // SEG)
    group = max(1, GROUP_COLS // tile)
    return (np.empty(max(group * tile * spr, size), dtype=np.int32), np.empty(size + 1, dtype=np.float32),
            np.empty(size + 2 * SEG, dtype=np.int32), np.empty(size + 2 * SEG, dtype=np.int32),
            np.empty(size + 2 * SEG, dtype=np.int32), np.empty(2, dtype=np.int32), np.empty(2, dtype=np.uint32))


@njit(cache=True, nogil=True)
def encode_units(e, d, beta, rows, cols, tile, row_tiles, col_tiles, k_full, per_chunk, fixed, u0, u1,
                 kc, koff, coff, vals, flats, poss, codes, table, nbits, bad, islot,
                 segmax, gbuf, cand, keys, tmp, found, sc):
    """Error feedback, top-k and (per-chunk table) quantization for work units [u0, u1).

    A unit is a group of up to GROUP_COLS columns of tiles in one band of tile rows, or
    one leftover chunk (1-D tensors, and the right and bottom strips of 2-D ones).
    """
    size = tile * tile
    n_tiles = row_tiles * col_tiles
    left = rows * cols - n_tiles * size
    n_chunks = n_tiles + (left + size - 1) // size
    spr = (tile + SEG - 1) // SEG
    group = max(1, GROUP_COLS // tile)
    gpb = (col_tiles + group - 1) // group
    shift = -1
    if tile & (tile - 1) == 0:
        shift = 0
        while (1 << shift) < tile:
            shift += 1
    hint = np.int32(0)  # the previous tile's k-th largest, lowered: usually still k candidates
    for u in range(u0, u1):
        if u < row_tiles * gpb:
            tr = u // gpb
            tc0 = (u - tr * gpb) * group
            tc1 = min(col_tiles, tc0 + group)
            _ef_rows(e, d, beta, tr * tile, tile, cols, tc0 * tile, tc1 * tile, tile, spr, segmax)
            for tc in range(tc0, tc1):
                c = tr * col_tiles + tc
                base = tr * tile * cols + tc * tile
                _topk(e, base, cols, tile, shift, size, kc[c], segmax, (tc - tc0) * spr, (tc1 - tc0) * spr, spr,
                      hint, cand, keys, tmp, found)
                hint = max(np.int32(0), found[1] - HINT_MARGIN)
                if found[0] >= INF or not _finish_chunk(
                        c, size, kc[c], e, base, cols, shift, cand, found, e, vals, flats, poss, koff[c], codes, coff[c], table,
                        nbits, islot, rows, cols, tile, row_tiles, col_tiles, per_chunk, fixed, keys, sc):
                    bad[c] = 1
        else:
            c = n_tiles + u - row_tiles * gpb
            n = size if c < n_chunks - 1 or left % size == 0 else left % size
            q0 = (c - n_tiles) * size
            if col_tiles == 0:  # a 1-D tensor: the chunk is contiguous
                _ef_span(e[q0:q0 + n], d[q0:q0 + n], beta)
                _segmax_flat(e[q0:q0 + n], n, tile, spr, segmax)
                arr, base = e, q0
            else:
                for p in range(n):
                    f = _leftover_flat(q0 + p, rows, cols, tile, row_tiles, col_tiles)
                    x = e[f] * beta + d[f]
                    e[f] = x
                    gbuf[p] = x
                _segmax_flat(gbuf, n, tile, spr, segmax)
                arr, base = gbuf, 0
            _topk(arr, base, tile, tile, shift, n, kc[c], segmax, 0, spr, spr, np.int32(0), cand, keys, tmp, found)
            if found[0] >= INF or not _finish_chunk(
                    c, n, kc[c], arr, base, tile, shift, cand, found, e, vals, flats, poss, koff[c], codes, coff[c], table,
                    nbits, islot, rows, cols, tile, row_tiles, col_tiles, per_chunk, fixed, keys, sc):
                bad[c] = 1


@njit(cache=True, nogil=True)
def encode_finish(e, rows, cols, tile, row_tiles, col_tiles, per_chunk, fixed,
                  kc, koff, coff, vals, flats, poss, codes, table, nbits, bad, islot):
    """Per-tensor quantizer levels (table per tensor) and the index section, joined from
    the chunks' slots.

    Returns (index bytes, nonfinite flag)."""
    size = tile * tile
    n_tiles = row_tiles * col_tiles
    left = rows * cols - n_tiles * size
    n_chunks = n_tiles + (left + size - 1) // size
    vbits = vals.view(np.uint32)
    nonfinite = bad.any()
    total_k = koff[n_chunks]
    if not per_chunk and n_chunks and not nonfinite:
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
