"""CPU kernels (numba) shared by the codec: chunk geometry, the 2-bit quantizer, index
coding, the frame decoder and the scatter-apply. The fused encoder is in
``encode_kernel.py``.

Both must agree bit for bit with ``sparse_torch.py``; tests compare them. Without numba
the decoder runs as plain Python (slow but correct) and the compressor uses the torch
path.
"""

from __future__ import annotations

import numpy as np

from .intrinsics import HAVE_NUMBA, njit

__all__ = ["HAVE_NUMBA", "njit"]


# Decoder status codes (0 = ok); frame.py turns them into FrameError messages.
OK = 0
ERR_INDEX_TRUNCATED = 1
ERR_UNARY_TOO_LONG = 2
ERR_INDEX_RANGE = 3
ERR_INDEX_ORDER = 4
ERR_INDEX_PADDING = 5
ERR_CODE_PADDING = 6
ERR_SEGMENT_END = 7


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
