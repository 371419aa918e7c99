"""SparseLoCo compressor: error feedback, chunked top-k, 2-bit values, coded indices.

Sarfi, Thérien, Lidin, Belilovsky (2025), "SparseLoCo", arXiv 2508.15706. Per tensor:
``e <- beta*e + delta``; keep the top-k ``|e|`` of each chunk; send them as 2-bit codes;
``e -= decoded``. CPU tensors go through the fused numba kernel, others (CUDA) through
the torch path; both give the same bytes.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from . import cpu_encoder, kernels, sparse_torch
from .frame import (
    INDEX_FIXED,
    INDEX_RICE,
    KIND_SPARSE,
    MAX_TILE,
    TABLE_PER_CHUNK,
    TABLE_PER_TENSOR,
    _check_tensors,
    index_offsets_section,
    write_frame,
)
from .layout import ChunkGrid, Layout

INDEX_CODINGS = {"rice": INDEX_RICE, "fixed": INDEX_FIXED}
TABLE_MODES = {"chunk": TABLE_PER_CHUNK, "tensor": TABLE_PER_TENSOR}


class Compressor:
    """Turns pseudo-gradients into sparse frames, keeping the error-feedback state.

    density: kept fraction per chunk (k = round(density * tile**2), at least 1).
    beta: error-feedback decay. tile: chunk side (chunks hold tile**2 elements).
    index_coding: "rice" (Golomb-Rice of in-chunk gaps) or "fixed" (ceil(log2 chunk) bits).
    table: "chunk" (a (hi, lo) bfloat16 pair per chunk) or "tensor" (one per tensor).
    zstd: compress each section with zstd when that makes it smaller.
    device: where the error-feedback buffers live (default: the first deltas' device).

    On the CPU (numba kernel) the error feedback is double-buffered: each call reads the
    current buffers and writes the next state into spare ones, swapped in on success, so
    a NaN or Inf leaves the state as it was without a separate check pass. That holds two
    fp32 copies of the parameters' size; ``error`` is always the current one.
    """

    def __init__(self, layout: Layout, density: float = 64 / 4096, beta: float = 0.95, tile: int = 64,
                 index_coding: str = "rice", zstd: bool = False, device=None, table: str = "chunk",
                 use_kernel: bool | None = None) -> None:
        if not 0.0 < density <= 1.0:
            raise ValueError(f"density must be in (0, 1], got {density}")
        if not 0.0 <= beta <= 1.0:
            raise ValueError(f"beta must be in [0, 1], got {beta}")
        if not 1 <= tile <= MAX_TILE:
            raise ValueError(f"tile must be in [1, {MAX_TILE}], got {tile}")
        if index_coding not in INDEX_CODINGS:
            raise ValueError(f"index_coding must be one of {sorted(INDEX_CODINGS)}, got {index_coding!r}")
        if table not in TABLE_MODES:
            raise ValueError(f"table must be one of {sorted(TABLE_MODES)}, got {table!r}")
        self.layout = layout
        self.tile = tile
        self.k = max(1, min(tile * tile, round(density * tile * tile)))
        self.density = density
        self.beta = beta
        self.index_coding = index_coding
        self.table = table
        self.zstd = zstd
        self.device = torch.device(device) if device is not None else None
        self.use_kernel = kernels.HAVE_NUMBA if use_kernel is None else use_kernel
        self._grids = [ChunkGrid.of(s.shape, tile) for s in layout.specs]
        self.error: list[torch.Tensor] | None = None
        self._spare: list[torch.Tensor] | None = None  # the CPU kernel writes the next state here
        self._plans: list[tuple] | None = None  # the CPU kernel's output arrays, reused call after call
        self._views: dict[int, np.ndarray] = {}  # numpy views of the CPU error buffers, by id

    # -- state --------------------------------------------------------------------------

    def _ensure_state(self, device: torch.device) -> None:
        if self.error is None:
            dev = self.device or device
            self.error = [torch.zeros(s.numel, dtype=torch.float32, device=dev) for s in self.layout.specs]

    def _numpy(self, t: torch.Tensor) -> np.ndarray:
        """t.numpy() for one of this compressor's own CPU buffers, made once."""
        view = self._views.get(id(t))
        if view is None:
            view = self._views[id(t)] = t.numpy()
        return view

    def state_dict(self) -> dict:
        return {"error_feedback": [e.clone() for e in self.error] if self.error is not None else None,
                "beta": self.beta, "tile": self.tile, "k": self.k, "digest": self.layout.digest}

    def load_state_dict(self, d: dict) -> None:
        if d.get("digest") not in (None, self.layout.digest):
            raise ValueError("error-feedback state was saved for another layout")
        ef = d["error_feedback"]
        self._spare = None
        self._views = {}
        if ef is None:
            self.error = None
            return
        if len(ef) != len(self.layout.specs):
            raise ValueError(f"state has {len(ef)} error buffers, layout has {len(self.layout.specs)}")
        dev = self.device or ef[0].device if ef else self.device
        out = []
        for spec, t in zip(self.layout.specs, ef, strict=False):
            if t.numel() != spec.numel:
                raise ValueError(f"error buffer for {spec.name!r} has {t.numel()} elements, expected {spec.numel}")
            out.append(t.detach().reshape(-1).to(device=dev, dtype=torch.float32).clone())
        self.error = out

    # -- compress -----------------------------------------------------------------------

    def compress(self, deltas: Sequence[torch.Tensor], *, round: int, sender: int) -> bytes:
        """Add ``deltas`` into the error feedback, take its sparse 2-bit part, return the frame."""
        deltas = list(deltas)
        _check_tensors(self.layout, deltas)
        self._ensure_state(deltas[0].device if deltas else torch.device("cpu"))
        live = [j for j, s in enumerate(self.layout.specs) if s.numel]
        flat = [deltas[j].detach().reshape(-1).to(device=self.error[j].device, dtype=torch.float32)
                for j in live]
        kernel = self.use_kernel and self.error[live[0]].is_cpu if live else False  # all on one device
        per_chunk = self.table == "chunk"
        fixed = self.index_coding == "fixed"
        if kernel:
            # the new error feedback goes to spare buffers, swapped in only on success: a
            # NaN or Inf anywhere leaves the state as it was, without a separate check pass
            arrays = [f.contiguous().numpy() for f in flat]
            if self._spare is None:
                self._spare = [torch.empty_like(e) for e in self.error]
            if self._plans is None:
                self._plans = cpu_encoder.make_plans([self._grids[j] for j in live], self.k, per_chunk)
            tables, codes, index, chunk_bytes, over = cpu_encoder.encode(
                [self._numpy(self.error[j]) for j in live], arrays, [self._numpy(self._spare[j]) for j in live],
                [self._grids[j] for j in live], self.beta, self.k, per_chunk, fixed, torch.get_num_threads(),
                self._plans)
            if over is not None:
                over = cpu_encoder.first_nonfinite(arrays, torch.get_num_threads()), over
        else:
            bad = next((i for i, f in enumerate(flat) if not bool(torch.isfinite(f).all())), None)
            tables, codes, index, chunk_bytes, over = (None, None, None, None, (bad, None)) if bad is not None \
                else self._encode_torch(live, flat, per_chunk, fixed)
        if over is not None:
            bad, overflowed = over
            if bad is not None:
                raise ValueError(f"pseudo-gradient {self.layout.specs[live[bad]].name!r} contains NaN or Inf")
            raise ValueError(f"error feedback for {self.layout.specs[live[overflowed]].name!r} overflowed to Inf")
        if kernel:
            self.error, self._spare = self._spare, self.error
        offsets = index_offsets_section(np.concatenate(chunk_bytes) if chunk_bytes else np.zeros(0, np.int64))
        sections = [b"".join(tables), b"".join(codes), b"".join(index), offsets]
        return write_frame(KIND_SPARSE, TABLE_MODES[self.table], INDEX_CODINGS[self.index_coding],
                           self.layout, round, sender, self.tile, self.k, sections, self.zstd)

    def _encode_torch(self, live, flat, per_chunk, fixed):
        tables, codes, index, chunk_bytes = [], [], [], []
        for i, (j, d) in enumerate(zip(live, flat, strict=False)):
            e = self.error[j]
            e.mul_(torch.tensor(self.beta, dtype=torch.float32, device=e.device)).add_(d)
            if not bool(torch.isfinite(e).all()):
                return tables, codes, index, chunk_bytes, (None, i)
            p = sparse_torch.encode_tensor(e, self._grids[j], self.k, per_chunk, fixed)
            tables.append(p.table)
            codes.append(p.codes)
            index.append(p.index)
            chunk_bytes.append(p.index_chunk_bytes)
        return tables, codes, index, chunk_bytes, None
