"""Outer optimizers: SparseLoCo's outer SGD (Sarfi et al. 2025, arXiv 2508.15706; the
workers' frames are broadcast as they are, or their aggregate compressed into one frame:
``coordinator.broadcast``) and DiLoCo's Nesterov SGD (Douillard et al.
2023, arXiv 2311.08105; one dense frame of the parameter change is broadcast, fp32 or bf16
as the workers send theirs)."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from geoloco.compression import Compressor, Layout, aggregate, decode_frame, encode_dense
from geoloco.config import AUTO, MAX_BROADCAST_PASSES, OuterConfig, RunConfig
from geoloco.coordinator.gradient_coding import GradientCode
from geoloco.coordinator.rounds import Arrival, Decision
from geoloco.replica import START_DENSITY, apply_round, sparse_compressor

# a bfloat16 level may stand above the largest magnitude it quantizes by its rounding (2^-8
# of it at most): the slack a pass allows the bound on the error feedback
LEVEL_SLACK = 1 + 2**-7
COORDINATOR_SENDER = 2**31 - 1  # sender id of the coordinator's own frames (fits int32 and u32)
# coordinator.broadcast_density's default: the union of the round's frames, at most this
# density a frame, in as many frames as the union takes (docs/decisions.md, "One frame down")
BROADCAST_PASS_DENSITY = 0.25


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
    # an aggregated result (coordinator.broadcast): the workers' weighted frames whose
    # aggregate ``frames`` carries, and their mode; empty where the frames are broadcast
    sources: tuple[UpdateFrame, ...] = ()
    source_mode: str = ""

    @property
    def aggregated(self) -> bool:
        return bool(self.sources)


def apply_update(params: list[Tensor], update: Update, on_final: Callable[[int], None] | None = None) -> None:
    """The very call the workers make (``geoloco.replica.apply_round``), so the coordinator's
    parameters match theirs bit for bit; ``on_final``: apply_round's."""
    apply_round(params, [f.frame for f in update.frames], [f.weight for f in update.frames],
                update.mode, update.alpha, on_final)


def mean_weights(decision: Decision, aggregation: str) -> tuple[list[float], str]:
    """Weights and apply_frames mode of the round's update (docs/gradient-coding.md,
    "Aggregation").

    ``mean_kept``: weights a_i · |chosen| / covered with mode ``mean_kept``, so a coordinate
    every chosen frame kept gets Σ_i a_i m_i / covered, the mean over the covered
    partitions, and one kept by fewer the mean over those frames: SparseLoCo's rule, exact
    where the frames are disjoint plain sums of k partitions (B = I, ``ignore``, one
    frame per FR group: weights 1 / k), and for gc-cr the same estimate (measured: a weighted sum cost it
    13 % of loss, docs/decisions.md). Not for pgc-cr, whose overlapping frames carry
    versions of different ages (``decision.stale_overlap``: the mean over keepers cost it
    more loss than the sum, on both its orders), nor with ``mean``: the weighted sum
    a_i / covered with mode ``sum``.
    """
    coeffs = [a for _, a in sorted(decision.coefficients.items())]
    if aggregation == "mean_kept" and coeffs and not decision.stale_overlap:
        per_frame = decision.covered / len(coeffs)
        return [a / per_frame for a in coeffs], "mean_kept"
    return [a / max(decision.covered, 1) for a in coeffs], "sum"


def aggregation_note(cfg: RunConfig, code: GradientCode) -> str | None:
    """What the run's rounds are aggregated by, where it is not the configured
    ``mean_kept``: pgc-cr, whose overlapping frames carry versions of different ages, takes
    the weighted sum. None where every round uses the configured rule."""
    if cfg.outer.aggregation == "mean_kept" and code.stale_overlap:
        return (f"outer.aggregation 'mean_kept': coding.scheme {cfg.coding.scheme!r} combines overlapping "
                "frames of versions of different ages, whose loss the mean over keepers makes worse "
                "(docs/decisions.md); rounds are aggregated with mode 'sum' (a weighted sum)")
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

    def discard(self) -> None:  # noqa: B027 - most optimizers have nothing to undo
        """The update of the last ``step`` is not committed: undo what it did to this
        optimizer's state where that can be undone (DiLoCo's momentum keeps it)."""

    def worst_move(self, chosen: list[tuple[Arrival, float]], decision: Decision) -> float | None:
        """For an optimizer whose ``step`` cannot be undone: the most any coordinate of the
        update ``step`` would make of these frames can move, for the frame guard to admit
        before the step (``FrameBounds.admits``). None: ``discard`` undoes a step."""
        del chosen, decision
        return None

    def measure_bound(self) -> None:  # noqa: B027 - only an in-place step keeps a bound
        """Tighten what ``worst_move`` rests on by measuring it (a running bound only grows)."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        del state


class SparseLoCoOuter(OuterOptimizer):
    """Outer SGD without momentum: params += -lr * mean(frames), the pseudo-gradient being
    theta_global - theta_local.

    ``broadcast`` (coordinator.broadcast; docs/decisions.md, "One frame down"): ``frames``
    broadcasts the workers' frames as they are; ``aggregate`` compresses their aggregate,
    plus what earlier rounds' broadcasts left out, into one frame with the coordinator's own
    error feedback (``compressor``, decay 1: what a frame leaves out is delayed, never lost),
    so a worker downloads one frame whatever n; ``auto`` takes whichever of the two is
    smaller in bytes, round by round (a round of frames leaves the error feedback as it was).
    """

    def __init__(self, layout: Layout, cfg: OuterConfig, broadcast: str = "frames",
                 compressor: Compressor | None = None, passes: int = 1) -> None:
        super().__init__(layout, cfg)
        if broadcast != "frames" and compressor is None:
            raise ValueError(f"broadcast {broadcast!r} needs the coordinator's compressor")
        if passes < 1:
            raise ValueError(f"passes must be at least 1, got {passes}")
        self.broadcast = broadcast
        self.compressor = compressor
        self.passes = passes  # frames the aggregate goes out as (coordinator.broadcast_passes)
        self._compressed = False  # the last step compressed: discard() undoes it
        # ``aggregate`` compresses in place (no spare buffers, nothing to undo): a running
        # bound on max|error feedback| lets the guard admit a round before it changes it
        self.in_place = broadcast == "aggregate" and compressor is not None and not compressor.undoable
        self.ef_bound: float | None = None  # None: measure it when next needed

    def step(self, round: int, chosen: list[tuple[Arrival, float]], decision: Decision) -> Update:
        frames, mode = self._weighted(chosen, decision)
        return self.combine(round, frames, mode)

    def _weighted(self, chosen: list[tuple[Arrival, float]], decision: Decision) -> tuple[list[UpdateFrame], str]:
        """The chosen workers' frames with their weights in the update, and its apply mode
        (``mean_weights``)."""
        weights, mode = mean_weights(decision, self.aggregation)
        frames = [UpdateFrame(arr.worker, w, arr.data, arr.frame) for (arr, _), w in zip(chosen, weights, strict=True)]
        return frames, mode

    def combine(self, round: int, frames: list[UpdateFrame], mode: str) -> Update:
        """The update of ``frames`` weighted and aggregated by ``mode``, as broadcast. The
        only step that changes this optimizer's state, so a replayed round calls it again."""
        self._compressed = False
        as_frames = Update(frames, mode, -self.lr)
        if self.broadcast == "frames" or not frames:
            return as_frames
        c = self.compressor
        grown = self._bound_after(frames) if self.in_place else None
        sent = [c.compress_aggregate([f.frame for f in frames], [f.weight for f in frames],
                                     mode=mode, round=round, sender=COORDINATOR_SENDER)]
        for _ in range(1, self.passes):  # what the frames before left out: no new input, in place
            sent.append(c.compress_residual(round=round, sender=COORDINATOR_SENDER))
        self._compressed = True
        if grown is not None:
            self.ef_bound = grown
        if self.broadcast == AUTO and sum(len(f.data) for f in frames) <= sum(len(d) for d in sent):
            self.discard()
            return as_frames
        out = [UpdateFrame(COORDINATOR_SENDER, 1.0, d, decode_frame(d, self.layout)) for d in sent]
        return Update(out, "sum", -self.lr, tuple(frames), mode)

    def discard(self) -> None:
        if not self._compressed:
            return
        if self.in_place:  # worst_move admitted it: the guard cannot refuse what it admitted
            raise RuntimeError("an in-place aggregate cannot be undone; the frame guard admitted it before the step")
        self.compressor.restore()  # every pass: the later ones are made in place
        self._compressed = False

    def worst_move(self, chosen: list[tuple[Arrival, float]], decision: Decision) -> float | None:
        """In place: |lr| x passes x the largest value a pass can send, which is at most the
        error feedback's bound plus what the frames add (sum |w| max|v|), with LEVEL_SLACK a
        pass. None otherwise (``discard`` undoes the step)."""
        if not self.in_place or not chosen:
            return None
        frames, _ = self._weighted(chosen, decision)
        return abs(self.lr) * self.passes * self._bound_after(frames)

    def _bound_after(self, frames: list[UpdateFrame]) -> float:
        """A bound on max|error feedback| after a step of ``frames``, and on every value its
        frames send: before, plus the most the frames add to a coordinate (the mean over
        keepers adds no more than the weighted sum), LEVEL_SLACK for each pass."""
        if self.ef_bound is None:
            self.measure_bound()
        added = sum(abs(f.weight) * f.frame.magnitudes()[1] for f in frames)
        return (self.ef_bound + added) * LEVEL_SLACK ** self.passes

    def measure_bound(self) -> None:
        if self.in_place:
            c = self.compressor
            c.ensure_state()
            self.ef_bound = max((max(float(e.max()), -float(e.min())) for e in c.error_live() if e.numel()),
                                default=0.0)

    def state_dict(self) -> dict[str, Any]:
        """The aggregate's error feedback, its live buffers (as DiLoCo's momentum): the
        checkpoint writes them between two rounds, on the round loop's thread."""
        return {"broadcast_error_feedback": self.compressor.state_dict(copy=False)} if self.compressor else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state.get("broadcast_error_feedback")
        if self.compressor is not None and saved is not None:
            self.compressor.load_state_dict(saved)
            self.ef_bound = None


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


def make_outer(cfg: RunConfig, layout: Layout) -> OuterOptimizer:
    """The outer optimizer of the run: ``compression.method`` (sparseloco | diloco; DiLoCo
    broadcasts one dense frame in ``compression.dense_dtype``) and, for SparseLoCo,
    ``coordinator.broadcast`` with its compressor."""
    method = cfg.compression.method
    if method == "sparseloco":
        broadcast = cfg.coordinator.broadcast
        compressor = broadcast_compressor(cfg, layout) if broadcast != "frames" else None
        return SparseLoCoOuter(layout, cfg.outer, broadcast, compressor, broadcast_passes(cfg))
    if method == "diloco":
        return DiLoCoOuter(layout, cfg.outer, cfg.compression.dense_dtype)
    raise ValueError(f"compression.method {method!r} is not one of sparseloco, diloco")


def broadcast_compressor(cfg: RunConfig, layout: Layout) -> Compressor:
    """The coordinator's compressor of aggregated results: the workers' codec at
    ``broadcast_density``, error-feedback decay 1; undoable under ``auto`` (a round sent as
    frames, or a discarded update, puts its state back: the encoder's spare buffers), in
    place under ``aggregate`` (no spare buffers: one fp32 copy of the model less)."""
    return sparse_compressor(layout, cfg.compression, density=broadcast_density(cfg), beta=1.0,
                             undoable=cfg.coordinator.broadcast == AUTO)


def broadcast_density(cfg: RunConfig) -> float:
    """coordinator.broadcast_density, or by default the density of the union of the frames
    a round aggregates (``union_density``), at most BROADCAST_PASS_DENSITY a frame."""
    density = cfg.coordinator.broadcast_density
    if density is not None:
        return float(density)
    return min(BROADCAST_PASS_DENSITY, union_density(cfg))


def broadcast_passes(cfg: RunConfig) -> int:
    """coordinator.broadcast_passes, or by default 1 where the density is set, else the
    frames of BROADCAST_PASS_DENSITY the union takes, at most MAX_BROADCAST_PASSES."""
    co = cfg.coordinator
    if co.broadcast_passes is not None:
        return co.broadcast_passes
    if co.broadcast_density is not None:
        return 1
    return min(MAX_BROADCAST_PASSES, max(1, math.ceil(union_density(cfg) / BROADCAST_PASS_DENSITY - 1e-9)))


def union_density(cfg: RunConfig) -> float:
    """What the frames of a round where every worker arrives keep at most, together: their
    number (n; n / (s + 1) under an FR code, which takes one frame a group) times the
    workers' density (their starting density where it is "auto"), at most 1."""
    workers = cfg.compression.density if cfg.compression.density != AUTO else START_DENSITY
    frames = cfg.workers
    if cfg.coding.scheme.endswith("-fr"):
        frames //= cfg.coding.tolerance(cfg.workers) + 1
    return min(1.0, frames * float(workers))
