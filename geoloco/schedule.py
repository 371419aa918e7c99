"""The inner learning-rate schedule, linear warm-up then cosine decay (DiLoCo, Douillard et
al. 2023): the workers train with it and the coordinator's metrics report it."""

from __future__ import annotations

import math

from geoloco.config import InnerConfig


def lr_at(inner: InnerConfig, global_step: int, total_steps: int) -> float:
    """Linear warm-up to ``inner.lr`` over ``warmup_steps``, then cosine decay to
    ``lr * min_lr_ratio`` at ``total_steps`` (the whole run's inner steps)."""
    if global_step < inner.warmup_steps:
        return inner.lr * (global_step + 1) / inner.warmup_steps
    span = max(1, total_steps - inner.warmup_steps)
    progress = min(1.0, (global_step - inner.warmup_steps) / span)
    floor = inner.lr * inner.min_lr_ratio
    return floor + 0.5 * (inner.lr - floor) * (1.0 + math.cos(math.pi * progress))
