"""Outer optimizers: SparseLoCo's outer SGD (Sarfi et al. 2025, arXiv 2508.15706; the
workers' frames are broadcast as they are) and DiLoCo's Nesterov SGD (Douillard et al.
2023, arXiv 2311.08105; one dense frame of the parameter change is broadcast, fp32 or bf16
as the workers send theirs)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from geoloco.compression import Layout, aggregate, decode_frame, encode_dense
from geoloco.config import OuterConfig, RunConfig
from geoloco.coordinator.rounds import Arrival, Decision
from geoloco.replica import apply_round

COORDINATOR_SENDER = 2**31 - 1  # sender id of the coordinator's own frames (fits int32 and u32)


@dataclass(frozen=True)
class UpdateFrame:
    """One frame of a round's update, as broadcast: who sent it, its weight, its bytes."""

    sender: int
    weight: float
    data: bytes
    frame: Any  # compression.Frame decoded from ``data``


@dataclass(frozen=True)
class Update:
    """A round's update: every replica runs ``apply_update`` on it (params += alpha * U)."""

    frames: list[UpdateFrame]
    mode: str  # compression.apply_frames mode: "sum" | "mean_kept"
    alpha: float


def apply_update(params: list[Tensor], update: Update) -> None:
    """The very call the workers make (``geoloco.replica.apply_round``), so the coordinator's
    parameters match theirs bit for bit."""
    apply_round(params, [f.frame for f in update.frames], [f.weight for f in update.frames],
                update.mode, update.alpha)


def mean_weights(decision: Decision, aggregation: str) -> tuple[list[float], str]:
    """Weights and apply_frames mode of the round's update (docs/gradient-coding.md,
    "Aggregation").

    ``mean_kept`` where the chosen frames are disjoint plain sums of k partitions each
    (``decision.disjoint``: B = I, FR): weights a_i / k with mode ``mean_kept``, so each
    coordinate is the mean over the frames that kept it of their per-partition mean, which
    is SparseLoCo's rule (and the mean over all covered partitions where every frame kept
    it). Otherwise, and with ``mean``: the weighted sum a_i / covered with mode ``sum``.
    """
    coeffs = [a for _, a in sorted(decision.coefficients.items())]
    if aggregation == "mean_kept" and decision.disjoint:
        per_frame = decision.covered / len(coeffs)
        return [a / per_frame for a in coeffs], "mean_kept"
    return [a / max(decision.covered, 1) for a in coeffs], "sum"


def aggregation_note(cfg: RunConfig) -> str | None:
    """What the run's rounds are aggregated by, where ``mean_kept`` cannot be exact: the
    cyclic codes' chosen frames are weighted combinations that overlap, so their rounds
    (and deadline rounds that are not one frame per partition group) take the weighted
    sum. None when every decodable round uses the configured rule."""
    if cfg.outer.aggregation == "mean_kept" and cfg.coding.scheme.endswith("-cr"):
        return (f"outer.aggregation 'mean_kept': coding.scheme {cfg.coding.scheme!r} decodes by a "
                "weighted sum (cyclic codes' frames overlap, so a per-coordinate mean over keepers "
                "is not exact); rounds are aggregated with mode 'sum'")
    return None


class OuterOptimizer(ABC):
    """Turns a closed round's chosen frames into the update every replica applies."""

    def __init__(self, layout: Layout, cfg: OuterConfig) -> None:
        self.layout = layout
        self.lr = float(cfg.lr if cfg.lr is not None else 1.0)
        self.momentum = float(cfg.momentum or 0.0)
        self.aggregation = cfg.aggregation

    @abstractmethod
    def step(self, round: int, chosen: list[tuple[Arrival, float]], decision: Decision) -> Update:
        """The update for ``round`` (does not touch the parameters)."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        del state


class SparseLoCoOuter(OuterOptimizer):
    """Outer SGD without momentum: broadcast the workers' frames with alpha = -lr.

    The pseudo-gradient is theta_global - theta_local, so params += -lr * mean(frames).
    """

    def step(self, round: int, chosen: list[tuple[Arrival, float]], decision: Decision) -> Update:
        weights, mode = mean_weights(decision, self.aggregation)
        frames = [
            UpdateFrame(arr.worker, w, arr.data, arr.frame)
            for (arr, _), w in zip(chosen, weights, strict=True)
        ]
        return Update(frames, mode, -self.lr)


class DiLoCoOuter(OuterOptimizer):
    """Nesterov SGD on the mean dense pseudo-gradient U, momentum kept here (PyTorch's
    convention: m = mu*m + U; change = -lr * (U + mu*m)), broadcast as one dense frame in
    ``dense_dtype`` (every replica, this one included, applies the frame as decoded, with
    weight 1 and alpha 1)."""

    def __init__(self, layout: Layout, cfg: OuterConfig, dense_dtype: str = "fp32") -> None:
        super().__init__(layout, cfg)
        self.dense_dtype = dense_dtype
        self.buffers: list[Tensor] | None = None

    def step(self, round: int, chosen: list[tuple[Arrival, float]], decision: Decision) -> Update:
        if not chosen:
            return Update([], "sum", 1.0)
        weights, _ = mean_weights(decision, "mean")  # dense frames keep every coordinate: the two rules agree
        frames = [arr.frame for arr, _ in chosen]
        mean = aggregate(self.layout, frames, weights, mode="sum")
        change = self._nesterov(mean)
        data = encode_dense(self.layout, change, round=round, sender=COORDINATOR_SENDER, dtype=self.dense_dtype)
        frame = decode_frame(data, self.layout)
        return Update([UpdateFrame(COORDINATOR_SENDER, 1.0, data, frame)], "sum", 1.0)

    def _nesterov(self, grads: list[Tensor]) -> list[Tensor]:
        grads = [g.detach().to("cpu", torch.float32) for g in grads]
        if self.momentum == 0.0:
            return [g.mul(-self.lr) for g in grads]
        if self.buffers is None:
            self.buffers = [g.clone() for g in grads]
        else:
            for buf, g in zip(self.buffers, grads, strict=True):
                buf.mul_(self.momentum).add_(g)
        return [(g + self.momentum * buf).mul_(-self.lr) for g, buf in zip(grads, self.buffers, strict=True)]

    def state_dict(self) -> dict[str, Any]:
        return {"momentum_buffers": self.buffers}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        buffers = state.get("momentum_buffers")
        self.buffers = [b.clone() for b in buffers] if buffers is not None else None


def make_outer(method: str, layout: Layout, cfg: OuterConfig, dense_dtype: str = "fp32") -> OuterOptimizer:
    """The outer optimizer for ``compression.method`` (sparseloco | diloco; DiLoCo
    broadcasts in ``compression.dense_dtype``)."""
    if method == "sparseloco":
        return SparseLoCoOuter(layout, cfg)
    if method == "diloco":
        return DiLoCoOuter(layout, cfg, dense_dtype)
    raise ValueError(f"compression.method {method!r} is not one of sparseloco, diloco")
