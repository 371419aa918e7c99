"""The numba CPU backend of the codec (``backend.CodecBackend``): the fused encoder, the
segment decoder and the thread pool they share. The same bytes, values and errors as the
reference (``reference.py``); on two cores it encodes about 7 times as fast (0.54 of an
error-feedback pass, against 0.08; docs/codec.md, "Performance").

    intrinsics.py       single instructions numba lacks (llvmlite)
    encode_kernels.py   error feedback, top-k, quantizer and index codes in one pass
    encoder.py          runs them over a layout, double-buffering the error feedback
    decode_kernels.py   checks, decodes and applies segments of a frame
    decoder.py          runs them on the codec threads, the one-pass decode_apply
    threadpool.py       the codec threads
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..format import SparseSections
from ..layout import ChunkGrid, Layout
from . import decoder
from .encoder import NumbaEncoder


class NumbaBackend:
    """Encodes error feedback in CPU memory, decodes anything, adds into fp32 CPU params."""

    name = "numba"

    def encodes(self, device: torch.device) -> bool:
        return device.type == "cpu"

    def encoder(self, grids: Sequence[ChunkGrid], k_full: int, per_chunk: bool, fixed: bool) -> NumbaEncoder:
        return NumbaEncoder(grids, k_full, per_chunk, fixed)

    def decode(self, sections: SparseSections, into: decoder.ApplyTarget | None = None) -> decoder.NumbaBody:
        return decoder.decode(sections, into)

    def start_apply(self, data: bytes, layout: Layout, params: Sequence[torch.Tensor], weight: float,
                    alpha: float) -> decoder.ApplyTarget | None:
        addrs = decoder.cpu_addresses(layout, params)
        return None if addrs is None else decoder.ApplyTarget(data, addrs, weight, alpha)

    def add_at(self, updates: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> None:
        decoder.add_at(updates)
