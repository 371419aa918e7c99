"""What a worker pushes: its message encoded as one frame, by SparseLoCo's compressor
(chunked top-k, 2-bit values, error feedback inside; Sarfi et al. 2025, arXiv 2508.15706)
or as a dense frame for the DiLoCo baseline (docs/codec.md).
"""

from __future__ import annotations

import logging
import time

import torch
from torch import Tensor

from geoloco.compression import Compressor, Layout, decode_frame, encode_dense
from geoloco.config import CompressionConfig
from geoloco.replica import apply_round

log = logging.getLogger(__name__)

WARMUP_SIDE = 256  # the stand-in model of the codec warm-up: one 256 x 256 matrix, one vector


class FrameEncoder:
    """Encodes one round's message for ``layout`` as the run config's compression says."""

    def __init__(self, layout: Layout, compression: CompressionConfig) -> None:
        self.layout = layout
        self.compression = compression
        self.compressor = _compressor(layout, compression) if compression.method == "sparseloco" else None

    def encode(self, message: list[Tensor], round_: int, sender: int) -> bytes:
        if self.compressor is not None:
            return self.compressor.compress(message, round=round_, sender=sender)
        return encode_dense(self.layout, message, round=round_, sender=sender,
                            dtype=self.compression.dense_dtype, zstd=self.compression.zstd)

    def warm_up(self) -> None:
        """Compress, decode and apply a small stand-in model once, so the codec's compiled
        kernels are ready (numba compiles or loads them on first use, up to seconds) before
        round 0 rather than inside it. Nothing to do for dense frames."""
        if self.compressor is None:
            return
        start = time.monotonic()
        layout = Layout.from_named_tensors([("w", torch.zeros(WARMUP_SIDE, WARMUP_SIDE)),
                                            ("b", torch.zeros(WARMUP_SIDE))])
        gen = torch.Generator().manual_seed(0)
        deltas = [torch.randn(s.shape, generator=gen) for s in layout.specs]
        frame = decode_frame(_compressor(layout, self.compression).compress(deltas, round=0, sender=0), layout)
        params = [torch.zeros(s.shape) for s in layout.specs]
        apply_round(params, [frame, frame], [0.5, 0.5], "sum", -1.0)
        log.info("codec kernels ready in %.2fs", time.monotonic() - start)


def _compressor(layout: Layout, comp: CompressionConfig) -> Compressor:
    return Compressor(layout, density=comp.density, beta=comp.ef_beta, tile=comp.tile,
                      index_coding=comp.index_coding, zstd=comp.zstd)
