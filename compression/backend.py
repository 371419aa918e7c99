"""What a codec backend does: encode error feedback into a sparse frame's sections, and
check, decode and apply those sections, one frame or several at once (the SparseLoCo codec
of docs/codec.md).

Two backends implement it: the plain-torch reference (``reference.py``, the executable
specification, any device) and the numba CPU kernels (``_cpu/``). ``registry.py`` lists
the installed ones, and the parity tests require the same bytes, values, error feedback
and errors from every one of them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol, runtime_checkable

import numpy as np
import torch

from .format import SparseSections
from .layout import ChunkGrid, Layout


class Encoded(NamedTuple):
    """One encode call: a sparse frame's sections, each joined over the tensors, and the
    error feedback that goes with them."""

    errors: list[torch.Tensor]     # the next error-feedback state, flat fp32, one per tensor encoded
    table: bytes
    codes: bytes
    index: bytes
    chunk_index_bytes: np.ndarray  # index bytes of each chunk, in frame order


class NotFinite(ValueError):
    """A delta held NaN or Inf (``in_delta``), or else the error feedback of tensor
    ``tensor`` (its position among the tensors encoded) overflowed to Inf."""

    def __init__(self, tensor: int, in_delta: bool) -> None:
        super().__init__(tensor, in_delta)
        self.tensor = tensor
        self.in_delta = in_delta


@runtime_checkable
class SparseEncoder(Protocol):
    in_place: bool  # whether encode overwrites the error-feedback tensors it is given

    def encode(self, errors: list[torch.Tensor], deltas: list[torch.Tensor], beta: float) -> Encoded:
        """``e = beta*e + delta`` per tensor, then its top-k per chunk as 2-bit codes and
        coded positions, and ``e -= decoded``. Raises NotFinite (which tensor); the state
        is then as the backend documents (unchanged on the CPU)."""
        ...


@runtime_checkable
class SparseBody(Protocol):
    """A checked sparse frame, in the form its backend keeps it."""

    kept: int  # elements kept over all tensors

    def materialize(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per tensor, the flat int64 indices (increasing within each chunk) and fp32 values."""
        ...

    def kept_values(self) -> list[torch.Tensor]:
        """Per tensor, the fp32 values of ``materialize``, without making the indices."""
        ...

    def magnitudes(self) -> tuple[float, float]:
        """(L2 norm, largest absolute value) of the kept values, summed in float64 (equal
        across backends up to the order of that sum)."""
        ...

    def add_into(self, params: Sequence[torch.Tensor], weight: float, alpha: float) -> bool:
        """``p = p + fp32(alpha) * fp32(fp32(weight) * v)`` for every kept (index, v), straight
        from the sections; False (nothing done) where the params do not allow it."""
        ...


@runtime_checkable
class ApplyInto(Protocol):
    """Parameters a backend adds a frame into while it checks it (``decode_apply``)."""

    def checksum_ok(self) -> bool:
        """Whether the frame's CRC-32 matches (the caller parsed it without checking)."""
        ...

    def release(self) -> None:
        """Nothing more to do (a helper thread may stop waiting)."""
        ...


@runtime_checkable
class CodecBackend(Protocol):
    name: str

    def encodes(self, device: torch.device) -> bool:
        """Whether ``encoder`` works on error-feedback buffers on ``device``."""
        ...

    def encoder(self, grids: Sequence[ChunkGrid], k_full: int, per_chunk: bool, fixed: bool,
                bins: bool = False) -> SparseEncoder:
        """An encoder for these tensors and codec parameters (it may keep buffers between
        calls); ``bins``: the 4-bin quantizer (docs/codec.md)."""
        ...

    def decode(self, sections: SparseSections, into: ApplyInto | None = None,
               keep_positions: bool = False) -> SparseBody:
        """Check the sections' contents, raising the FrameError of the first problem (the
        order of ``format``'s problem codes, segment by segment). With ``into`` (from this
        backend's ``start_apply``), also add the frame into its params, and leave them bit
        for bit as they were when it raises, the checksum mismatch included.
        keep_positions: the body keeps what it decoded for a later apply (``decode_frame``)."""
        ...

    def start_apply(self, data: bytes, layout: Layout, params: Sequence[torch.Tensor], weight: float,
                    alpha: float) -> ApplyInto | None:
        """Get ready to add ``data`` into ``params`` while decoding it, or None where this
        backend cannot (the caller then decodes, then applies)."""
        ...

    def add_frames(self, layout: Layout, params: Sequence[torch.Tensor], bodies: Sequence[SparseBody],
                   weights: Sequence[float], mode: str, alpha: float,
                   on_final: Callable[[int], None] | None = None) -> bool:
        """``params += alpha * U`` for these sparse frames' bodies (``mode`` "sum" or
        "mean_kept"), with the arithmetic of docs/codec.md ("Several frames at once");
        False (nothing done) where this backend cannot for these params or bodies (the
        reference always can). ``on_final(j)``: the first j params are done (optional)."""
        ...

    def add_at(self, updates: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> None:
        """``p.view(-1)[idx] += step`` for each (contiguous param, unique int64 indices, fp32
        steps): each element one fp32 addition."""
        ...
