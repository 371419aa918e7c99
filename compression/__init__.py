"""The SparseLoCo codec: error feedback, chunked top-k, 2-bit values, coded indices, and
the self-describing frame format (Sarfi et al. 2025, arXiv 2508.15706). See docs/codec.md."""

from .aggregate import aggregate, apply_frames, decode_apply
from .compressor import Compressor
from .errors import FrameError
from .frame import Frame, decode_frame, encode_dense
from .layout import Layout, TensorSpec
from .memory import on_huge_pages

__all__ = [
    "Compressor",
    "Frame",
    "FrameError",
    "Layout",
    "TensorSpec",
    "aggregate",
    "apply_frames",
    "decode_apply",
    "decode_frame",
    "encode_dense",
    "on_huge_pages",
]
