"""An fsdp island's outer state, held in pieces (docs/codec.md, "Islands"): every rank keeps
θ, the latest pseudo-gradient of each partition it trains, the running copy of an
overlapped round and, under SparseLoCo, the error feedback, each for its own pieces of the
layout alone (compression.shards.split_layout: one run of the model's elements, cut where
the codec's chunking allows), so no rank holds a whole copy of the model, on its device or
in its host memory. What crosses the island is one tensor at a time.

Rank 0 says what to do (geoloco.worker.loop; the others in geoloco.worker.app.follow).
Each method below is a collective: every rank calls it, in the same order.
- ``start``: the inner phase's start (θ, or the running copy) into the model's FSDP shards;
- ``keep``: the phase's end out of the shards, Δ = start − end kept for this rank's pieces;
- ``make_message``, then ``compress`` (this rank's pieces into its share of the error
  feedback; rank 0 joins the frame) or ``whole_message`` (a dense frame: joined on rank 0);
- ``apply``: the round's frames, which rank 0 checked, applied by each rank to its pieces
  with apply_frames' arithmetic (compression.shards.apply_to_pieces): bit for bit what a
  worker of one process holds;
- ``load``: the coordinator's state, whole on rank 0, into every rank's pieces;
- ``digest``: param_digest of the whole θ, on rank 0.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from geoloco.compression import Frame, Layout
from geoloco.compression.shards import Parts, Piece, ShardCompressor, apply_to_pieces
from geoloco.protos import geoloco_pb2 as pb
from geoloco.replica import ParamHasher
from geoloco.worker import overlap
from geoloco.worker.island import Island, IslandError, own_rows
from geoloco.worker.partitions import LatestDeltas


class IslandState:
    """This rank's pieces (``split[island.rank]``) of θ and of what is computed from it;
    ``shard``: its share of the SparseLoCo error feedback over the same pieces (None under
    a dense method)."""

    def __init__(self, island: Island, layout: Layout, split: Sequence[Sequence[Piece]],
                 shard: ShardCompressor | None = None) -> None:
        if shard is not None and list(shard.pieces) != list(split[island.rank]):
            raise IslandError(f"rank {island.rank}: its error feedback is split otherwise than θ")
        self.island = island
        self.layout = layout
        self.shard = shard
        self.pieces = list(split[island.rank])
        self.theta = [torch.zeros(p.shape) for p in self.pieces]
        self.running: list[Tensor] | None = None  # outer.overlap: what the next phase starts from
        self.deltas = LatestDeltas()
        self.message: list[Tensor] | None = None
        # tensor j → (owning rank, its piece, the piece's place in that rank's list)
        self.owners: list[list[tuple[int, Piece, int]]] = [[] for _ in layout.specs]
        for rank, pieces in enumerate(split):
            for i, piece in enumerate(pieces):
                self.owners[piece.tensor].append((rank, piece, i))

    @property
    def held(self) -> int:
        """Elements of θ this rank holds."""
        return sum(p.numel for p in self.pieces)

    @property
    def device(self) -> torch.device:
        """Where tensors cross the island (NCCL: the rank's GPU; Gloo: the CPU)."""
        return self.island.device or torch.device("cpu")

    # ------------------------------------------------------------------ one tensor at a time

    def _whole(self, j: int, mine: Sequence[Tensor]) -> Tensor:
        """Tensor j of the layout, flat fp32 on every rank, from each owner's piece of it
        (``mine``: this rank's pieces of some piece list, as ``self.pieces``)."""
        whole = torch.empty(self.layout.specs[j].numel, dtype=torch.float32, device=self.device)
        for rank, piece, i in self.owners[j]:
            part = whole[piece.start:piece.stop]
            if rank == self.island.rank:
                part.copy_(mine[i].reshape(-1))
            dist.broadcast(part, src=rank)
        return whole

    def _wholes(self, mine: Sequence[Tensor]) -> Iterator[tuple[int, Tensor]]:
        """(j, tensor j whole and shaped) for every tensor of the layout, in order."""
        for j, spec in enumerate(self.layout.specs):
            if spec.numel == 0:
                yield j, torch.zeros(spec.shape)
                continue
            yield j, self._whole(j, mine).view(spec.shape)

    def _keep_pieces(self, j: int, whole: Tensor, into: list[Tensor | None], fn) -> None:
        """``into[i] = fn(i, this rank's piece i of whole tensor j)`` for its pieces of tensor j."""
        flat = whole.reshape(-1)
        for rank, piece, i in self.owners[j]:
            if rank == self.island.rank:
                into[i] = fn(i, flat[piece.start:piece.stop].view(piece.shape))

    # ------------------------------------------------------------------ the inner phase

    def start(self, params: Sequence[Tensor], running: bool = False) -> None:
        """The inner phase's start, θ (or the running copy), into the model's ``params``:
        each rank keeps its own rows of a sharded one (FSDP2's torch.chunk along dim 0)."""
        source = self._source(running)
        with torch.no_grad():
            for (j, whole), p in zip(self._wholes(source), params, strict=True):
                if self.layout.specs[j].numel == 0:
                    continue
                if not isinstance(p, DTensor):
                    p.copy_(whole)
                    continue
                local, rows = p.to_local(), own_rows(whole, self.island.rank, self.island.size)
                if tuple(rows.shape) != tuple(local.shape):
                    raise IslandError(f"rank {self.island.rank}: a shard of {tuple(local.shape)} where torch.chunk "
                                      f"gives {tuple(rows.shape)} of {tuple(p.shape)}; FSDP sharded it another way")
                local.copy_(rows)

    def keep(self, partition: int, params: Sequence[Tensor], running: bool = False) -> None:
        """Δ = start − end for this rank's pieces, kept as ``partition``'s latest (the start
        rounded to a parameter's dtype where that is not fp32, as a worker of one process
        takes it)."""
        start = self._source(running)
        delta: list[Tensor | None] = [None] * len(self.pieces)
        with torch.no_grad():
            for j, p in enumerate(params):
                if self.layout.specs[j].numel == 0:
                    continue
                whole = p.full_tensor() if isinstance(p, DTensor) else p.detach()

                def diff(i: int, end: Tensor, p: Tensor = p) -> Tensor:
                    t = start[i] if p.dtype == torch.float32 else start[i].to(p.dtype).float()
                    return t - end.to("cpu", torch.float32)

                self._keep_pieces(j, whole, delta, diff)
        for i, piece in enumerate(self.pieces):
            if delta[i] is None:  # a piece of a tensor of no elements
                delta[i] = torch.zeros(piece.shape)
        self.deltas.keep(partition, delta)  # type: ignore[arg-type]

    def _source(self, running: bool) -> list[Tensor]:
        if not running:
            return self.theta
        if self.running is None:
            raise IslandError(f"rank {self.island.rank}: asked to train from a running copy it does not hold")
        return self.running

    def make_running(self, mode: str, partitions: Sequence[int], scale: float, copy: bool) -> None:
        """outer.overlap: the running copy of this rank's pieces (geoloco.worker.overlap)."""
        own = [self.deltas.latest[p] for p in partitions]
        self.running = overlap.running_copy(mode, self.theta, own, scale, copy=copy)

    # ------------------------------------------------------------------ the frame

    def make_message(self, task: pb.WorkerTask) -> list[Tensor]:
        """The task's coded message for this rank's pieces (LatestDeltas.message)."""
        self.message = self.deltas.message(task)
        return self.message

    def compress(self) -> list[Parts] | None:
        """SparseLoCo: this rank's message pieces into its share of the error feedback;
        every rank's parts on rank 0, in rank order (None elsewhere). ValueError on rank 0,
        naming the rank, where one found NaN or Inf."""
        if self.shard is None or self.message is None:
            raise IslandError(f"rank {self.island.rank}: asked to compress without a message or error feedback")
        message, self.message = self.message, None
        try:
            result: Parts | str = self.shard.compress_pieces(message)
        except ValueError as exc:
            result = f"rank {self.island.rank}: {exc}"
        gathered: list[Any] | None = [None] * self.island.size if self.island.leader else None
        dist.gather_object(result, gathered, dst=0)
        if gathered is None:
            return None
        failed = [g for g in gathered if isinstance(g, str)]
        if failed:
            raise ValueError(failed[0])
        return gathered

    def whole_message(self) -> list[Tensor] | None:
        """A dense method: the message whole on rank 0, CPU fp32 (None elsewhere)."""
        if self.message is None:
            raise IslandError(f"rank {self.island.rank}: asked for a message it has not made")
        message, self.message = self.message, None
        whole = [t.cpu() for _, t in self._wholes(message)]
        return whole if self.island.leader else None

    # ------------------------------------------------------------------ θ between rounds

    def apply(self, frames: Sequence[Frame], weights: Sequence[float], mode: str, alpha: float) -> None:
        """θ += alpha · U for the round's frames (each rank decoded them: apply_frames'
        arithmetic, element for element, on its pieces). The running copy is let go."""
        self.running = None
        apply_to_pieces(self.theta, self.pieces, frames, weights, mode, alpha)

    def load(self, whole: Sequence[Tensor] | None) -> None:
        """θ ← ``whole`` (rank 0's whole tensors; None on the others): each rank keeps its pieces."""
        self.running = None
        with torch.no_grad():
            for j, spec in enumerate(self.layout.specs):
                if spec.numel == 0:
                    continue
                t = (whole[j].detach().to(self.device, torch.float32).reshape(-1).contiguous() if self.island.leader
                     else torch.empty(spec.numel, dtype=torch.float32, device=self.device))
                dist.broadcast(t, src=0)
                self._keep_pieces(j, t, self.theta, lambda i, piece: self.theta[i].copy_(piece))

    def digest(self) -> str | None:
        """param_digest of the whole θ on rank 0 (None elsewhere)."""
        hasher = ParamHasher(len(self.layout.specs)) if self.island.leader else None
        for j, whole in self._wholes(self.theta):
            if hasher is not None:
                hasher.add(j, whole.cpu())
        return hasher.hexdigest() if hasher is not None else None

    # ------------------------------------------------------------------ the local state

    def state_dict(self) -> dict:
        """What a rank saves beside its AdamW shard: its pieces of each partition's latest Δ."""
        return {"pieces": [(p.tensor, p.start, p.stop) for p in self.pieces],
                "latest": {p: [t.clone() for t in d] for p, d in self.deltas.latest.items()}}

    def load_state_dict(self, state: dict) -> None:
        """ValueError if it was saved for other pieces (another island size or layout)."""
        if [tuple(x) for x in state["pieces"]] != [(p.tensor, p.start, p.stop) for p in self.pieces]:
            raise ValueError("saved for other pieces of the layout")
        self.deltas.latest = {int(p): list(d) for p, d in state["latest"].items()}

    def reset(self) -> None:
        """No partition's Δ: the island trains each again before it sends it."""
        self.deltas.latest = {}
