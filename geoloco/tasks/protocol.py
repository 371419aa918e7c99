"""What a round needs from the user's task: a model factory, a per-partition batch iterator
that resumes from a position, a loss and an evaluation (README, "Bring your own model").
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from torch import Tensor, nn

from geoloco.config import ConfigError

Batch = tuple[Tensor, Tensor]  # (inputs, next-token targets), both (batch, seq_len) int64
LossFn = Callable[[nn.Module, Batch], Tensor]  # a scalar to minimise; moves the batch itself


class TaskError(ConfigError):
    """A model or data input the task cannot use; the message names the file or the field
    and what is wrong (a ConfigError, so the command exits 2)."""


@dataclass(frozen=True)
class ModelSpec:
    """What a ``module:function`` model factory is called with."""

    vocab_size: int  # token ids are 0 .. vocab_size - 1; the embedding needs that many rows
    seq_len: int  # tokens per training sequence (task.seq_len)
    seed: int  # the run's seed; torch's RNG is seeded with it around the call too


@runtime_checkable
class BatchIterator(Protocol):
    """Batches of one partition from a position on. Batch ``k`` is a pure function of the
    run's seed, the partition and ``k`` (the global inner step ``round × H + step``), so
    every replica that trains a partition in a round sees the same batches (gradient
    coding's decode relies on it). ``state_dict`` is the position a worker checkpoint saves;
    ``load_state_dict`` resumes there."""

    partition: int
    step: int  # the position: the next batch returned is batch ``step``

    def __iter__(self) -> Iterator[Batch]: ...

    def __next__(self) -> Batch: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@runtime_checkable
class Task(Protocol):
    """Model and data of a run, the same on the coordinator and on every worker."""

    n_partitions: int

    def make_model(self, seed: int | None = None) -> nn.Module:
        """A fresh model on CPU, deterministic from ``seed`` (default: the run's seed)."""

    def batches(self, partition: int, step: int = 0) -> BatchIterator:
        """Partition ``partition``'s batches from position ``step`` on."""

    def loss(self, model: nn.Module, batch: Batch) -> Tensor:
        """The training loss of one batch (the inner loop backpropagates it)."""

    def val_loss(self, model: nn.Module) -> float:
        """The evaluation: mean loss over fixed held-out batches, without gradients."""
