"""Fused CPU kernels (numba): the whole encoder in one pass per chunk, and the decoder.

The encoder does, per chunk while it sits in cache: error feedback ``e = beta*e + d``,
exact top-k of ``|e|`` (lower position wins ties) by a threshold search on the float bit
patterns followed by a selection among the few candidates, the 2-bit quantizer, ``e -=
decoded``, code packing and index coding. It must produce the same bytes as
``sparse_torch.py``; tests compare the two. Without numba the decoder runs as plain
Python (slow but correct) and the compressor uses the torch path.
"""

from __future__ import annotations

import warnings

import numpy as np

try:
    from numba import njit

    HAVE_NUMBA = True
except ImportError:  # pragma: no cover - exercised only where numba is missing
    HAVE_NUMBA = False
    warnings.warn("numba is not installed: the codec falls back to the (slower) torch path",
                  RuntimeWarning, stacklevel=2)

    def njit(*args, **kwargs):
        if args and callable(args[0]):
            return args[0]
        return lambda f: f


# Decoder status codes (0 = ok); frame.py turns them into FrameError messages.
OK = 0
ERR_INDEX_TRUNCATED = 1
ERR_UNARY_TOO_LONG = 2
ERR_INDEX_RANGE = 3
ERR_INDEX_ORDER = 4
ERR_INDEX_PADDING = 5
ERR_CODE_PADDING = 6
ERR_INDEX_TRAILING = 7


@njit(cache=True, nogil=True)
def _rice_param(n, k):
    if k <= 0:
        return 0
    v = (n - k) * 177 // (k * 256)
    b = 0
    while v > 1:
        v >>= 1
        b += 1
    return b


@njit(cache=True, nogil=True)
def _fixed_width(n):
    v = n - 1
    w = 0
    while v > 0:
        v >>= 1
        w += 1
    return max(1, w)


@njit(cache=True, nogil=True)
def _kept(n, k_full, size):
    return min(n, (k_full * n + size - 1) // size)


@njit(cache=True, nogil=True)
def _leftover_flat(q, rows, cols, tile, row_tiles, col_tiles):
    cw = col_tiles * tile
    if cw == 0:
        return q
    cr = cols - cw
    if q < rows * cr:
        return (q // cr) * cols + cw + q % cr
    q -= rows * cr
    return (row_tiles * tile + q // cw) * cols + q % cw


@njit(cache=True, nogil=True)
def _flat(c, p, rows, cols, tile, row_tiles, col_tiles):
    n_tiles = row_tiles * col_tiles
    if c < n_tiles:
        tr = c // col_tiles
        tc = c - tr * col_tiles
        r = p // tile
        return (tr * tile + r) * cols + tc * tile + (p - r * tile)
    return _leftover_flat((c - n_tiles) * tile * tile + p, rows, cols, tile, row_tiles, col_tiles)


_DEBRUIJN = 0x03F79D71B4CB0A89
_CTZ_TABLE = np.zeros(64, dtype=np.int64)
for _i in range(64):
    _CTZ_TABLE[((_DEBRUIJN << _i) & 0xFFFFFFFFFFFFFFFF) >> 58] = _i


@njit(cache=True, nogil=True)
def _ctz64(x):
    """Trailing zero bits of a nonzero uint64 (de Bruijn multiplication)."""
    low = x & (~x + np.uint64(1))
    return _CTZ_TABLE[(low * np.uint64(_DEBRUIJN)) >> np.uint64(58)]


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
def _select(keys, n, k, guess, cand, ck):
    """Write the sorted positions of the k largest keys[:n] (ties: lower position) into
    cand[:k]; returns the k-th largest key. ck is scratch (n+1)."""
    if k >= n:
        for p in range(n):
            cand[p] = p
        return np.uint32(0)
    cap = 4 * k + 16
    lo = np.int64(0)          # count(keys >= lo) >= k
    hi = np.int64(1) << 31    # count(keys >= hi) < k
    t = np.int64(guess)
    if t <= lo or t >= hi:
        t = (lo + hi) // 2
    tie = False
    while True:
        ut = np.uint32(t)
        cnt = _count_ge(keys[:n], ut)
        if cnt < k:
            hi = t
        elif cnt > cap:
            lo = t
        else:
            break
        if hi - lo <= 1:
            t = lo
            tie = True
            break
        # widen by factors of two while one side is open, else bisect the bit patterns
        if hi == np.int64(1) << 31 and lo + (1 << 23) < hi:
            t = lo + (1 << 23)
        elif lo == 0 and hi > (1 << 23):
            t = hi - (1 << 23)
        else:
            t = (lo + hi) // 2
    ut = np.uint32(t)
    m = 0
    for p in range(n):
        cand[m] = p
        m += keys[p] >= ut
    if tie:
        kth = ut
    else:
        for j in range(m):
            ck[j] = keys[cand[j]]
        kth = _kth_largest(ck, 0, m, k - 1)
    n_gt = 0
    for j in range(m):
        n_gt += keys[cand[j]] > kth
    need = k - n_gt
    w = 0
    for j in range(m):
        kk = keys[cand[j]]
        if kk > kth or (kk == kth and need > 0):
            if kk == kth:
                need -= 1
            cand[w] = cand[j]
            w += 1
    return kth


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
def _ef_row(e, d, beta, out):
    for j in range(e.shape[0]):
        x = e[j] * beta + d[j]
        e[j] = x
        out[j] = x


@njit(cache=True, nogil=True)
def _ef_row_buf(e, d, beta, out):
    for j in range(e.shape[0]):
        out[j] = e[j] * beta + d[j]


@njit(cache=True, nogil=True)
def _abs_keys(bits, keys):
    """keys = |x| bit patterns (ordered like |x|); returns how many are NaN/Inf."""
    bad = 0
    for p in range(bits.shape[0]):
        kb = bits[p] & np.uint32(0x7FFFFFFF)
        keys[p] = kb
        bad += np.int32(kb >= np.uint32(0x7F800000))
    return bad


@njit(cache=True, nogil=True)
def _count_ge(keys, t):
    cnt = np.int32(0)
    for p in range(keys.shape[0]):
        cnt += np.int32(keys[p] >= t)
    return cnt


@njit(cache=True, nogil=True)
def _flag_ge(bits, t, flags):
    """flags[p] = |x[p]| >= t on fp32 bit patterns (vectorizes); returns nonzero on NaN/Inf."""
    nbad = np.int32(0)
    for p in range(bits.shape[0]):
        kb = bits[p] & np.uint32(0x7FFFFFFF)
        nbad |= np.int32(kb >= np.uint32(0x7F800000))
        flags[p] = np.uint8(kb >= t)
    return nbad


@njit(cache=True, nogil=True)
def _flagged(flags, n, out):
    """Write the positions p < n with flags[p] set, in order, into out; returns the count.

    Scans 8 flags at a time and skips empty words."""
    full = n // 8
    f64 = flags[:full * 8].view(np.uint64)
    m = 0
    for w in range(full):
        x = f64[w]
        while x:
            low = x & (~x + np.uint64(1))
            t = 0
            if low >= np.uint64(1 << 32):
                t += 4
                low >>= np.uint64(32)
            if low >= np.uint64(1 << 16):
                t += 2
                low >>= np.uint64(16)
            if low >= np.uint64(1 << 8):
                t += 1
            out[m] = w * 8 + t
            m += 1
            x &= x - np.uint64(1)
    for p in range(full * 8, n):
        if flags[p]:
            out[m] = p
            m += 1
    return m


@njit(cache=True, nogil=True)
def _chunk(c, n, k, buf, keys, kbuf, flags, cand, ck, sc, guess, e, vals, vbits, flats, poss, s, codes, coff,
           table, nbits, bad, rows, cols, tile, row_tiles, col_tiles, per_chunk, fixed, in_buf):
    """Everything after error feedback for chunk c, whose values are in buf[:n]; with
    in_buf the residual goes to buf (the caller writes it back to e), else straight to e."""
    # fast path: flags[p] = |x[p]| >= guess were set during error feedback; exact
    # selection among the flagged candidates when there are enough and not too many
    m = _flagged(flags, n, cand)
    if k < n and k <= m <= 8 * k + 16:
        ck2 = kbuf  # candidate keys in position order (kbuf is free on this path)
        for j in range(m):
            kk = keys[cand[j]] & np.uint32(0x7FFFFFFF)
            ck[j] = kk
            ck2[j] = kk
        kth = _kth_largest(ck, 0, m, k - 1)
        n_gt = 0
        for j in range(m):
            n_gt += ck2[j] > kth
        need = k - n_gt
        w = 0
        for j in range(m):
            kk = ck2[j]
            take = kk > kth or (kk == kth and need > 0)
            need -= kk == kth and need > 0
            cand[w] = cand[j]
            w += take
    else:
        _abs_keys(keys, kbuf[:n])
        kth = _select(kbuf, n, k, guess, cand, ck)
    n_tiles = row_tiles * col_tiles
    if c < n_tiles and (tile & (tile - 1)) == 0:
        tr = c // col_tiles
        base = tr * tile * cols + (c - tr * col_tiles) * tile
        sh = 0
        while (1 << sh) < tile:
            sh += 1
        for j in range(k):
            p = cand[j]
            poss[s + j] = p
            vals[s + j] = buf[p]
            flats[s + j] = base + (p >> sh) * cols + (p & (tile - 1))
    else:
        for j in range(k):
            p = cand[j]
            poss[s + j] = p
            vals[s + j] = buf[p]
            flats[s + j] = _flat(c, p, rows, cols, tile, row_tiles, col_tiles)
    if per_chunk:
        for j in range(k):
            ck[j] = vbits[s + j] & np.uint32(0x7FFFFFFF)
        hi16, lo16 = _levels(ck, k)
        table[2 * c] = hi16
        table[2 * c + 1] = lo16
        if hi16 >= 0x7F80:
            bad[c] = 1
            return guess
        if in_buf:
            _quantize_chunk(buf, vals, vbits, poss, s, k, hi16, lo16, codes, coff, sc)
        else:
            _quantize_chunk(e, vals, vbits, flats, s, k, hi16, lo16, codes, coff, sc)
    if fixed:
        nbits[c] = k * _fixed_width(n)
    else:
        b = _rice_param(n, k)
        tot = k * (1 + b)
        prev = -1
        for j in range(k):
            p = cand[j]
            tot += (p - prev - 1) >> b
            prev = p
        nbits[c] = tot
    return np.int64(kth) - (1 << 20)  # next chunk's guess: about 0.92x this threshold


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
    group = max(1, GROUP_COLS // tile)
    n_units = row_tiles * ((col_tiles + group - 1) // group) + (n_chunks - n_tiles)
    return n_units, kc, koff, coff, vals, flats, poss, codes, table, nbits, bad


GROUP_COLS = 1024  # a work unit spans up to this many columns of one band of tile rows


def scratch(tile: int) -> tuple:
    """Per-thread scratch buffers for ``encode_units``."""
    size = tile * tile
    group = max(1, GROUP_COLS // tile)
    return (np.empty(group * size + 8, dtype=np.float32), np.zeros(group * size + 8, dtype=np.uint8),
            np.empty(size, dtype=np.uint32), np.empty(size + 1, dtype=np.int32),
            np.empty(size + 1, dtype=np.uint32), np.empty(2, dtype=np.uint32))


@njit(cache=True, nogil=True)
def encode_units(e, d, beta, rows, cols, tile, row_tiles, col_tiles, k_full, per_chunk, fixed, u0, u1,
                 kc, koff, coff, vals, flats, poss, codes, table, nbits, bad,
                 gbuf, gflags, kbuf, cand, ck, sc):
    """Error feedback + top-k + (per-chunk) quantization for work units [u0, u1) of a tensor.

    A unit is a group of tiles side by side in one band of tile rows, read row by row so
    that e and d stream contiguously, or one leftover chunk.
    """
    size = tile * tile
    n_tiles = row_tiles * col_tiles
    left = rows * cols - n_tiles * size
    n_chunks = n_tiles + (left + size - 1) // size
    group = max(1, GROUP_COLS // tile)
    gpb = (col_tiles + group - 1) // group
    vbits = vals.view(np.uint32)
    gkeys = gbuf.view(np.uint32)
    guess = np.int64(0)
    for u in range(u0, u1):
        if u < row_tiles * gpb:
            tr = u // gpb
            tc0 = (u - tr * gpb) * group
            tc1 = min(col_tiles, tc0 + group)
            ut = np.uint32(max(guess, 0))
            nbad = np.int32(0)
            for r in range(tile):
                base = (tr * tile + r) * cols
                for tc in range(tc0, tc1):
                    o = (tc - tc0) * size + r * tile
                    f = base + tc * tile
                    _ef_row_buf(e[f:f + tile], d[f:f + tile], beta, gbuf[o:o + tile])
            nbad = _flag_ge(gkeys[:(tc1 - tc0) * size], ut, gflags[:(tc1 - tc0) * size])
            for tc in range(tc0, tc1):
                c = tr * col_tiles + tc
                o = (tc - tc0) * size
                if nbad:
                    bad[c] = 1
                    continue
                g = _chunk(c, size, kc[c], gbuf[o:o + size], gkeys[o:o + size], kbuf, gflags[o:o + size + 8],
                           cand, ck, sc, guess, e, vals, vbits, flats, poss, koff[c], codes, coff[c], table,
                           nbits, bad, rows, cols, tile, row_tiles, col_tiles, per_chunk, fixed, True)
                if tc == tc1 - 1:
                    guess = g
            # write the group (error feedback minus what was sent) back to e, row by row
            for r in range(tile):
                base = (tr * tile + r) * cols
                for tc in range(tc0, tc1):
                    o = (tc - tc0) * size + r * tile
                    f = base + tc * tile
                    e[f:f + tile] = gbuf[o:o + tile]
        else:
            c = n_tiles + u - row_tiles * gpb
            n = size if c < n_chunks - 1 or left % size == 0 else left % size
            q0 = (c - n_tiles) * size
            if col_tiles == 0:
                _ef_row(e[q0:q0 + n], d[q0:q0 + n], beta, gbuf[:n])
            else:
                for p in range(n):
                    f = _leftover_flat(q0 + p, rows, cols, tile, row_tiles, col_tiles)
                    x = e[f] * beta + d[f]
                    e[f] = x
                    gbuf[p] = x
            if _flag_ge(gkeys[:n], np.uint32(max(guess, 0)), gflags[:n]):
                bad[c] = 1
                continue
            guess = _chunk(c, n, kc[c], gbuf[:n], gkeys[:n], kbuf, gflags[:n + 8], cand, ck, sc,
                           guess, e, vals, vbits, flats, poss, koff[c], codes, coff[c], table, nbits,
                           bad, rows, cols, tile, row_tiles, col_tiles, per_chunk, fixed, False)


@njit(cache=True, nogil=True)
def encode_finish(e, rows, cols, tile, row_tiles, col_tiles, per_chunk, fixed,
                  kc, koff, coff, vals, flats, poss, codes, table, nbits, bad):
    """Per-tensor quantizer levels (table per tensor) and the index section.

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
        n = size if c < n_chunks - 1 or left % size == 0 else left % size
        _write_index(index, ioff[c], poss, koff[c], kc[c], n, fixed)
    return index, False


@njit(cache=True, nogil=True)
def _write_index(out, o, poss, s, k, n, fixed):
    acc = np.uint64(0)
    nacc = 0
    if fixed:
        w = _fixed_width(n)
        for j in range(k):
            acc |= np.uint64(poss[s + j]) << np.uint64(nacc)
            nacc += w
            while nacc >= 8:
                out[o] = np.uint8(acc & np.uint64(255))
                o += 1
                acc >>= np.uint64(8)
                nacc -= 8
    else:
        b = _rice_param(n, k)
        prev = -1
        for j in range(k):
            g = poss[s + j] - prev - 1
            prev = poss[s + j]
            nacc += g >> b
            while nacc >= 8:
                out[o] = np.uint8(acc & np.uint64(255))
                o += 1
                acc >>= np.uint64(8)
                nacc -= 8
            acc |= np.uint64(((g & ((1 << b) - 1)) << 1) | 1) << np.uint64(nacc)
            nacc += b + 1
            while nacc >= 8:
                out[o] = np.uint8(acc & np.uint64(255))
                o += 1
                acc >>= np.uint64(8)
                nacc -= 8
    if nacc > 0:
        out[o] = np.uint8(acc & np.uint64(255))


@njit(cache=True, nogil=True)
def decode_tensor(index, ipos, iend, codes, cpos, table, per_chunk,
                  rows, cols, tile, row_tiles, col_tiles, k_full, fixed, out_flat, out_val):
    """Decode one tensor's positions and codes. ``table`` holds fp32 (hi, lo) pairs.

    Returns (status, chunk, next index byte, next code byte). Never reads outside
    ``index[ipos:iend]``; the caller checks ``codes`` and ``out_*`` sizes.
    """
    size = tile * tile
    numel = rows * cols
    n_tiles = row_tiles * col_tiles
    left = numel - n_tiles * size
    n_chunks = n_tiles + (left + size - 1) // size
    pow2 = (tile & (tile - 1)) == 0
    sh = 0
    while (1 << sh) < tile:
        sh += 1
    lv = np.empty(4, dtype=np.float32)
    o = 0
    for c in range(n_chunks):
        n = size if c < n_chunks - 1 or left % size == 0 else left % size
        k = _kept(n, k_full, size)
        hi = table[2 * c] if per_chunk else table[0]
        lo = table[2 * c + 1] if per_chunk else table[1]
        # positions
        acc = np.uint64(0)
        nacc = 0
        prev = -1
        if fixed:
            w = _fixed_width(n)
            for j in range(k):
                while nacc < w:
                    if ipos >= iend:
                        return ERR_INDEX_TRUNCATED, c, ipos, cpos
                    acc |= np.uint64(index[ipos]) << np.uint64(nacc)
                    ipos += 1
                    nacc += 8
                p = np.int64(acc & np.uint64((1 << w) - 1))
                acc >>= np.uint64(w)
                nacc -= w
                if p >= n:
                    return ERR_INDEX_RANGE, c, ipos, cpos
                if p <= prev:
                    return ERR_INDEX_ORDER, c, ipos, cpos
                prev = p
                out_flat[o + j] = p
        else:
            b = _rice_param(n, k)
            qmax = (n - 1) >> b
            rmask = np.uint64((1 << b) - 1)
            for j in range(k):
                while nacc <= 56 and ipos < iend:
                    acc |= np.uint64(index[ipos]) << np.uint64(nacc)
                    ipos += 1
                    nacc += 8
                q = 0
                while acc == 0:  # a unary run longer than the buffer (rare): consume and refill
                    q += nacc
                    nacc = 0
                    if q > qmax:
                        return ERR_UNARY_TOO_LONG, c, ipos, cpos
                    if ipos >= iend:
                        return ERR_INDEX_TRUNCATED, c, ipos, cpos
                    while nacc <= 56 and ipos < iend:
                        acc |= np.uint64(index[ipos]) << np.uint64(nacc)
                        ipos += 1
                        nacc += 8
                z = _ctz64(acc)
                q += z
                if q > qmax:
                    return ERR_UNARY_TOO_LONG, c, ipos, cpos
                acc = (acc >> np.uint64(z)) >> np.uint64(1)
                nacc -= z + 1
                if nacc < b:
                    while nacc <= 56 and ipos < iend:
                        acc |= np.uint64(index[ipos]) << np.uint64(nacc)
                        ipos += 1
                        nacc += 8
                    if nacc < b:
                        return ERR_INDEX_TRUNCATED, c, ipos, cpos
                r = np.int64(acc & rmask)
                acc >>= np.uint64(b)
                nacc -= b
                p = prev + 1 + (q << b) + r
                if p >= n:
                    return ERR_INDEX_RANGE, c, ipos, cpos
                prev = p
                out_flat[o + j] = p
        # padding: the bits left in the last byte read must be zero; whole unread bytes go back
        if acc & np.uint64((1 << (nacc % 8)) - 1):
            return ERR_INDEX_PADDING, c, ipos, cpos
        ipos -= nacc // 8
        # values, and in-chunk positions -> flat indices
        lv[0] = lo
        lv[1] = hi
        lv[2] = -lo
        lv[3] = -hi
        for j in range(k):
            out_val[o + j] = lv[(np.int64(codes[cpos + (j >> 2)]) >> (2 * (j & 3))) & 3]
        if c < n_tiles and pow2:
            tr = c // col_tiles
            base = tr * tile * cols + (c - tr * col_tiles) * tile
            for j in range(k):
                p = out_flat[o + j]
                out_flat[o + j] = base + (p >> sh) * cols + (p & (tile - 1))
        else:
            for j in range(k):
                out_flat[o + j] = _flat(c, out_flat[o + j], rows, cols, tile, row_tiles, col_tiles)
        if k % 4 and codes[cpos + k // 4] >> np.uint8(2 * (k % 4)):
            return ERR_CODE_PADDING, c, ipos, cpos
        cpos += (k + 3) // 4
        o += k
    return OK, n_chunks, ipos, cpos


@njit(cache=True, nogil=True)
def count_nonfinite(x, start, stop):
    """How many of the fp32 values x[start:stop] are NaN or Inf."""
    bits = x[start:stop].view(np.uint32)
    bad = 0
    for i in range(bits.shape[0]):
        bad += (bits[i] & np.uint32(0x7F800000)) == np.uint32(0x7F800000)
    return bad


@njit(cache=True, nogil=True)
def scatter_add(p, idx, step, start, stop):
    """p[idx[j]] += step[j] for j in [start, stop) (fp32; indices unique)."""
    for j in range(start, stop):
        p[idx[j]] += step[j]


@njit(cache=True, nogil=True)
def scatter_scaled(p, idx, v, w, a, start, stop):
    """p[idx[j]] = p[idx[j]] + a * (w * v[j]) in fp32 for j in [start, stop) (indices unique):
    the same bits as ``apply_frames``' general path for a single frame."""
    for j in range(start, stop):
        i = idx[j]
        p[i] = p[i] + a * (w * v[j])



@njit(cache=True, nogil=True)
def decode_all(index, codes, levels, per_chunk, fixed, k_full, tile, grid, kept_off, tab_off, out_flat, out_val):
    """Decode every tensor of a sparse frame in one call. grid[t] = (rows, cols, row_tiles,
    col_tiles); tensor t's outputs go to out_*[kept_off[t]:kept_off[t+1]] and its table is
    levels[tab_off[t]:tab_off[t+1]]. Returns (status, tensor, chunk, index bytes used)."""
    ipos = 0
    cpos = 0
    iend = index.shape[0]
    for t in range(grid.shape[0]):
        k0 = kept_off[t]
        k1 = kept_off[t + 1]
        if k1 == k0:
            continue
        status, c, ipos, cpos = decode_tensor(
            index, ipos, iend, codes, cpos, levels[tab_off[t]:tab_off[t + 1]], per_chunk,
            grid[t, 0], grid[t, 1], tile, grid[t, 2], grid[t, 3], k_full, fixed,
            out_flat[k0:k1], out_val[k0:k1])
        if status != OK:
            return status, t, c, ipos
    return OK, grid.shape[0], 0, ipos
