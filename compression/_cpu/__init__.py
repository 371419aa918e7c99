"""The numba CPU backend of the codec (``backend.CodecBackend``): the fused encoder, the
segment decoder and the thread pool they share. The same bytes, values and errors as the
reference (``reference.py``); on two cores it encodes about 7 times as fast (0.54 of an
error-feedback pass, against 0.08; docs/codec.md, "Performance").

    intrinsics.py       single instructions numba lacks (llvmlite)
    encode_kernels.py   error feedback, top-k, quantizer and index codes in one pass
    encoder.py          runs them over a layout, double-buffering the error feedback
    decode_kernels.py   checks, decodes and applies segments of a frame
    merge_kernels.py    adds several checked frames at once (mean over keepers, sum)
    decoder.py          runs them on the codec threads, the one-pass decode_apply
    threadpool.py       the codec threads
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..backend import SparseBody
from ..format import SparseSections, is_bins_frame
from ..layout import ChunkGrid, Layout
from ..reference import ReferenceBody, ReferenceEncoder, decode_sparse
from . import decoder
from .encoder import NumbaEncoder


class NumbaBackend:
    """Encodes error feedback in CPU memory, decodes anything, adds into fp32 CPU params.
    Frames of the 4-bin quantizer (``bins``) have no kernels here: they are encoded and
    decoded by the reference, explicitly, and applied by ``apply_frames``."""

    name = "numba"

    def encodes(self, device: torch.device) -> bool:
        return device.type == "cpu"

    def encoder(self, grids: Sequence[ChunkGrid], k_full: int, per_chunk: bool, fixed: bool,
                bins: bool = False) -> NumbaEncoder | ReferenceEncoder:
        if bins:
            return ReferenceEncoder(grids, k_full, per_chunk, fixed, bins)
        return NumbaEncoder(grids, k_full, per_chunk, fixed)

    def decode(self, sections: SparseSections, into: decoder.ApplyTarget | None = None,
               keep_positions: bool = False) -> decoder.NumbaBody | ReferenceBody:
        if sections.geometry.bins:
            if into is not None:
                raise ValueError("bins frames are not applied while decoding (start_apply returns None for them)")
            return decode_sparse(sections)
        return decoder.decode(sections, into, keep_positions)

    def start_apply(self, data: bytes, layout: Layout, params: Sequence[torch.Tensor], weight: float,
                    alpha: float) -> decoder.ApplyTarget | None:
        if is_bins_frame(data):
            return None
        addrs = decoder.cpu_addresses(layout, params)
        return None if addrs is None else decoder.ApplyTarget(data, addrs, weight, alpha)

    def add_frames(self, layout: Layout, params: Sequence[torch.Tensor], bodies: Sequence[SparseBody],
                   weights: Sequence[float], mode: str, alpha: float, on_final=None) -> bool:
        if len(bodies) == 1:
            return bodies[0].add_into(params, weights[0], alpha)
        return decoder.add_frames(layout, params, bodies, weights, mode, alpha, on_final)

    def add_at(self, updates: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> None:
        decoder.add_at(updates)
