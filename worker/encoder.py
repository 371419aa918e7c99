"""What a worker pushes: its message encoded as one frame, by SparseLoCo's compressor
(chunked top-k, 2-bit values, error feedback inside; Sarfi et al. 2025, arXiv 2508.15706)
or as a dense frame for the DiLoCo baseline (docs/codec.md).
"""

from __future__ import annotations

import logging
import time

import torch
from torch import Tensor

from geoloco.compression import Compressor, Frame, Layout, decode_frame, encode_dense
from geoloco.compression.shards import ShardCompressor, split_layout
from geoloco.config import CompressionConfig
from geoloco.protos import geoloco_pb2 as pb
from geoloco.replica import START_DENSITY, apply_round, sparse_compressor
from geoloco.worker.island import Island
from geoloco.worker.island_state import IslandState

log = logging.getLogger(__name__)

__all__ = ["START_DENSITY", "FrameEncoder", "IslandFrameEncoder", "island_state", "same_values", "settle_shard"]
WARMUP_SIDE = 256  # the stand-in model of the codec warm-up: one 256 x 256 matrix, one vector
RESTORE = "restore"  # a settlement that undoes the last compression


class FrameEncoder:
    """Encodes one round's message for ``layout`` as the run config's compression says."""

    def __init__(self, layout: Layout, compression: CompressionConfig, undoable: bool = False,
                 density: float | None = None) -> None:
        self.layout = layout
        self.compression = compression
        self.compressor = (_compressor(layout, compression, undoable, density)
                           if compression.method == "sparseloco" else None)

    def set_density(self, density: float) -> float:
        """The density of the next sparse frame (geoloco.worker.density); returns the one
        in use, 0 for dense frames."""
        if self.compressor is None:
            return 0.0
        self.compressor.set_density(density)
        return self.compressor.density

    def encode(self, message: list[Tensor], round_: int, sender: int) -> bytes:
        if self.compressor is not None:
            return self.compressor.compress(message, round=round_, sender=sender)
        return encode_dense(self.layout, message, round=round_, sender=sender,
                            dtype=self.compression.dense_dtype, zstd=self.compression.zstd)

    def settle(self, settlement: pb.Settlement, own: bytes, applied: list[Frame]) -> None:
        """Settle the error feedback of this round's frame ``own`` by what the round header
        says became of it (docs/gradient-coding.md, "Error feedback that loses nothing"):
        RESTORE undoes the compression, ADD_BACK adds the frame back, CREDIT adds it back and
        takes out the group-mate's frame that was applied in its place. Dense frames carry
        no error feedback."""
        todo = self._settlement(settlement, own, applied)
        if todo == RESTORE:
            self.compressor.restore()
        elif todo:
            for frame, weight in todo:
                self.compressor.add_frame(frame, weight)

    def _settlement(self, settlement: pb.Settlement, own: bytes,
                    applied: list[Frame]) -> str | list[tuple[Frame, float]]:
        """What ``settle`` does: RESTORE, or the frames to add into the error feedback with
        their weights, in order (none for KEEP, dense frames, or a mate's frame that is this
        worker's own)."""
        kinds = pb.Settlement
        if self.compressor is None or settlement.kind == kinds.KEEP:
            return []
        if settlement.kind == kinds.RESTORE:
            return RESTORE
        frame = decode_frame(own, self.layout)
        if settlement.kind == kinds.CREDIT:
            mate = next((f for f in applied if f.sender == settlement.sender), None)
            if mate is None and settlement.mate_frame:  # an aggregated result: the mate's frame beside it
                mate = decode_frame(settlement.mate_frame, self.layout)
            if mate is None:
                raise ValueError(f"settlement credits worker {settlement.sender}'s frame, which the round did not apply")
            if same_values(frame, mate):
                return []  # the usual case: the same message from the same parameters, the same frame
            return [(mate, -1.0), (frame, 1.0)]
        return [(frame, 1.0)]

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
        density = self.compressor.density
        frame = decode_frame(_compressor(layout, self.compression, density=density).compress(
            deltas, round=0, sender=0), layout)
        params = [torch.zeros(s.shape) for s in layout.specs]
        apply_round(params, [frame, frame], [0.5, 0.5], "sum", -1.0)
        apply_round(params, [frame, frame], [0.5, 0.5], "mean_kept", -1.0)  # several frames at once
        log.info("codec kernels ready in %.2fs", time.monotonic() - start)


class IslandFrameEncoder(FrameEncoder):
    """Rank 0 of an fsdp island (geoloco.worker.island) under SparseLoCo: every rank keeps the
    error feedback of its own pieces of the layout (compression.shards) and compresses its
    pieces of the message (geoloco.worker.island_state); rank 0 joins the ranks' parts into
    the island's one frame, byte for byte the frame one process would send. ``encode``
    takes rank 0's pieces of the message (IslandState.make_message). The compressor is rank
    0's share (its local state saves it); the other ranks hold theirs
    (geoloco.worker.app.follow)."""

    def __init__(self, state: IslandState, layout: Layout, compression: CompressionConfig) -> None:
        if state.shard is None:
            raise ValueError("an island's frame encoder needs the ranks' shares of the error feedback")
        self.layout = layout
        self.compression = compression
        self.state = state
        self.shard = state.shard
        self.compressor = self.shard.compressor

    def encode(self, message: list[Tensor], round_: int, sender: int) -> bytes:
        self.state.island.send("compress", self.compressor.density)
        return self.shard.join_frame(self.state.compress(), round=round_, sender=sender)

    def settle(self, settlement: pb.Settlement, own: bytes, applied: list[Frame]) -> None:
        todo = self._settlement(settlement, own, applied)
        if not todo:
            return
        sent = todo if todo == RESTORE else [(f.indices, f.values, w) for f, w in todo]
        self.state.island.send("settle", sent)
        settle_shard(self.shard, sent)


def island_state(island: Island, layout: Layout, compression: CompressionConfig, undoable: bool = False,
                 density: float | None = None) -> IslandState:
    """This rank's pieces of an fsdp island's outer state (geoloco.worker.island_state):
    compression.shards.split_layout over the island's ranks with the run's codec
    parameters, and under SparseLoCo its share of the error feedback. Every rank makes the
    same split."""
    if compression.method != "sparseloco":
        return IslandState(island, layout, split_layout(layout, island.size, compression.tile))
    like = _compressor(layout, compression, undoable, density)  # no buffers made yet
    split = split_layout(layout, island.size, like.tile, per_chunk=like.table == "chunk")
    return IslandState(island, layout, split, ShardCompressor(layout, split[island.rank], like))


def settle_shard(shard: ShardCompressor, todo: str | list) -> None:
    """A settlement on a rank's share of the error feedback: RESTORE, or each (indices,
    values, weight) of whole-layout frames added in order (IslandFrameEncoder.settle)."""
    if todo == RESTORE:
        shard.restore()
        return
    for indices, values, weight in todo:
        shard.add_kept(indices, values, weight)


def same_values(a: Frame, b: Frame) -> bool:
    """Whether two sparse frames keep the same coordinates with the same values."""
    return all(torch.equal(i, j) and torch.equal(x, y)
               for i, j, x, y in zip(a.indices, b.indices, a.values, b.values, strict=True))


def _compressor(layout: Layout, comp: CompressionConfig, undoable: bool = False,
                density: float | None = None) -> Compressor:
    """The compressor of ``comp``; ``density`` overrides comp.density (which may be "auto")."""
    return sparse_compressor(layout, comp, density=density, undoable=undoable)
