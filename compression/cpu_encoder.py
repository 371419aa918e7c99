"""Runs the fused numba encoder over all tensors of a layout on CPU threads.

Work is cut into pieces of about ``PIECE_ELEMS`` elements that the threads pull one at a
time (dynamic scheduling survives a busy machine better than a static split). Two
phases: fused error feedback (written to the spare buffers), selection, quantization and
index bits per piece, then per tensor the table for ``table="tensor"`` and the index
section joined from the chunks' slots. A chunk holding NaN or Inf is flagged, not coded;
the caller then keeps its current buffers, so nothing has changed.
"""

from __future__ import annotations

import threading

import numpy as np

from . import encode_kernel, kernels
from .layout import ChunkGrid
from .threadpool import pieces, run_tasks

PIECE_ELEMS = 1 << 19

_local = threading.local()


def _scratch(tile: int) -> tuple:
    cache = getattr(_local, "scratch", None)
    if cache is None:
        cache = _local.scratch = {}
    if tile not in cache:
        cache[tile] = encode_kernel.scratch(tile)
    return cache[tile]


def first_nonfinite(deltas: list[np.ndarray], n_threads: int) -> int | None:
    """Index of the first delta holding NaN or Inf, or None (only after a failed encode:
    to tell a bad delta from error feedback that overflowed)."""
    bad = [0] * len(deltas)

    def check(j: int, a: int, b: int):
        def run() -> None:
            bad[j] += kernels.count_nonfinite(deltas[j], a, b)
        return run

    run_tasks([check(j, a, b) for j, d in enumerate(deltas) for a, b in pieces(len(d), PIECE_ELEMS)], n_threads)
    return next((j for j, b in enumerate(bad) if b), None)


def make_plans(grids: list[ChunkGrid], k_full: int, per_chunk: bool) -> list[tuple]:
    """Per tensor, the work units and output arrays of ``encode``; a compressor keeps them
    from call to call (every output is rewritten by each call)."""
    return [encode_kernel.encode_plan(g.rows, g.cols, g.tile, g.row_tiles, g.col_tiles, k_full, per_chunk)
            for g in grids]


def encode(errors: list[np.ndarray], deltas: list[np.ndarray], spare: list[np.ndarray], grids: list[ChunkGrid],
           beta: float, k_full: int, per_chunk: bool, fixed: bool, n_threads: int,
           plans: list[tuple] | None = None) -> tuple[list, list, list, list, int | None]:
    """(tables, codes, indices, index bytes per chunk, index of the first tensor holding
    NaN or Inf or None), one entry per tensor. The new error feedback goes to ``spare``;
    ``errors`` are only read. plans: from ``make_plans`` (made here when None)."""
    beta32 = np.float32(beta)
    plans = make_plans(grids, k_full, per_chunk) if plans is None else plans
    prevs, es = errors, spare
    tasks = []
    for j, (g, plan) in enumerate(zip(grids, plans, strict=False)):
        n_units = plan[0]
        for u0, u1 in pieces(n_units, max(1, n_units * PIECE_ELEMS // max(g.numel, 1))):
            tasks.append(_unit_task(prevs[j], deltas[j], beta32, es[j], g, k_full, per_chunk, fixed, u0, u1, plan))
    run_tasks(tasks, n_threads)
    out = [None] * len(grids)

    def finish(j: int):
        def run() -> None:
            g = grids[j]
            out[j] = encode_kernel.encode_finish(es[j], g.rows, g.cols, g.tile, g.row_tiles, g.col_tiles,
                                           per_chunk, fixed, *plans[j][1:])
        return run

    run_tasks([finish(j) for j in range(len(grids))], n_threads)
    bad = next((j for j, (_, nonfinite) in enumerate(out) if nonfinite), None)
    tables = [p[7].tobytes() for p in plans]
    codes = [p[6].tobytes() for p in plans]
    index = [o[0].tobytes() for o in out]
    chunk_bytes = [(p[8] + 7) // 8 for p in plans]
    return tables, codes, index, chunk_bytes, bad


def _unit_task(prev, d, beta32, e, g, k_full, per_chunk, fixed, u0, u1, plan):
    def run() -> None:
        encode_kernel.encode_units(prev, d, beta32, e, g.rows, g.cols, g.tile, g.row_tiles, g.col_tiles, k_full,
                             per_chunk, fixed, u0, u1, *plan[1:], *_scratch(g.tile))
    return run
