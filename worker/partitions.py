"""Pipelined gradient coding on the worker (docs/gradient-coding.md, "Pipelined
gradient coding"; the code itself is the coordinator's): the latest pseudo-gradient of every partition this worker
holds, which partitions a round trains, and the coded message combined from them.
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor

from geoloco.protos import geoloco_pb2 as pb

log = logging.getLogger(__name__)


class LatestDeltas:
    """Partition → the pseudo-gradient Δ this worker last computed for it (CPU fp32): s + 1
    model-sized buffers under gradient coding, one without."""

    def __init__(self) -> None:
        self.latest: dict[int, list[Tensor]] = {}

    def to_train(self, task: pb.WorkerTask) -> list[int]:
        """The task's partitions, plus any partition it sends that this process never
        trained (a pipelined worker restarted mid-run warms up like round 0)."""
        trained = list(task.train_partitions)
        missing = [p for p in task.send_partitions if p not in self.latest and p not in trained]
        if missing:
            log.info("round %d: no buffer yet for partitions %s; training them too", task.round, missing)
        return trained + missing

    def keep(self, partition: int, delta: list[Tensor]) -> None:
        self.latest[partition] = delta

    def message(self, task: pb.WorkerTask) -> list[Tensor]:
        """m = Σ_j c_j · latest[p_j] over the task's send partitions and coefficients (the
        trained partition's Δ itself without gradient coding)."""
        sends = list(task.send_partitions) or list(task.train_partitions)
        coeffs = list(task.send_coefficients) or [1.0] * len(sends)
        missing = [p for p in sends if p not in self.latest]
        if missing:
            raise RuntimeError(f"round {task.round}: asked to send partitions {missing} never trained")
        if len(sends) == 1 and coeffs[0] == 1.0:
            return self.latest[sends[0]]
        out = [torch.zeros_like(t) for t in self.latest[sends[0]]]
        for p, c in zip(sends, coeffs, strict=True):
            for o, d in zip(out, self.latest[p], strict=True):
                o.add_(d, alpha=c)
        return out
