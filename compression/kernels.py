"""CPU kernels (numba) shared by the codec: chunk geometry, the 2-bit quantizer, index
coding, the frame decoder and the scatter-apply. The fused encoder is in
``encode_kernel.py``.

Both must agree bit for bit with ``sparse_torch.py``; tests compare them. Without numba
the decoder runs as plain Python (slow but correct) and the compressor uses the torch
path.
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
