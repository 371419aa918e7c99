"""Adds several checked sparse frames into fp32 parameters in one pass (numba): SparseLoCo's
mean over the frames that kept each coordinate (Sarfi et al. 2025, arXiv 2508.15706), or
their weighted sum, with the arithmetic of docs/codec.md ("Several frames at once").

Chunk by chunk: every frame's kept elements of the chunk go into a chunk-sized sum and
count (in L1), frame after frame, read from the frames' checked in-chunk positions (uint16)
and 2-bit codes; then each coordinate that some frame kept is updated once. The frames'
arrays are read through raw addresses, so one compiled kernel takes any number of frames.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from ..layout import CHUNK, FIRST_CODE, FIRST_KEPT, KEPT, TENSOR, tile_shift
from .decode_kernels import _to_flat
from .intrinsics import add_f32_at, load_f32_at, load_u8_at, load_u16_at, prefetch_f32_at

POSITIONS, CODES, LEVELS = range(3)  # columns of ``sources``: addresses of a frame's arrays


@njit(cache=True, nogil=True)
def add_frames(chunks, r0, r1, tile, per_chunk, tab_off, grid, sources, w, a, mean, addrs):
    """For the chunks in rows [r0, r1) of ``chunks`` (``FrameGeometry.chunks``, the same
    for every frame), ``p = p + a * U`` at every coordinate some frame kept, where
    ``U = ((0 + w_0 v_0) + w_1 v_1) + ...`` over the frames that kept it, in frame order,
    each product in fp32, and with ``mean`` then ``U = U / count`` in fp32.

    sources[f] = addresses of frame f's in-chunk positions (uint16), codes (uint8) and
    (hi, lo) levels (fp32); w[f] its weight (fp32); addrs[t] the address of tensor t's
    fp32 parameter data. A chunk's parameter lines are asked for while the previous
    chunk's are written, so the misses overlap."""
    size = tile * tile
    sh = tile_shift(tile)
    u = np.zeros(size, dtype=np.float32)
    count = np.zeros(size, dtype=np.int32)
    lv = np.empty(4, dtype=np.float32)
    cur_at = np.empty(size, dtype=np.int64)
    cur_step = np.empty(size, dtype=np.float32)
    pend_at = np.empty(size, dtype=np.int64)
    pend_step = np.empty(size, dtype=np.float32)
    pend_m = pend_base = 0
    for r in range(r0, r1):
        t, c, k, o, cpos = chunks[r, TENSOR], chunks[r, CHUNK], chunks[r, KEPT], chunks[r, FIRST_KEPT], \
            chunks[r, FIRST_CODE]
        ti = tab_off[t] + (2 * c if per_chunk else 0)
        m = 0  # coordinates of the chunk kept so far, listed in cur_at
        for f in range(sources.shape[0]):
            pa, ca, la = sources[f, POSITIONS], sources[f, CODES], sources[f, LEVELS]
            lo = load_f32_at(la, ti + 1)
            hi = load_f32_at(la, ti)
            lv[0] = lo
            lv[1] = hi
            lv[2] = -lo
            lv[3] = -hi
            wf = w[f]
            for j in range(k):
                p = np.int64(load_u16_at(pa, o + j))
                code = (np.int64(load_u8_at(ca, cpos + (j >> 2))) >> (2 * (j & 3))) & 3
                if count[p] == 0:
                    cur_at[m] = p
                    m += 1
                count[p] += 1
                u[p] += wf * lv[code]
        for q in range(m):
            p = cur_at[q]
            x = u[p] / np.float32(count[p]) if mean else u[p]
            cur_step[q] = x * a
            u[p] = 0.0
            count[p] = 0
        _to_flat(c, cur_at, 0, m, grid[t, 0], grid[t, 1], tile, sh, grid[t, 2], grid[t, 3])
        base = addrs[t]
        for q in range(m):
            prefetch_f32_at(base, cur_at[q])
        for q in range(pend_m):
            add_f32_at(pend_base, pend_at[q], pend_step[q])
        cur_at, pend_at = pend_at, cur_at
        cur_step, pend_step = pend_step, cur_step
        pend_m, pend_base = m, base
    for q in range(pend_m):
        add_f32_at(pend_base, pend_at[q], pend_step[q])
