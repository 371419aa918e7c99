"""The SparseLoCo codec: error feedback, chunked top-k, 2-bit values, coded indices, and
the self-describing frame format (Sarfi et al. 2025, arXiv 2508.15706). See docs/codec.md.

    layout.py      TensorSpec, Layout, ChunkGrid: chunk geometry and every size derived from it
    format.py      the frame format: header, sections, checksum; writing and structural checks
    reference.py   the plain-torch encoder and decoder: the executable specification
    backend.py     what a codec backend does; registry.py: the installed ones
    _cpu/          the numba backend: fused encoder, segment decoder, their threads
    compressor.py  Compressor: the error-feedback state
    frame.py       Frame, decode_frame, encode_dense
    apply.py       aggregate, apply_frames, decode_apply
    memory.py      on_huge_pages, cap_malloc_arenas, map_large_allocations
    threads.py     codec_threads, set_codec_threads: the kernels' thread count
"""

from .apply import aggregate, apply_frames, decode_apply
from .compressor import Compressor
from .format import MAX_TILE, FrameError
from .frame import Frame, decode_frame, encode_dense
from .layout import Layout, TensorSpec
from .memory import cap_malloc_arenas, map_large_allocations, on_huge_pages
from .threads import codec_threads, set_codec_threads

__all__ = [
    "MAX_TILE",
    "Compressor",
    "Frame",
    "FrameError",
    "Layout",
    "TensorSpec",
    "aggregate",
    "apply_frames",
    "cap_malloc_arenas",
    "map_large_allocations",
    "codec_threads",
    "decode_apply",
    "decode_frame",
    "encode_dense",
    "on_huge_pages",
    "set_codec_threads",
]
