"""Overlapped rounds on the worker (outer.overlap): the running copy an inner phase starts
from while the previous round's result is still on its way, kept apart from the global
track that every replica holds bit-identical. ``delayed`` is the one-round-delayed outer
update; ``eager`` adds the worker's own pseudo-gradient as a stand-in for the missing
round's update (Kale, Douillard and Donchev 2025, "Eager Updates For Overlapped
Communication and Computation in DiLoCo", arXiv 2502.12996; ``outer.standin`` says for how
much of it). docs/decisions.md,
"Overlapped rounds", has the mapping onto error feedback, the mean over keepers and the
settlements.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from geoloco.config import RunConfig

MODES = ("none", "delayed", "eager")


def standin_scale(cfg: RunConfig, parts: int = 1) -> float:
    """The factor of each of the worker's own fresh pseudo-gradients (one per partition it
    trained, ``parts`` of them) in the eager stand-in: the outer step's immediate response to
    its input (SGD, SparseLoCo's outer step: -lr; Nesterov, DiLoCo's: -lr (1 + mu), since a
    gradient g enters the change -lr (g + mu (mu m + g)) with weight -lr (1 + mu)) times
    what one pseudo-gradient stands in for. ``outer.standin`` "mean": the mean over the
    worker's partitions stands in for the round's mean over all n, so 1/parts each;
    "share": each is its 1/n share of the round's mean (Kale et al.'s local term). The outer
    momentum of past rounds is already in the global track."""
    lr = float(cfg.outer.lr if cfg.outer.lr is not None else 1.0)
    momentum = float(cfg.outer.momentum or 0.0) if cfg.compression.method == "diloco" else 0.0
    share = cfg.workers if cfg.outer.standin == "share" else max(parts, 1)
    return -lr * (1.0 + momentum) / share


def running_copy(mode: str, global_track: Sequence[Tensor], own: Sequence[Sequence[Tensor]],
                 scale: float, copy: bool = False) -> list[Tensor]:
    """What the next inner phase starts from while the round just pushed is in flight.
    ``delayed`` (and ``eager`` with nothing of its own): the global track itself, not a
    copy (nothing changes it until the phase ends and its result is folded in), unless
    ``copy`` (outer.fold_step: the result is folded in mid-phase). ``eager``:
    a copy of it plus ``scale`` times each of ``own`` (the pseudo-gradients this worker
    trained in the round in flight), the paper's local term for the round whose global
    update is not in yet; the global one replaces it when it arrives, since the phase
    after it starts again from the global track."""
    if mode not in MODES or mode == "none":
        raise ValueError(f"overlap mode {mode!r} has no running copy (one of delayed, eager)")
    if mode == "delayed" or not own:
        return [t.clone() for t in global_track] if copy else list(global_track)
    with torch.no_grad():
        out = [t.clone() for t in global_track]
        for delta in own:
            for o, d in zip(out, delta, strict=True):
                o.add_(d, alpha=scale)
    return out
