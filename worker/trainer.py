"""The worker's inner loop: H AdamW steps from the global parameters on one data partition,
returning the pseudo-gradient Δ = θ_global − θ_local (DiLoCo, Douillard et al. 2023;
SparseLoCo, Sarfi et al. 2025, arXiv 2508.15706). See docs/protocol.md step 4.
"""

from __future__ import annotations

import logging
import math

import torch
from torch import Tensor, nn

from geoloco.config import InnerConfig
from geoloco.tasks import Task

log = logging.getLogger(__name__)


def resolve_device(choice: str) -> torch.device:
    """``auto`` picks CUDA when available, else CPU; ``cuda`` without a GPU is an error."""
    if choice == "cpu":
        return torch.device("cpu")
    if choice == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("worker.device is 'cuda' but torch sees no CUDA device; use 'auto' or 'cpu'")
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def describe_device(device: torch.device) -> str:
    """``cpu`` or ``cuda:0 (NVIDIA H200)``, as reported at Join."""
    if device.type != "cuda":
        return "cpu"
    index = device.index if device.index is not None else torch.cuda.current_device()
    return f"cuda:{index} ({torch.cuda.get_device_name(index)})"


def lr_at(inner: InnerConfig, global_step: int, total_steps: int) -> float:
    """Linear warm-up to ``inner.lr`` over ``warmup_steps``, then cosine decay to
    ``lr * min_lr_ratio`` at ``total_steps`` (the whole run's inner steps)."""
    if global_step < inner.warmup_steps:
        return inner.lr * (global_step + 1) / inner.warmup_steps
    span = max(1, total_steps - inner.warmup_steps)
    progress = min(1.0, (global_step - inner.warmup_steps) / span)
    floor = inner.lr * inner.min_lr_ratio
    return floor + 0.5 * (inner.lr - floor) * (1.0 + math.cos(math.pi * progress))


class InnerTrainer:
    """One model replica on the training device with an AdamW state that persists across
    rounds; the caller's master copy of θ stays on CPU in fp32."""

    def __init__(self, task: Task, inner: InnerConfig, rounds: int, device: torch.device) -> None:
        self.task = task
        self.inner = inner
        self.total_steps = rounds * inner.steps
        self.device = device
        self.model: nn.Module = task.make_model().to(device)
        self.model.train()
        self.params = [p for _, p in self.model.named_parameters()]
        self.optimizer = torch.optim.AdamW(
            self.params,
            lr=inner.lr,
            betas=(inner.beta1, inner.beta2),
            weight_decay=inner.weight_decay,
        )

    def train_partition(self, theta: list[Tensor], partition: int, round_index: int) -> tuple[list[Tensor], float]:
        """H AdamW steps from ``theta`` on ``partition``; returns (Δ on CPU fp32, mean loss).
        Batches and the learning rate follow the global step ``round × H + step``."""
        self._load(theta)
        losses = []
        for step in range(self.inner.steps):
            global_step = round_index * self.inner.steps + step
            losses.append(self._step(partition, global_step))
        return self._deltas(theta), sum(losses) / len(losses)

    def _load(self, theta: list[Tensor]) -> None:
        with torch.no_grad():
            for p, t in zip(self.params, theta, strict=True):
                p.copy_(t, non_blocking=True)

    def _step(self, partition: int, global_step: int) -> float:
        for group in self.optimizer.param_groups:
            group["lr"] = lr_at(self.inner, global_step, self.total_steps)
        x, y = self.task.batch(partition, global_step)
        loss = self.task.loss(self.model, x, y)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if self.inner.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.params, self.inner.grad_clip)
        self.optimizer.step()
        value = loss.item()
        if not math.isfinite(value):
            raise FloatingPointError(f"inner loss became {value} at global step {global_step}; lower inner.lr")
        return value

    def _deltas(self, theta: list[Tensor]) -> list[Tensor]:
        with torch.no_grad():
            return [t - p.detach().to("cpu", torch.float32) for t, p in zip(theta, self.params, strict=True)]
