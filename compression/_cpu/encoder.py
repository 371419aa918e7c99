"""Runs the fused numba encoder (``encode_kernels``) over the tensors of a layout on CPU
threads, with the error feedback double-buffered (docs/codec.md, "Algorithm").

Work is cut into pieces of about ``PIECE_ELEMS`` elements that the threads pull one at a
time (dynamic scheduling survives a busy machine better than a static split). Two
phases: fused error feedback (written to the spare buffers), selection, quantization and
index bits per piece, then per tensor the table for ``table="tensor"`` and the index
section joined from the chunks' slots. A chunk holding NaN or Inf is flagged, not coded;
the current buffers are then kept, so nothing has changed.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np
import torch

from ..backend import Encoded, NotFinite
from ..layout import ChunkGrid
from ..threads import codec_threads
from .encode_kernels import (
    EncodePlan,
    count_nonfinite,
    encode_finish,
    encode_plan,
    encode_units,
    scratch,
)
from .threadpool import pieces, run_tasks

PIECE_ELEMS = 1 << 19

_local = threading.local()


def _scratch(tile: int) -> tuple:
    """This thread's Scratch for the tile, made once (as the kernels take it, a plain tuple)."""
    cache = getattr(_local, "scratch", None)
    if cache is None:
        cache = _local.scratch = {}
    if tile not in cache:
        cache[tile] = tuple(scratch(tile))
    return cache[tile]


class NumbaEncoder:
    """Encodes CPU error feedback: each call reads the current buffers and writes the next
    state into spare ones, returned as the new state (the old ones become the spares), so
    that a NaN or Inf leaves the state as it was. It keeps its output arrays, and the
    numpy views of the buffers, from call to call. After a call the spares hold the state
    before it, untouched until the next call."""

    in_place = False

    def __init__(self, grids: Sequence[ChunkGrid], k_full: int, per_chunk: bool, fixed: bool) -> None:
        self.grids = list(grids)
        self.plans: list[EncodePlan] = [encode_plan(*g.dims, k_full, per_chunk, fixed) for g in self.grids]
        self._plan_tuples = [tuple(p) for p in self.plans]  # as the kernels take them
        self._spare: list[torch.Tensor] | None = None
        self._views: dict[int, tuple[torch.Tensor, np.ndarray]] = {}

    def _numpy(self, t: torch.Tensor) -> np.ndarray:
        """t.numpy() for an error-feedback buffer, made once per buffer."""
        view = self._views.get(id(t))
        if view is None or view[0] is not t:
            if len(self._views) > 4 * len(self.grids):  # buffers replaced (a loaded state): forget the old ones
                self._views.clear()
            view = self._views[id(t)] = (t, t.numpy())
        return view[1]

    def spares(self, errors: list[torch.Tensor]) -> list[torch.Tensor]:
        """The buffers the next ``encode`` of ``errors`` writes the new state into. They may
        be passed to it as its deltas: each element of the error feedback is read from
        ``errors`` and the delta, then written, before any other (``Compressor.compress_aggregate``)."""
        if self._spare is None:
            self._spare = [torch.empty_like(e) for e in errors]
        return self._spare

    def encode(self, errors: list[torch.Tensor], deltas: list[torch.Tensor], beta: float) -> Encoded:
        arrays = [d.contiguous().numpy() for d in deltas]
        spare = self.spares(errors)
        n_threads = codec_threads()
        tables, codes, index, chunk_bytes, bad = run_encode(
            [self._numpy(e) for e in errors], arrays, [self._numpy(e) for e in spare], beta, n_threads, self.plans,
            self._plan_tuples)
        if bad is not None:
            delta = first_nonfinite(arrays, n_threads)
            raise NotFinite(bad if delta is None else delta, in_delta=delta is not None)
        self._spare = list(errors)
        joined = np.concatenate(chunk_bytes) if chunk_bytes else np.zeros(0, np.int64)
        return Encoded(spare, b"".join(tables), b"".join(codes), b"".join(index), joined)


    def encode_pass(self, errors: list[torch.Tensor]) -> Encoded:
        """One more pass over ``errors`` with no new input, in place: ``e`` stays ``e``
        (``0*e + e``, exact), then its top-k and ``e -= decoded`` as ``encode`` does, written
        back into ``errors``. The spares, and the state before the last ``encode`` they hold,
        are not touched (the kernels read each element before they write it)."""
        arrays = [self._numpy(e) for e in errors]
        tables, codes, index, chunk_bytes, bad = run_encode(arrays, arrays, arrays, 0.0, codec_threads(), self.plans,
                                                            self._plan_tuples)
        if bad is not None:  # finite in, so finite out: a pass adds nothing
            raise NotFinite(bad, in_delta=False)
        joined = np.concatenate(chunk_bytes) if chunk_bytes else np.zeros(0, np.int64)
        return Encoded(list(errors), b"".join(tables), b"".join(codes), b"".join(index), joined)


def first_nonfinite(deltas: list[np.ndarray], n_threads: int) -> int | None:
    """Index of the first delta holding NaN or Inf, or None (only after a failed encode:
    to tell a bad delta from error feedback that overflowed)."""
    bad = [0] * len(deltas)

    def check(j: int, a: int, b: int):
        def run() -> None:
            bad[j] += count_nonfinite(deltas[j], a, b)
        return run

    run_tasks([check(j, a, b) for j, d in enumerate(deltas) for a, b in pieces(len(d), PIECE_ELEMS)], n_threads)
    return next((j for j, b in enumerate(bad) if b), None)


def run_encode(errors: list[np.ndarray], deltas: list[np.ndarray], spare: list[np.ndarray], beta: float,
               n_threads: int, plans: list[EncodePlan], plan_tuples: list[tuple]) -> tuple[list, list, list, list, int | None]:
    """(tables, codes, indices, index bytes per chunk, index of the first tensor holding
    NaN or Inf or None), one entry per tensor. The new error feedback goes to ``spare``;
    ``errors`` are only read. plan_tuples: the plans as the kernels take them."""
    beta32 = np.float32(beta)
    tasks = []
    for j, plan in enumerate(plans):
        numel = plan.rows * plan.cols
        for u0, u1 in pieces(plan.n_units, max(1, plan.n_units * PIECE_ELEMS // max(numel, 1))):
            tasks.append(_unit_task(errors[j], deltas[j], beta32, spare[j], plan_tuples[j], plan.tile, u0, u1))
    run_tasks(tasks, n_threads)
    out = [None] * len(plans)

    def finish(j: int):
        def run() -> None:
            out[j] = encode_finish(spare[j], plan_tuples[j])
        return run

    run_tasks([finish(j) for j in range(len(plans))], n_threads)
    bad = next((j for j, (_, nonfinite) in enumerate(out) if nonfinite), None)
    tables = [p.table.tobytes() for p in plans]
    codes = [p.codes.tobytes() for p in plans]
    index = [o[0].tobytes() for o in out]
    chunk_bytes = [(p.nbits + 7) // 8 for p in plans]
    return tables, codes, index, chunk_bytes, bad


def _unit_task(prev, d, beta32, e, plan: tuple, tile: int, u0: int, u1: int):
    def run() -> None:
        encode_units(prev, d, beta32, e, plan, u0, u1, _scratch(tile))
    return run
