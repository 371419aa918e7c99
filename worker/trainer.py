"""The worker's inner loop: H AdamW steps from the global parameters on one data partition,
returning the pseudo-gradient Δ = θ_global − θ_local (DiLoCo, Douillard et al. 2023;
SparseLoCo, Sarfi et al. 2025, arXiv 2508.15706), optionally under bf16 autocast; a hook
may replace the step itself. See docs/protocol.md step 4.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from geoloco.config import InnerConfig
from geoloco.replica import replica_tensors
from geoloco.schedule import lr_at
from geoloco.tasks import Batch, BatchIterator, Task
from geoloco.worker.island import (
    Island,
    local_optimizer_state,
    shard_model,
    sharded_optimizer_state,
)

if TYPE_CHECKING:
    from geoloco.worker.island_state import IslandState

log = logging.getLogger(__name__)


class TrainingStopped(Exception):
    """The worker is stopping: the inner loop ended before its H steps."""


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


def resolve_precision(choice: str, device: torch.device) -> str:
    """``auto`` is bf16 on a CUDA device that has it, else fp32; ``bf16`` on a GPU without
    it is an error (on a CPU, torch's bf16 autocast works, if slowly)."""
    cuda_bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
    if choice == "auto":
        return "bf16" if cuda_bf16 else "fp32"
    if choice == "bf16" and device.type == "cuda" and not cuda_bf16:
        raise RuntimeError(f"worker.precision is 'bf16' but {describe_device(device)} has no bf16; "
                           "use 'auto' or 'fp32'")
    return choice


InnerStep = Callable[["InnerTrainer", Batch], float]
"""A replacement for InnerTrainer.default_step: one inner step on ``batch`` (forward under
``trainer.autocast()``, backward, optimizer step), returning the loss. The trainer has set
the learning rate before, and checks that the loss is finite after."""

Fold = tuple["int | Callable[[int], bool]", Callable[[int], list[Tensor]]]
"""InnerTrainer.train_partition's mid-phase fold: (when, new start); ``when`` is an inner
step k, or a predicate asked before each step from 1 on until it is first true."""


def fold_due(when: int | Callable[[int], bool], step: int) -> bool:
    """Whether a Fold's move is due before inner ``step``."""
    if isinstance(when, int):
        return step == when
    return step > 0 and bool(when(step))


class InnerTrainer:
    """One model replica on the training device with an AdamW state that persists across
    rounds; the caller's master copy of θ stays on CPU in fp32. ``params`` are the model's
    tensors θ maps to (geoloco.replica.replica_tensors), ``trainable`` what AdamW updates.
    In an ``island`` (geoloco.worker.island) every rank holds one: rank 0 sends the others
    each partition to train and broadcasts θ, each rank trains on its share of every batch
    and the gradients are averaged before each step."""

    def __init__(self, task: Task, inner: InnerConfig, rounds: int, device: torch.device,
                 precision: str = "fp32", step: InnerStep | None = None,
                 island: Island | None = None) -> None:
        if island is not None and step is not None:
            raise ValueError("an inner_step of one's own cannot run in an island of ranks")
        self.task = task
        self.island = island
        self.inner = inner
        self.total_steps = rounds * inner.steps
        self.device = device
        self.precision = resolve_precision(precision, device)
        self.step_fn = step
        self.model: nn.Module = task.make_model().to(device)
        self.model.train()
        self.island_state: IslandState | None = None  # fsdp: θ and the Δs in pieces (set by its maker)
        if island is not None and island.sharded:
            shard_model(self.model)
        self.params = [t for _, t in replica_tensors(self.model)]
        self.trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            self.trainable,
            lr=inner.lr,
            betas=(inner.beta1, inner.beta2),
            weight_decay=inner.weight_decay,
        )
        self.positions: dict[int, BatchIterator] = {}  # each partition's data position

    def train_partition(self, theta: list[Tensor] | None, partition: int, round_index: int,
                        stop: threading.Event | None = None, fold: Fold | None = None,
                        running: bool = False) -> tuple[list[Tensor] | None, float]:
        """H AdamW steps from ``theta`` on ``partition``; returns (Δ on CPU fp32, mean loss).
        Batches and the learning rate follow the global step ``round × H + step``. Once
        ``stop`` is set, TrainingStopped at the next step (in an island: on every rank, after
        the step's gradient exchange). On an island's other ranks ``theta`` is None (it comes
        from rank 0) and so is the returned Δ. Under fsdp (``island_state``) every rank starts
        from its pieces of θ, or of the running copy (``running``; on rank 0: ``theta`` is
        that copy), and keeps its pieces of Δ there; None is returned. ``fold`` = (when, new start): before step k,
        where ``when`` is k or, as a predicate, first true for k (asked before each step from
        1 on), the start moves to ``new start(k)`` and the steps taken so far move with it
        (the model gains new − old); Δ is then taken from the new start, which must not
        change until this returns (an overlapped round's late result folded in mid-phase;
        not in an island)."""
        island = self.island
        if fold is not None and island is not None:
            raise ValueError("a mid-phase fold is not supported in an island")
        state = self.island_state
        if state is not None:
            running = running or (state.running is not None and theta is state.running)
        if island is not None and island.leader:
            island.send("train", partition, round_index, running)
        if state is not None:
            state.start(self.params, running)
        else:
            if theta is not None:
                self._load(theta)
            if island is not None:
                island.broadcast(self.params)
        batches = self._batches(partition, round_index * self.inner.steps)
        losses = []
        moved = False
        for step in range(self.inner.steps):
            if fold is not None and not moved and fold_due(fold[0], step):
                theta, moved = self._move_start(theta, fold[1](step)), True
            stopping = stop is not None and stop.is_set()
            if stopping and island is None:
                raise TrainingStopped(f"stopped at inner step {step} of round {round_index}")
            global_step = round_index * self.inner.steps + step
            losses.append(self._step(next(batches), global_step, stopping))
        if state is not None:
            state.keep(partition, self.params, running)
        if theta is None or state is not None:
            return None, sum(losses) / len(losses)
        return self._deltas(theta, self.params), sum(losses) / len(losses)

    def _move_start(self, old: list[Tensor], new: list[Tensor]) -> list[Tensor]:
        """The model plus (new − old), element by element in fp32: the steps taken from
        ``old`` now count from ``new``. Returns ``new``."""
        with torch.no_grad():
            for p, a, b in zip(self.params, old, new, strict=True):
                p.copy_((p.float() + (b.to(p.device, torch.float32) - a.to(p.device, torch.float32))).to(p.dtype))
        return new

    def _batches(self, partition: int, step: int) -> BatchIterator:
        """The partition's batch iterator at ``step``: the round decides where a partition's
        data is (every replica training it this round reads the same batches), so a position
        restored from a checkpoint is moved there when it differs."""
        batches = self.positions.get(partition)
        if batches is None:
            batches = self.positions[partition] = self.task.batches(partition, step)
        elif batches.step != step:
            log.debug("partition %d: data position %d moved to %d", partition, batches.step, step)
            batches.load_state_dict({**batches.state_dict(), "step": step})
        return batches

    def data_state(self) -> dict[int, dict[str, Any]]:
        """Each trained partition's data position, for a worker checkpoint."""
        return {p: batches.state_dict() for p, batches in self.positions.items()}

    def load_data_state(self, state: dict[int, dict[str, Any]]) -> None:
        """Resume the data positions ``data_state`` saved (ValueError if they belong to
        other data or partitions)."""
        for partition, saved in state.items():
            batches = self.task.batches(int(partition))
            batches.load_state_dict(saved)
            self.positions[int(partition)] = batches

    def autocast(self) -> contextlib.AbstractContextManager:
        """bf16 autocast on the training device when the precision is bf16, else nothing."""
        if self.precision == "bf16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _load(self, theta: list[Tensor]) -> None:
        with torch.no_grad():
            for p, t in zip(self.params, theta, strict=True):
                p.copy_(t, non_blocking=True)

    def _step(self, batch: Batch, global_step: int, stopping: bool = False) -> float:
        for group in self.optimizer.param_groups:
            group["lr"] = lr_at(self.inner, global_step, self.total_steps)
        if self.island is not None:
            value = self._island_step(batch, global_step, stopping)
        else:
            value = (self.step_fn or InnerTrainer.default_step)(self, batch)
        if not math.isfinite(value):
            raise FloatingPointError(f"inner loss became {value} at global step {global_step}; lower inner.lr")
        return value

    def default_step(self, batch: Batch) -> float:
        """Forward and loss under autocast, backward, clip, AdamW step; the loss value."""
        with self.autocast():
            loss = self.task.loss(self.model, batch)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.clip_gradients()
        self.optimizer.step()
        return float(loss.item())

    def _island_step(self, batch: Batch, global_step: int, stopping: bool) -> float:
        """The default step on this rank's share of ``batch``, with the gradients (and the
        loss) averaged over the island before clipping and AdamW; every rank raises
        TrainingStopped instead of stepping when rank 0 is ``stopping``."""
        with self.autocast():
            loss = self.task.loss(self.model, self.island.shard(batch))
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        value, stop = self.island.average_gradients(self.trainable, float(loss.detach()), stopping)
        if stop:
            raise TrainingStopped(f"stopped at global step {global_step}")
        self.clip_gradients()
        self.optimizer.step()
        return value

    def clip_gradients(self) -> None:
        """Clip the trainable parameters' gradient norm to ``inner.grad_clip`` (0: no
        clipping), as the default step does between backward and the optimizer step; an
        ``inner_step`` of one's own calls it there too to keep the run's clipping."""
        if self.inner.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.trainable, self.inner.grad_clip)

    def master_copy(self) -> list[Tensor]:
        """The model's tensors as a CPU fp32 copy, whole (not under fsdp: the island's θ is
        in pieces)."""
        return [p.detach().to("cpu", torch.float32, copy=True) for p in self.params]

    def optimizer_state(self) -> dict:
        """The inner AdamW state to save: this rank's shard of it under fsdp."""
        state = self.optimizer.state_dict()
        return local_optimizer_state(state) if self.island is not None and self.island.sharded else state

    def load_optimizer_state(self, state: dict) -> None:
        """``optimizer_state``'s inverse (IslandError for a shard of another sharding)."""
        if self.island is not None and self.island.sharded:
            state = sharded_optimizer_state(state, self.trainable)
        self.optimizer.load_state_dict(state)

    def optimizer_shard(self) -> list[int] | None:
        """Which shard of the AdamW state ``optimizer_state`` holds: [rank, ranks] under
        fsdp, None for the whole state."""
        return [self.island.rank, self.island.size] if self.island is not None and self.island.sharded else None

    def _deltas(self, theta: list[Tensor], ends: list[Tensor]) -> list[Tensor]:
        """Δ = start − end in fp32, the start being θ as the model held it (θ itself for fp32
        tensors, θ rounded to the tensor's dtype for bf16 or fp16 ones)."""
        with torch.no_grad():
            return [(t if p.dtype == torch.float32 else t.to(p.dtype).float()) - e.detach().to("cpu", torch.float32)
                    for t, p, e in zip(theta, self.params, ends, strict=True)]
