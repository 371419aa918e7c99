"""Runs the segment decoder (``decode_kernels``) over a sparse frame on the codec threads:
check it, decode it, add it into fp32 CPU parameters, or check and add it in one pass and
put everything back when it turns out bad (docs/codec.md, "Validate and apply in one pass").
A checked frame holds its bytes, not its decoded positions: several frames are added at
once from their bytes, a slab of segments at a time (docs/codec.md, "Several frames at once").
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import numpy as np
import torch

from ..format import (
    CRC_BYTES,
    CRC_MISMATCH,
    HEADER_BYTES,
    OK,
    FrameError,
    SparseSections,
    crc_matches,
    index_error,
    table_error,
)
from ..layout import SEGMENT_CHUNKS, TENSOR, FrameGeometry, Layout
from ..threads import codec_threads
from .decode_kernels import (
    APPLY,
    CHECK,
    CHECK_APPLY,
    INDEX_PAD,
    MATERIALIZE,
    POSITIONS,
    RESTORE,
    VALIDATE,
    VALUES,
    ApplyArrays,
    FrameArrays,
    check_segments,
    code_magnitudes,
    decode_segments,
    prepare,
    scatter_add,
    wait_flag,
)
from .merge_kernels import add_frames as merge_chunks
from .threadpool import pieces, run_tasks, submit

SEGMENTS_PER_TASK = 8  # decoding work handed to a thread at a time (8 x 64 chunks)
SCATTER_PIECE = 1 << 16  # kept elements per task of add_at's scatter
MERGE_CHUNKS = 256  # chunks per task of add_frames (1 M parameters at 64 x 64 tiles)
# decoded positions add_frames holds at once, all frames together: the model is added a slab
# of segments at a time, each frame's positions of the slab decoded from its bytes first
SLAB_BYTES = 8 << 20

_EMPTY_I64 = np.zeros(0, dtype=np.int64)
_EMPTY_F32 = np.zeros(0, dtype=np.float32)
_NO_POSITIONS = np.zeros(0, dtype=np.uint16)
NO_APPLY = ApplyArrays(_EMPTY_I64, np.float32(1), np.float32(1), _EMPTY_I64, _EMPTY_F32, _EMPTY_I64, _EMPTY_I64)
_NO_APPLY = tuple(NO_APPLY)  # as the kernels take it


class NumbaBody:
    """A checked sparse frame: its sections as the kernels read them (views of its bytes).
    Its decoded positions are made only for what needs them all at once (``materialize``,
    a one-frame ``add_into``), and kept from then on."""

    def __init__(self, fa: FrameArrays, geometry: FrameGeometry) -> None:
        self.fa = fa
        self._fa = tuple(fa)  # as the kernels take it
        self.geometry = geometry
        self.kept = geometry.kept
        self.ready = False  # fa.positions holds every kept element's position (VALIDATE)

    def materialize(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        flat = np.empty(self.kept, dtype=self.geometry.index_dtype)
        vals = np.empty(self.kept, dtype=np.float32)
        self._run(MATERIALIZE, flat, vals)
        flat_t, vals_t = torch.from_numpy(flat).long(), torch.from_numpy(vals)
        bounds = self.geometry.kept_off.tolist()
        return ([flat_t[a:b] for a, b in zip(bounds, bounds[1:], strict=False)],
                [vals_t[a:b] for a, b in zip(bounds, bounds[1:], strict=False)])

    def kept_values(self) -> list[torch.Tensor]:
        vals = np.empty(self.kept, dtype=np.float32)
        self._run(VALUES, out_val=vals)
        vals_t, bounds = torch.from_numpy(vals), self.geometry.kept_off.tolist()
        return [vals_t[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]

    def magnitudes(self) -> tuple[float, float]:
        out = np.zeros(2, dtype=np.float64)
        code_magnitudes(self._fa, out)
        return float(out[0]) ** 0.5, float(out[1])

    def add_into(self, params: Sequence[torch.Tensor], weight: float, alpha: float) -> bool:
        """APPLY: from the kept positions where the frame has them, else decoded a slab of
        segments at a time and not kept (the same arithmetic, element by element)."""
        addrs = cpu_addresses(self.geometry.layout, params)
        if addrs is None:
            return False
        ap = tuple(NO_APPLY._replace(addrs=addrs, w=np.float32(weight), a=np.float32(alpha)))
        with torch.no_grad():  # params stay alive (held by the caller) while the kernel writes
            if self.ready:
                self._run(APPLY, ap=ap)
            else:
                self._apply_by_slabs(ap)
        return True

    def _apply_by_slabs(self, ap: tuple) -> None:
        """APPLY over the segments a slab at a time (SLAB_BYTES of positions): each task
        decodes its segments' positions from the bytes into the slab's room, then adds
        them, so that a frame applied once (the coordinator's own) never holds all its
        positions (2 bytes a kept element: 62 MB for a 25 % frame of GPT-2's 124 M)."""
        seg_start = self.geometry.seg_start
        n_seg = len(seg_start)
        if n_seg == 0:
            return
        seg_kept = max(1, int(np.diff(seg_start[:, 2], append=self.kept).max()))
        slab = max(SEGMENTS_PER_TASK, SLAB_BYTES // (2 * seg_kept))
        room = np.empty(min(slab, n_seg) * seg_kept, dtype=np.uint16)
        for s0 in range(0, n_seg, slab):
            s1 = min(n_seg, s0 + slab)
            ranges = [(s0 + a, s0 + b) for a, b in pieces(s1 - s0, SEGMENTS_PER_TASK)]
            results = np.zeros((len(ranges), 4), dtype=np.int64)

            def task(i: int, a: int, b: int, s0: int = s0, results: np.ndarray = results):
                def run() -> None:
                    at = int(seg_start[a, 2] - seg_start[s0, 2])
                    fa = self.slab_positions(a, b, room[at:])
                    decode_segments(APPLY, fa, a, b, _EMPTY_I64, _EMPTY_F32, ap, results[i])
                return run

            run_tasks([task(i, a, b) for i, (a, b) in enumerate(ranges)], codec_threads())
            if (results[:, 0] != OK).any():  # checked already: cannot happen
                raise AssertionError(f"applying a checked frame failed: {results}")

    def positions(self) -> np.ndarray:
        """The in-chunk position of every kept element (uint16), decoded once more on first
        use (a check keeps none) and kept."""
        if not self.ready:
            self.fa = self.fa._replace(positions=np.empty(self.kept, dtype=np.uint16))
            self._fa = tuple(self.fa)
            if self.check(VALIDATE) is not None:
                raise AssertionError("validating a checked frame failed")
        return self.fa.positions

    def slab_positions(self, s0: int, s1: int, out: np.ndarray) -> tuple:
        """The in-chunk positions of segments [s0, s1)'s kept elements into ``out`` (uint16,
        from the slab's first kept element), decoded from the bytes and checked again.
        Returns the frame's arrays as the kernels take them for those segments, reading
        their positions from ``out``."""
        geo = self.geometry
        seg_start = geo.seg_start[:s1].copy()
        seg_start[:, 2] -= geo.seg_start[s0, 2]
        seg_start.setflags(write=False)  # the type the kernels were compiled for
        fa = self.fa._replace(seg_start=seg_start, positions=out)
        problems = np.zeros((s1, 4), dtype=np.int64)
        check_segments(POSITIONS, tuple(fa), np.array([s0, 0], dtype=np.int64), False, _NO_APPLY, problems)
        if (problems[s0:, 0] != OK).any():  # checked already, and bytes do not change
            raise AssertionError(f"decoding a checked frame failed: {problems[s0:][problems[s0:, 0] != OK][0]}")
        return tuple(fa)

    def _run(self, mode: int, out_flat=_EMPTY_I64, out_val=_EMPTY_F32, ap: tuple = _NO_APPLY) -> None:
        """MATERIALIZE, APPLY, VALUES or RESTORE over all segments, in pieces on the codec
        threads (ap: ApplyArrays as a tuple)."""
        if mode in (MATERIALIZE, APPLY):
            self.positions()
        ranges = pieces(len(self.fa.seg_start), SEGMENTS_PER_TASK) if len(self.fa.seg_start) else []
        results = np.zeros((len(ranges), 4), dtype=np.int64)

        def task(i: int, s0: int, s1: int):
            def run() -> None:
                decode_segments(mode, self._fa, s0, s1, out_flat, out_val, ap, results[i])
            return run

        run_tasks([task(i, s0, s1) for i, (s0, s1) in enumerate(ranges)], codec_threads())
        if (results[:, 0] != OK).any():  # checked already: cannot happen
            raise AssertionError(f"decoding a checked frame failed: {results}")

    def check(self, mode: int, ap: tuple = _NO_APPLY, helper: _Helper | None = None) -> tuple | None:
        """VALIDATE, CHECK or CHECK_APPLY: ``check_segments`` on this thread and on the pool's,
        sharing out the segments; this thread's call returns once every segment is done,
        without waiting for a pool thread that had nothing left to do. helper: a waiting
        pool thread to take one thread's share; ap: ApplyArrays as a tuple. Returns the first segment's problem
        (status, tensor, chunk, segment), or None."""
        n_threads = max(1, min(codec_threads(), -(-len(self.fa.seg_start) // 2)))
        problems = np.zeros((len(self.fa.seg_start), 4), dtype=np.int64)
        shared = np.zeros(2, dtype=np.int64)  # next segment, threads at work

        def task(wait: bool) -> None:
            check_segments(mode, self._fa, shared, wait, ap, problems)

        others = n_threads - 1
        if others and helper is not None and helper.hand(lambda: task(False)):
            others -= 1
        for _ in range(others):
            submit(lambda: task(False), n_threads)
        task(True)
        if mode == VALIDATE:
            self.ready = True
        bad = np.flatnonzero(problems[:, 0] != OK)
        return tuple(int(x) for x in problems[bad[0]]) if len(bad) else None


class ApplyTarget:
    """fp32 CPU parameters to add a frame into while it is checked (``ApplyInto``), and the
    pool thread that checks the checksum meanwhile."""

    def __init__(self, data: bytes, addrs: np.ndarray, weight: float, alpha: float) -> None:
        self.data = data
        self.addrs, self.w, self.a = addrs, np.float32(weight), np.float32(alpha)
        long_enough = len(data) >= HEADER_BYTES + CRC_BYTES
        self.helper = _Helper(data, codec_threads()) if long_enough else None

    def checksum_ok(self) -> bool:
        return self.helper.result() if self.helper is not None else crc_matches(self.data)

    def release(self) -> None:
        if self.helper is not None:
            self.helper.release()


class _Helper:
    """A pool thread taken at the top of ``decode_apply``: it checks the frame's checksum
    while the caller reads the frame, then waits (spinning outside the GIL, for about a
    millisecond at most) to be handed its share of the checking and adding, so that
    neither its wake-up nor the checksum is on the way. ``result`` is the checksum's
    verdict (computed here if the helper has not got to it)."""

    GO, STOP = 1, 2
    POLLS = 2_000_000

    def __init__(self, data: bytes, n_threads: int) -> None:
        self.data = data
        self.ok: bool | None = None
        self.flag = np.zeros(1, dtype=np.int64)
        self.work = None
        self.running = n_threads > 1
        if self.running:
            submit(self._run, n_threads)

    def _run(self) -> None:
        self.compute()
        if wait_flag(self.flag, self.POLLS) == self.GO and self.work is not None:
            self.work()

    def compute(self) -> None:
        if self.ok is None:
            self.ok = crc_matches(self.data)

    def result(self) -> bool:
        self.compute()
        return bool(self.ok)

    def hand(self, work) -> bool:
        """Give the helper work (False when there is no helper thread)."""
        if not self.running:
            return False
        self.work = work
        self.flag[0] = self.GO
        return True

    def release(self) -> None:
        if self.flag[0] == 0:
            self.flag[0] = self.STOP


def decode(sections: SparseSections, into: ApplyTarget | None = None, keep_positions: bool = False) -> NumbaBody:
    """Check (and with ``into``, add in) a sparse frame; FrameError on the first problem,
    with the params then as they were. keep_positions: the body keeps the decoded positions
    (not with ``into``: that frame is applied)."""
    geo = sections.geometry
    body = NumbaBody(frame_arrays(sections), geo)
    if into is None and keep_positions:
        body.fa = body.fa._replace(positions=np.empty(geo.kept, dtype=np.uint16))
        body._fa = tuple(body.fa)
        problem = body.check(VALIDATE)
    elif into is None:
        problem = body.check(CHECK)
    else:
        n_seg = len(geo.seg_start)
        ap = (into.addrs, into.w, into.a, *_log_buffers(geo.kept), np.zeros(n_seg, dtype=np.int64),
              geo.seg_start[:, 2].copy())  # ApplyArrays, nothing applied yet
        problem = body.check(CHECK_APPLY, ap, into.helper)
        if problem is not None or not into.checksum_ok():
            body._run(RESTORE, ap=ap)
            if problem is None:
                raise FrameError(CRC_MISMATCH)
    if problem is not None:
        raise index_error(geo, *problem)
    return body


def frame_arrays(sections: SparseSections) -> FrameArrays:
    """The sections as the kernels read them, after ``prepare``'s checks of the table and
    the offsets (raised as FrameError)."""
    geo = sections.geometry
    offsets = np.empty(len(geo.seg_start) + 1, dtype=np.int64)
    levels = np.empty(len(sections.table) // 2, dtype=np.float32)
    status, s, v, w = prepare(np.frombuffer(sections.table, np.uint8), np.frombuffer(sections.offsets, np.uint8),
                              len(sections.index), levels, offsets)
    if status != OK:
        raise table_error(status, s, v, w)
    return FrameArrays(_index_buffer(sections), len(sections.index), offsets, np.frombuffer(sections.codes, np.uint8),
                       levels, geo.per_chunk, geo.fixed, geo.k_full, geo.tile, geo.grid, geo.n_chunks, geo.tab_off,
                       geo.seg_start, _NO_POSITIONS)


def _index_buffer(sections: SparseSections) -> np.ndarray:
    """The index section as the kernels read it, followed by INDEX_PAD readable bytes
    (their 64-bit loads may reach past the last code; bits past the section are never
    used but to report a problem). A raw section is read in place: the offsets section
    and the checksum follow it in the frame. A decompressed one is copied, zeros after it."""
    data, n, at = sections.data, len(sections.index), sections.index_at
    if at >= 0 and at + n + INDEX_PAD <= len(data):
        return np.frombuffer(data, np.uint8, count=n + INDEX_PAD, offset=at)
    buf = np.zeros(n + INDEX_PAD, dtype=np.uint8)
    buf[:n] = np.frombuffer(sections.index, np.uint8)
    buf.setflags(write=False)  # one array type for the kernels either way
    return buf


_local = threading.local()


def _log_buffers(n: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-thread room for n entries of CHECK_APPLY's log (addresses, old values), kept
    between calls; rarely written, so mostly never touched."""
    bufs = getattr(_local, "log", None)
    if bufs is None or len(bufs[0]) < n:
        bufs = _local.log = (np.empty(max(n, 1024), dtype=np.int64), np.empty(max(n, 1024), dtype=np.float32))
    return bufs[0][:n], bufs[1][:n]


def cpu_addresses(layout: Layout, params: Sequence[torch.Tensor]) -> np.ndarray | None:
    """Data addresses of fp32 contiguous CPU params for the kernels, or None when a param
    does not qualify."""
    addrs = []
    f32 = torch.float32
    for spec, p in zip(layout.specs, params, strict=False):  # the cheapest tensor attributes there are
        if p.shape != spec.shape:
            raise ValueError(f"param {spec.name!r} has shape {tuple(p.shape)}, layout says {spec.shape}")
        if not (p.is_cpu and p.dtype is f32 and p.is_contiguous()):
            return None
        addrs.append(p.data_ptr())
    return np.array(addrs, dtype=np.int64)


def add_at(updates: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> None:
    """``p.view(-1)[idx] += step``: CPU params on the codec threads, others with torch."""
    tasks = []
    for p, idx, step in updates:
        if p.is_cpu:
            arr, ia, sa = p.detach().view(-1).numpy(), idx.numpy(), step.numpy()
            tasks += [_scatter_task(arr, ia, sa, a, b) for a, b in pieces(len(idx), SCATTER_PIECE)]
        else:
            p.view(-1).index_add_(0, idx, step)
    if tasks:
        run_tasks(tasks, codec_threads())


def add_frames(layout: Layout, params: Sequence[torch.Tensor], bodies: Sequence, weights: Sequence[float],
               mode: str, alpha: float, on_final: Callable[[int], None] | None = None) -> bool:
    """``apply_frames`` of several sparse frames into fp32 contiguous CPU params in one pass
    (``merge_kernels.add_frames``); False (nothing done) where the params or frames do not
    allow it: a body of another backend, or frames of other tiles, k or table modes.

    The frames' positions are decoded from their bytes a slab of segments at a time
    (SLAB_BYTES of positions for all frames together; a frame that keeps its positions
    already is read from them), and the slab is added before the next one is decoded; then
    ``on_final(j)`` says the first j params are done (frame order is tensor order)."""
    if not bodies or not all(isinstance(b, NumbaBody) for b in bodies):
        return False
    geo = bodies[0].geometry
    if geo.layout != layout or any((b.geometry.layout, b.geometry.tile, b.geometry.k_full, b.geometry.per_chunk)
                                   != (layout, geo.tile, geo.k_full, geo.per_chunk) for b in bodies):
        return False
    addrs = cpu_addresses(layout, params)
    if addrs is None:
        return False
    if geo.kept == 0:
        return True
    sources = np.array([[0, _address(b.fa.codes), _address(b.fa.levels)] for b in bodies], dtype=np.int64)
    w, a = np.array(weights, dtype=np.float32), np.float32(alpha)
    mean, chunks, seg_start = mode == "mean_kept", geo.chunks, geo.seg_start
    n_seg = len(seg_start)
    decoding = [f for f, b in enumerate(bodies) if not b.ready]
    for f, b in enumerate(bodies):
        if b.ready:
            sources[f, 0] = _address(b.fa.positions)
    seg_kept = int(np.diff(seg_start[:, 2], append=geo.kept).max())  # kept elements of a segment, at most
    slab = max(1, SLAB_BYTES // (2 * seg_kept * len(decoding))) if decoding else n_seg
    room = np.empty((len(decoding), min(slab, n_seg) * seg_kept), dtype=np.uint16)

    def decode_task(i: int, f: int, s0: int, s1: int):
        def run() -> None:
            bodies[f].slab_positions(s0, s1, room[i])
        return run

    def merge_task(r0: int, r1: int, slab_sources: np.ndarray):
        def run() -> None:
            merge_chunks(chunks, r0, r1, geo.tile, geo.per_chunk, geo.tab_off, geo.grid, slab_sources, w, a, mean,
                         addrs)
        return run

    with torch.no_grad():  # params and bodies stay alive (held here) while the kernels read and write
        for s0 in range(0, n_seg, slab):
            s1 = min(s0 + slab, n_seg)
            slab_sources = sources.copy()
            for i, f in enumerate(decoding):  # positions at kept element o are at room[i][o - first kept]
                slab_sources[f, 0] = _address(room[i]) - 2 * int(seg_start[s0, 2])
            run_tasks([decode_task(i, f, s0, s1) for i, f in enumerate(decoding)], codec_threads())
            rows = (s0 * SEGMENT_CHUNKS, min(s1 * SEGMENT_CHUNKS, len(chunks)))
            run_tasks([merge_task(rows[0] + r0, rows[0] + r1, slab_sources)
                       for r0, r1 in pieces(rows[1] - rows[0], MERGE_CHUNKS)], codec_threads())
            if on_final is not None and rows[1] < len(chunks):
                on_final(int(chunks[rows[1], TENSOR]))  # the tensors before the next chunk's
    return True


def _address(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def _scatter_task(arr, idx, step, a: int, b: int):
    def run() -> None:
        scatter_add(arr, idx, step, a, b)
    return run
