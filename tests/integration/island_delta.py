"""One partition's pseudo-gradient, trained by an island of ranks or by one process, written
to a file: ``python island_delta.py --ranks N --out FILE [--batch-size B] [--parallel
fsdp]``. With N > 1 it starts itself as the N ranks (geoloco.worker.island.launch); rank 0
sends the others the run config and trains, as a worker's rank 0 does, and the others follow
(geoloco.worker.app.follow). The file holds the frames one process would send from that Δ
over four rounds of settlements (``settled_frames``). Under fsdp every rank holds its pieces
of θ and of Δ (geoloco.worker.island_state), Δ is put together on rank 0 to be compared,
and the file also holds the island's frames, each rank compressing its pieces of Δ into its
share of the error feedback and settling it; what each rank held after training (``held``:
elements of the parameters, of AdamW's moments, of θ and of the error feedback, per rank);
and the digests of θ after a round result of those frames, applied by the island to its
pieces and by one process to the whole (``digests``)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from geoloco.compression import decode_frame
from geoloco.config import RunConfig, validate
from geoloco.protos import geoloco_pb2 as pb
from geoloco.replica import apply_round, param_digest, replica_layout, replica_tensors
from geoloco.tasks import build_task
from geoloco.worker import island as islands
from geoloco.worker.app import follow
from geoloco.worker.encoder import FrameEncoder, IslandFrameEncoder, island_state
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
    layout = replica_layout(trainer.model)
    undoable = cfg.coding.scheme != "none"  # as a worker makes it (geoloco.worker.loop.Training)
    theta = [t.detach().float() for _, t in replica_tensors(task.make_model())]  # the model as made, whole
    state = None
    if island is not None and island.sharded:  # θ into every rank's pieces, as a fetched state
        state = trainer.island_state = island_state(island, layout, cfg.compression, undoable)
        island.send("load")
        state.load(theta)
    delta, loss = trainer.train_partition(theta, PARTITION, ROUND)
    whole = FrameEncoder(layout, cfg.compression, undoable)  # the frames one process sends from this Δ
    held, digests = {}, []
    if state is not None:  # the ranks' pieces of Δ, put together on rank 0 as a dense frame's message
        delta = island_message(state, 1.0, whole=True)
    frames = [settled_frames(lambda r: whole.encode([d * (1.0 + 0.25 * r) for d in delta], r, 0), whole, layout,
                             cfg, delta)]
    if state is not None:
        # each rank compresses its pieces and settles its share of the error feedback
        encoder = IslandFrameEncoder(state, layout, cfg.compression)
        frames.append(settled_frames(lambda r: island_frame(state, encoder, r), encoder, layout, cfg, delta))
        island.send("shards")
        held = {"params": island.shard_sizes(trainer.params),
                "adamw": island.shard_sizes(islands.optimizer_tensors(trainer.optimizer)),
                "theta": island.counts(state.held), "error_feedback": island.counts(state.shard.held)}
        # a round result of two of those frames, the mean over keepers: the island's θ and one process's
        data, weights = frames[0][:2], [0.5, 0.5]
        island.send("apply", data, weights, "mean_kept", -1.0)
        state.apply([decode_frame(d, layout) for d in data], weights, "mean_kept", -1.0)
        apply_round(theta, [decode_frame(d, layout) for d in data], weights, "mean_kept", -1.0)
        island.send("digest")
        digests = [state.digest(), param_digest(theta)]
    torch.save({"delta": delta, "loss": loss, "held": held, "frames": frames, "digests": digests,
                "numel": sum(t.numel() for t in theta)}, args.out)
    if island is not None:
        island.send("exit", 0)
        island.close()
    return 0


def island_message(state, coefficient: float, whole: bool = False) -> list[torch.Tensor] | None:
    """Every rank's message of PARTITION's Δ times ``coefficient``, as a worker's coded task
    makes it (geoloco.worker.loop.Training.message); with ``whole``, put together on rank 0."""
    task = pb.WorkerTask(round=ROUND, send_partitions=[PARTITION], send_coefficients=[coefficient])
    state.island.send("message", task.SerializeToString(), whole)
    mine = state.make_message(task)
    return state.whole_message() if whole else mine


def island_frame(state, encoder: IslandFrameEncoder, r: int) -> bytes:
    island_message(state, 1.0 + 0.25 * r)
    return encoder.encode([], r, 0)


def settled_frames(encode, encoder: FrameEncoder, layout, cfg: RunConfig, delta: list[torch.Tensor]) -> list[bytes]:
    """Four rounds' frames of ``encode(r)`` (scaled copies of ``delta``), each settled as
    gradient coding may settle it, so that every settlement reaches the error feedback:
    ADD_BACK, CREDIT of another worker's frame of a different message, RESTORE, then KEEP."""
    mate = decode_frame(FrameEncoder(layout, cfg.compression).encode([-0.5 * d for d in delta], 0, 1), layout)
    kinds = pb.Settlement
    settlements = [pb.Settlement(kind=kinds.ADD_BACK), pb.Settlement(kind=kinds.CREDIT, sender=1),
                   pb.Settlement(kind=kinds.RESTORE), pb.Settlement(kind=kinds.KEEP)]
    frames = []
    for r, settlement in enumerate(settlements):
        frames.append(encode(r))
        encoder.settle(settlement, frames[-1], [mate])
    return frames


if __name__ == "__main__":
    sys.exit(main())
