"""SparseLoCo compressor: the error-feedback state of one worker, and the backend that
encodes it into sparse frames.

Sarfi, Thérien, Lidin, Belilovsky (2025), "SparseLoCo", arXiv 2508.15706. Per tensor:
``e <- beta*e + delta``; keep the top-k ``|e|`` of each chunk; send them as 2-bit codes;
``e -= decoded``. Buffers in CPU memory go through the numba backend, others (CUDA)
through the torch reference; both give the same bytes.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

from .backend import Encoded, NotFinite, SparseEncoder
from .format import (
    INDEX_FIXED,
    INDEX_RICE,
    KIND_SPARSE,
    MAX_TILE,
    TABLE_BINS,
    TABLE_PER_CHUNK,
    TABLE_PER_TENSOR,
    index_offsets_section,
    write_frame,
)
from .frame import Frame
from .layout import ChunkGrid, Layout
from .registry import encoding_backend

INDEX_CODINGS = {"rice": INDEX_RICE, "fixed": INDEX_FIXED}
TABLE_MODES = {"chunk": TABLE_PER_CHUNK, "tensor": TABLE_PER_TENSOR, "bins": TABLE_BINS}


class Compressor:
    """Turns pseudo-gradients into sparse frames, keeping the error-feedback state.

    density: kept fraction per chunk (k = round(density * tile**2), at least 1).
    beta: error-feedback decay. tile: chunk side (chunks hold tile**2 elements).
    index_coding: "rice" (Golomb-Rice of in-chunk gaps) or "fixed" (ceil(log2 chunk) bits).
    table: "chunk" (a (hi, lo) bfloat16 pair per chunk) or "tensor" (one per tensor): the
    2-bit sign x {lo, hi} quantizer; or "bins": the SparseLoCo reference's 4-bin quantizer,
    one table of 4 fp32 bin values per tensor (encoded by the reference backend).
    zstd: compress each section with zstd when that makes it smaller.
    device: where the error-feedback buffers live (default: the first deltas' device).
    backend: the codec backend that encodes ("numba", "reference"; default: numba for
    buffers in CPU memory where it is installed, else the reference).

    With the numba backend the error feedback is double-buffered: each call reads the
    current buffers and writes the next state into spare ones, swapped in on success, so
    a NaN or Inf leaves the state as it was without a separate check pass. That holds two
    fp32 copies of the parameters' size; ``error`` is always the current one. The
    reference works in place: a NaN or Inf delta is found before any state changes, an
    overflow after some tensors changed.

    A frame that is not used can be settled (gradient coding; docs/gradient-coding.md):
    ``restore`` puts the error feedback back as it was before the last ``compress``
    (with ``undoable``, which makes the in-place reference keep a copy), ``add_frame``
    adds a frame's decoded values into it.
    """

    def __init__(self, layout: Layout, density: float = 64 / 4096, beta: float = 0.95, tile: int = 64,
                 index_coding: str = "rice", zstd: bool = False, device=None, table: str = "chunk",
                 backend: str | None = None, undoable: bool = False) -> None:
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
        self.backend = backend
        self._live = [j for j, s in enumerate(layout.specs) if s.numel]
        self._grids = [ChunkGrid.of(layout.specs[j].shape, tile) for j in self._live]
        self.error: list[torch.Tensor] | None = None
        self.undoable = undoable
        self._before: list[torch.Tensor] | None = None  # the live tensors' state before the last compress
        self._encoders: dict[str, SparseEncoder] = {}  # by backend: they keep buffers from call to call

    # -- state --------------------------------------------------------------------------

    def _ensure_state(self, device: torch.device) -> None:
        if self.error is None:
            dev = self.device or device
            self.error = [torch.zeros(s.numel, dtype=torch.float32, device=dev) for s in self.layout.specs]

    def state_dict(self, copy: bool = True) -> dict:
        """The error feedback and codec parameters to save; ``copy=False``: the live buffers,
        for a caller that writes them out before the next compress (a model's size less)."""
        error = None if self.error is None else [e.clone() if copy else e for e in self.error]
        return {"error_feedback": error, "beta": self.beta, "tile": self.tile, "k": self.k,
                "digest": self.layout.digest}

    def load_state_dict(self, d: dict) -> None:
        if d.get("digest") not in (None, self.layout.digest):
            raise ValueError("error-feedback state was saved for another layout")
        ef = d["error_feedback"]
        if ef is None:
            self.error = None
            return
        if len(ef) != len(self.layout.specs):
            raise ValueError(f"state has {len(ef)} error buffers, layout has {len(self.layout.specs)}")
        dev = self.device or ef[0].device if ef else self.device
        out = []
        for spec, t in zip(self.layout.specs, ef, strict=True):
            if t.numel() != spec.numel:
                raise ValueError(f"error buffer for {spec.name!r} has {t.numel()} elements, expected {spec.numel}")
            out.append(t.detach().reshape(-1).to(device=dev, dtype=torch.float32).clone())
        self.error = out

    def set_density(self, density: float) -> None:
        """Keep ``density`` of each chunk from the next ``compress`` on (k = round(density *
        tile**2), at least 1); frames carry their k, so receivers need not know."""
        if not 0.0 < density <= 1.0:
            raise ValueError(f"density must be in (0, 1], got {density}")
        k = max(1, min(self.tile * self.tile, round(density * self.tile * self.tile)))
        self.density = density
        if k != self.k:
            self.k = k
            self._encoders = {}  # built for the old k

    # -- compress -----------------------------------------------------------------------

    def compress(self, deltas: Sequence[torch.Tensor], *, round: int, sender: int) -> bytes:
        """Add ``deltas`` into the error feedback, take its sparse 2-bit part, return the frame."""
        return self.write(self.encode(deltas), round=round, sender=sender)

    def encode(self, deltas: Sequence[torch.Tensor]) -> Encoded:
        """``compress`` without the frame: its sections, joined over the tensors (an island's
        rank sends these for its pieces; compression.shards)."""
        deltas = list(deltas)
        self.layout.check_tensors(deltas)
        self._ensure_state(deltas[0].device if deltas else torch.device("cpu"))
        device = self._state_device()
        flat = [deltas[j].detach().reshape(-1).to(device=device, dtype=torch.float32) for j in self._live]
        return self._encode(self._encoder(device), flat)

    def write(self, encoded: Encoded, *, round: int, sender: int) -> bytes:
        """The frame of this layout holding ``encoded``'s sections."""
        sections = [encoded.table, encoded.codes, encoded.index, index_offsets_section(encoded.chunk_index_bytes)]
        return write_frame(KIND_SPARSE, self.table_mode, self.index_mode, self.layout, round, sender,
                           self.tile, self.k, sections, self.zstd)

    @property
    def table_mode(self) -> int:
        return TABLE_MODES[self.table]

    @property
    def index_mode(self) -> int:
        return INDEX_CODINGS[self.index_coding]

    def reset(self) -> None:
        """Error feedback from zero, as a new compressor's."""
        self.error, self._before = None, None

    def ensure_state(self) -> None:
        """Zero error feedback where there is none yet (on ``device``, else the CPU)."""
        self._ensure_state(self.device or torch.device("cpu"))

    def compress_aggregate(self, frames: Sequence[Frame], weights: Sequence[float], *, mode: str,
                           round: int, sender: int) -> bytes:
        """``compress(aggregate(layout, frames, weights, mode=mode))`` with the same bytes and
        state, without a dense aggregate where the encoder writes the next state into spare
        buffers (numba): the frames are added into the spares (the fused multi-frame apply,
        from zero), and the encoder takes them as its deltas, ``e = beta*prev + d`` element by
        element into the same buffer. Elsewhere through the dense aggregate."""
        from .apply import aggregate, apply_frames  # apply imports this module's neighbours

        frames = list(frames)
        self._ensure_state(self.device or torch.device("cpu"))
        device = self._state_device()
        encoder = self._encoder(device)
        if not self.undoable and hasattr(encoder, "encode_pass"):
            return self._aggregate_in_place(encoder, frames, weights, mode, round, sender)
        spares = encoder.spares(self.error_live()) if hasattr(encoder, "spares") else None
        if spares is None:
            return self.compress(aggregate(self.layout, frames, weights, mode=mode, device=device),
                                 round=round, sender=sender)
        into = [torch.zeros(spec.shape) if spec.numel == 0 else torch.zeros(0) for spec in self.layout.specs]
        for j, spare in zip(self._live, spares, strict=True):
            into[j] = spare.view(self.layout.specs[j].shape).zero_()
        apply_frames(into, frames, weights, mode=mode, alpha=1.0)
        return self.write(self._encode(encoder, spares), round=round, sender=sender)

    def _aggregate_in_place(self, encoder, frames: list[Frame], weights: Sequence[float], mode: str, round: int,
                            sender: int) -> bytes:
        """compress_aggregate with no spare buffers (not ``undoable``, numba): the frames are
        added straight into the error feedback (``e + 1*U``, the fused apply: the bits of
        ``1*e + (0 + 1*U)``), then one in-place pass encodes it. Nothing can undo it, and a
        NaN or Inf found by the pass leaves the state changed, so the caller bounds what it
        adds first (coordinator.outer.SparseLoCoOuter, in-place ``aggregate``)."""
        from .apply import apply_frames  # apply imports this module's neighbours

        errors = self.error_live()
        into = [torch.zeros(spec.shape) if spec.numel == 0 else torch.zeros(0) for spec in self.layout.specs]
        for j, e in zip(self._live, errors, strict=True):
            into[j] = e.view(self.layout.specs[j].shape)
        apply_frames(into, frames, weights, mode=mode, alpha=1.0)
        self._before = None
        with self._named_not_finite():
            encoded = encoder.encode_pass(errors)
        return self.write(encoded, round=round, sender=sender)

    def compress_residual(self, *, round: int, sender: int) -> bytes:
        """A further frame of what the error feedback holds, with no new input: the top-k of
        ``e`` as ``compress`` takes it, and ``e -= decoded`` (coordinator.broadcast_passes).
        In place: ``restore`` undoes it together with the ``compress`` before it, from the
        same spare buffers or copy, so no other copy of the state is made."""
        self._ensure_state(self.device or torch.device("cpu"))
        encoder = self._encoder(self._state_device())
        errors = self.error_live()
        with self._named_not_finite():
            if hasattr(encoder, "encode_pass"):
                encoded = encoder.encode_pass(errors)
            else:  # an in-place encoder: e = 1*e + 0
                encoded = encoder.encode(errors, [torch.zeros_like(e) for e in errors], 1.0)
        for j, e in zip(self._live, encoded.errors, strict=True):
            self.error[j] = e
        return self.write(encoded, round=round, sender=sender)

    def error_live(self) -> list[torch.Tensor]:
        """The error-feedback buffers of the tensors that hold elements."""
        return [self.error[j] for j in self._live]

    def _state_device(self) -> torch.device:
        errors = self.error_live()
        return errors[0].device if errors else torch.device("cpu")  # all on one device

    def _encode(self, encoder: SparseEncoder, flat: list[torch.Tensor]) -> Encoded:
        live = self._live
        errors = self.error_live()
        self._before = None
        before = [e.clone() for e in errors] if self.undoable and encoder.in_place else errors
        with self._named_not_finite(with_deltas=True):
            encoded = encoder.encode(errors, flat, self.beta)
        for j, e in zip(live, encoded.errors, strict=True):
            self.error[j] = e
        self._before = before if self.undoable else None
        return encoded

    @contextmanager
    def _named_not_finite(self, with_deltas: bool = False) -> Iterator[None]:
        """The encoder's NotFinite as a ValueError naming the tensor: a pseudo-gradient that
        holds NaN or Inf (only where the encode was given deltas, ``with_deltas``), else error
        feedback that overflowed to Inf."""
        try:
            yield
        except NotFinite as bad:
            name = self.layout.specs[self._live[bad.tensor]].name
            if with_deltas and bad.in_delta:
                raise ValueError(f"pseudo-gradient {name!r} contains NaN or Inf") from None
            raise ValueError(f"error feedback for {name!r} overflowed to Inf") from None

    # -- settle ---------------------------------------------------------------------------

    def restore(self) -> None:
        """The error feedback as it was before the last ``compress`` (which must have been
        made with ``undoable``; the double-buffered numba state is read from its spare
        buffers, the reference's from its copy). Until the next ``compress`` only."""
        if self._before is None:
            raise RuntimeError("restore() needs a compress() made with undoable=True since the last restore")
        for j, before in zip(self._live, self._before, strict=True):
            self.error[j].copy_(before)
        self._before = None

    def add_frame(self, frame: Frame, weight: float = 1.0) -> None:
        """``e += fp32(weight) * v`` at every coordinate a sparse frame of this layout kept."""
        if frame.kind != "sparse" or frame.layout != self.layout:
            raise ValueError(f"{frame!r} is not a sparse frame of this compressor's layout")
        self._ensure_state(self.device or torch.device("cpu"))
        for j in self._live:
            self.add_kept(j, frame.indices[j], frame.values[j], weight)

    def add_kept(self, j: int, indices: torch.Tensor, values: torch.Tensor, weight: float) -> None:
        """``e_j += fp32(weight) * values`` at the flat ``indices`` of tensor j's error
        feedback (made first if it is not yet)."""
        self._ensure_state(self.device or torch.device("cpu"))
        e = self.error[j]
        w = torch.tensor(weight, dtype=torch.float32, device=e.device)
        e.index_add_(0, indices.to(e.device), values.to(e.device) * w)

    def _encoder(self, device: torch.device) -> SparseEncoder:
        chosen = encoding_backend(self.backend, device)
        if chosen.name not in self._encoders:
            self._encoders[chosen.name] = chosen.encoder(self._grids, self.k, self.table == "chunk",
                                                         self.index_coding == "fixed", self.table == "bins")
        return self._encoders[chosen.name]
