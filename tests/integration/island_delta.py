"""One partition's pseudo-gradient, trained by an island of ranks or by one process, written
to a file: ``python island_delta.py --ranks N --out FILE [--batch-size B] [--parallel
fsdp]``. With N > 1 it starts itself as the N ranks (geoloco.worker.island.launch); rank 0
sends the others the run config and trains, as a worker's rank 0 does, and the others follow
(geoloco.worker.app.follow). The file holds the frames one process would send from that Δ
over four rounds of settlements (``settled_frames``); under fsdp also the island's, each
rank compressing its pieces of Δ into its share of the error feedback and settling it, and
what each rank held after training (``held``: elements of the
parameters, of AdamW's moments and of the error feedback, per rank)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from geoloco.compression import decode_frame
from geoloco.config import RunConfig, validate
from geoloco.protos import geoloco_pb2 as pb
from geoloco.replica import replica_layout
from geoloco.tasks import build_task
from geoloco.worker import island as islands
from geoloco.worker.app import follow
from geoloco.worker.encoder import FrameEncoder, IslandFrameEncoder
from geoloco.worker.trainer import InnerTrainer

PARTITION, ROUND = 1, 2


def config(batch_size: int) -> RunConfig:
    cfg = RunConfig(workers=2, rounds=4)
    cfg.task.model, cfg.task.seq_len, cfg.task.batch_size = "gpt-tiny", 32, batch_size
    cfg.task.val_windows, cfg.task.corpus_bytes = 16, 300_000
    cfg.inner.steps, cfg.inner.warmup_steps, cfg.inner.lr = 8, 4, 3e-3
    cfg.coding.scheme, cfg.coding.stragglers = "gc-fr", 1  # settlements, which may restore (undoable)
    return validate(cfg)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--ranks", type=int, default=1)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--parallel", default="ddp")
    args = p.parse_args()
    torch.set_num_threads(1)
    island = islands.Island.from_env(args.parallel)
    if island is None and args.ranks > 1:
        return islands.launch(sys.argv[1:], args.ranks, program=(__file__,))
    cfg = config(args.batch_size)
    device = island.start("cpu") if island else torch.device("cpu")
    if island is not None and not island.leader:
        code = follow(island, "fp32")
        island.close()
        return code
    task = build_task(cfg.task, cfg.workers, seed=cfg.seed)
    if island is not None:
        island.send("config", cfg.to_json())
    trainer = InnerTrainer(task, cfg.inner, cfg.rounds, device, "fp32", island=island)
    theta = trainer.master_copy()
    delta, loss = trainer.train_partition(theta, PARTITION, ROUND)
    layout = replica_layout(trainer.model)
    undoable = cfg.coding.scheme != "none"  # as a worker makes it (geoloco.worker.loop.Training)
    whole = FrameEncoder(layout, cfg.compression, undoable)  # the frames one process sends from this Δ
    held, frames = {}, [settled_frames(whole, delta, layout, cfg)]
    if island is not None and island.sharded:
        # each rank compresses its pieces and settles its share of the error feedback
        encoder = IslandFrameEncoder(island, layout, cfg.compression, undoable)
        frames.append(settled_frames(encoder, delta, layout, cfg))
        island.send("shards")
        held = {"params": island.shard_sizes(trainer.params),
                "adamw": island.shard_sizes(islands.optimizer_tensors(trainer.optimizer)),
                "error_feedback": island.counts(encoder.shard.held)}
    torch.save({"delta": delta, "loss": loss, "held": held, "frames": frames,
                "numel": sum(t.numel() for t in theta)}, args.out)
    if island is not None:
        island.send("exit", 0)
        island.close()
    return 0


def settled_frames(encoder: FrameEncoder, delta: list[torch.Tensor], layout, cfg: RunConfig) -> list[bytes]:
    """Four rounds' frames from scaled copies of ``delta``, each settled as gradient coding
    may settle it, so that every settlement reaches the error feedback: ADD_BACK, CREDIT of
    another worker's frame of a different message, RESTORE, then KEEP."""
    mate = decode_frame(FrameEncoder(layout, cfg.compression).encode([-0.5 * d for d in delta], 0, 1), layout)
    kinds = pb.Settlement
    settlements = [pb.Settlement(kind=kinds.ADD_BACK), pb.Settlement(kind=kinds.CREDIT, sender=1),
                   pb.Settlement(kind=kinds.RESTORE), pb.Settlement(kind=kinds.KEEP)]
    frames = []
    for r, settlement in enumerate(settlements):
        frames.append(encoder.encode([d * (1.0 + 0.25 * r) for d in delta], r, 0))
        encoder.settle(settlement, frames[-1], [mate])
    return frames


if __name__ == "__main__":
    sys.exit(main())
