"""Frames as objects: ``decode_frame`` turns bytes into a checked ``Frame`` (the format in
``format.py``, the sparse sections checked by a codec backend), and ``encode_dense`` makes
the dense frames of the DiLoCo baseline and of model state (docs/codec.md).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from . import registry
from .backend import ApplyInto, CodecBackend, SparseBody
from .format import (
    CRC_BYTES,
    CRC_MISMATCH,
    DENSE_DTYPE_CODES,
    DENSE_DTYPES,
    HEADER_BYTES,
    KIND_DENSE,
    SECTION_BYTES,
    FrameError,
    check_layout,
    raw_frame,
    read_dense,
    read_header,
    read_sparse,
    seal_frame,
    write_frame,
)
from .layout import Layout
from .reference import value_magnitudes


class Frame:
    """A checked frame.

    Sparse frames give, per tensor, the flat indices (int64, increasing within each
    chunk) and fp32 values of the kept elements; they are decoded on first use (and
    ``apply_frames`` applies one without making them). Dense frames hold fp32 tensors.
    """

    def __init__(self, kind: str, round: int, sender: int, nbytes: int, layout: Layout,
                 dense: list[torch.Tensor] | None = None, params: dict | None = None,
                 body: SparseBody | None = None) -> None:
        self.kind = kind
        self.round = round
        self.sender = sender
        self.nbytes = nbytes
        self.layout = layout
        self.dense = dense
        self.params: dict = params or {}
        self.body = body
        self._indices: list[torch.Tensor] | None = None
        self._values: list[torch.Tensor] | None = None
        self._magnitudes: tuple[float, float] | None = None

    @property
    def indices(self) -> list[torch.Tensor] | None:
        if self._indices is None and self.body is not None:
            self._indices, self._values = self.body.materialize()
        return self._indices

    @property
    def values(self) -> list[torch.Tensor] | None:
        if self._values is None and self.body is not None:
            self._indices, self._values = self.body.materialize()
        return self._values

    @property
    def kept(self) -> int:
        return self.layout.numel if self.kind == "dense" else self.body.kept

    def magnitudes(self) -> tuple[float, float]:
        """(L2 norm, largest absolute value) of the frame's values, summed in float64; a
        sparse frame's come from its body (the numba backend's from the codes and levels
        alone, decoding no position). Cached."""
        if self._magnitudes is None:
            self._magnitudes = value_magnitudes(self.dense) if self.kind == "dense" else self.body.magnitudes()
        return self._magnitudes

    def to_dense(self, device=None) -> list[torch.Tensor]:
        out = []
        for j, spec in enumerate(self.layout.specs):
            if self.kind == "dense":
                out.append(self.dense[j].to(device).reshape(spec.shape).clone())
                continue
            x = torch.zeros(spec.numel, dtype=torch.float32, device=device)
            x[self.indices[j].to(device)] = self.values[j].to(device)
            out.append(x.view(spec.shape))
        return out

    def __repr__(self) -> str:
        return f"Frame({self.kind}, round={self.round}, sender={self.sender}, {self.nbytes} bytes)"


def decode_frame(data: bytes, layout: Layout, *, backend: str | None = None, keep_positions: bool = False) -> Frame:
    """Check and decode a frame made for ``layout``; raises FrameError on any problem.
    backend: the codec backend that checks sparse frames (default: numba where installed).
    keep_positions: the frame keeps each kept element's decoded position (2 bytes a kept
    element, 1.6 x a default frame's bytes), so that ``apply_frames`` need not decode them
    again; without, it holds its bytes alone and is decoded once more when applied (the
    numba backend; the reference's frames always hold their indices)."""
    return read_frame(data, layout, registry.DECODER if backend is None else registry.backend(backend),
                      keep_positions=keep_positions)


def read_frame(data: bytes, layout: Layout, decoder: CodecBackend, into: ApplyInto | None = None,
               keep_positions: bool = False) -> Frame:
    """decode_frame with this decoder. With ``into`` (from its ``start_apply``), a sparse
    frame is added into the params while it is checked; the checksum is then checked
    beside the parsing (``into``), and a mismatch is the error raised once the header
    has been read, whatever else is wrong."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise FrameError(f"frame must be bytes, got {type(data).__name__}")
    data = bytes(data)
    try:
        head = read_header(data, check_crc=into is None)
    except FrameError:  # a problem found before the checksum's turn
        if into is not None:
            into.release()
        raise
    try:
        check_layout(head, layout)
        if head.kind == KIND_DENSE:
            dense = read_dense(data, head, layout)
            frame = Frame("dense", head.round, head.sender, len(data), layout, dense=dense,
                          params={"dtype": DENSE_DTYPES[head.p1][2]})
        else:
            sections = read_sparse(data, head, layout)
            geo = sections.geometry
            table = "bins" if geo.bins else "chunk" if geo.per_chunk else "tensor"
            params = {"tile": geo.tile, "k": geo.k_full, "table": table,
                      "index_coding": "fixed" if geo.fixed else "rice"}
            frame = Frame("sparse", head.round, head.sender, len(data), layout, params=params,
                          body=decoder.decode(sections, into, keep_positions))
    except FrameError:
        if into is not None and not into.checksum_ok():
            raise FrameError(CRC_MISMATCH) from None
        raise
    finally:
        if into is not None:
            into.release()
    if into is not None and not into.checksum_ok():
        raise FrameError(CRC_MISMATCH)
    return frame


def encode_dense(layout: Layout, tensors: Sequence[torch.Tensor], *, round: int, sender: int, dtype: str = "fp32",
                 zstd: bool = False) -> bytes:
    """A dense frame carrying ``tensors`` (any float dtype, any device) as fp32 or bf16."""
    frame = encode_dense_buffer(layout, tensors, round=round, sender=sender, dtype=dtype)
    if not zstd:
        return bytes(frame)
    raw = memoryview(frame)[HEADER_BYTES + SECTION_BYTES:len(frame) - CRC_BYTES]
    return write_frame(KIND_DENSE, DENSE_DTYPE_CODES[dtype], 0, layout, round, sender, 0, 0, [raw], True)


def encode_dense_buffer(layout: Layout, tensors: Sequence[torch.Tensor], *, round: int, sender: int,
                        dtype: str = "fp32") -> bytearray:
    """``encode_dense`` without zstd, as a buffer written in place: the frame is the only
    copy of the tensors' bytes it makes (the coordinator's state frame is a model's size)."""
    if dtype not in DENSE_DTYPE_CODES:
        raise ValueError(f"dense dtype must be 'fp32' or 'bf16', got {dtype!r}")
    tensors = list(tensors)
    layout.check_tensors(tensors)
    code = DENSE_DTYPE_CODES[dtype]
    tdtype, itemsize = DENSE_DTYPES[code][0], DENSE_DTYPES[code][1]
    out, offset = raw_frame(KIND_DENSE, code, layout, round, sender, layout.numel * itemsize)
    for spec, t in zip(layout.specs, tensors, strict=True):
        if not torch.isfinite(t).all():
            raise ValueError(f"tensor {spec.name!r} contains NaN or Inf")
        x = t.detach().reshape(-1).to(tdtype).cpu().contiguous()
        size = x.numel() * itemsize
        into = np.frombuffer(out, dtype=np.uint8, count=size, offset=offset)
        into[:] = x.view(torch.uint8).numpy()
        offset += size
    return seal_frame(out)
