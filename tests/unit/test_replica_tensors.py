"""Any parameter set on the wire: tied weights once, float buffers carried like parameters,
frozen parameters and integer or non-persistent buffers left out, bf16 parameters behind an
fp32 master copy; a worker's round applied to the coordinator's model gives both the same
digest. Also bf16 autocast on the CPU and the data positions a worker checkpoint keeps."""

from __future__ import annotations

import torch
from torch import nn

from geoloco.compression import Compressor, decode_frame
from geoloco.config import InnerConfig, TaskConfig
from geoloco.replica import apply_round, param_digest, replica_layout, replica_tensors
from geoloco.tasks import build_task
from geoloco.worker.trainer import InnerTrainer, resolve_precision

CPU = torch.device("cpu")
INNER = InnerConfig(steps=3, lr=1e-2, warmup_steps=0)


class Odd(nn.Module):
    """Tied embedding and head, BatchNorm (float running statistics and an integer step
    count), a frozen scale, a non-persistent table."""

    def __init__(self, vocab: int, width: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.norm = nn.BatchNorm1d(width)
        self.scale = nn.Parameter(torch.full((width,), 0.5), requires_grad=False)
        self.register_buffer("table", torch.arange(width, dtype=torch.float32), persistent=False)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.embed(x).transpose(1, 2)).transpose(1, 2)
        return self.head(h * self.scale + 0 * self.table)


def odd_model(spec):
    return Odd(spec.vocab_size)


def odd_bf16(spec):
    return Odd(spec.vocab_size).to(torch.bfloat16)


def task_for(factory: str):
    cfg = TaskConfig(model=f"{__file__}:{factory}", seq_len=16, batch_size=4, val_windows=4,
                     corpus_bytes=40_000, tokenizer="bytes")
    return build_task(cfg, 2, seed=5)


def test_the_replicas_share_trainable_parameters_and_float_buffers() -> None:
    model = Odd(256)
    names = [n for n, _ in replica_tensors(model)]
    assert names == ["embed.weight", "norm.weight", "norm.bias", "norm.running_mean", "norm.running_var"]
    layout = replica_layout(model.to(torch.bfloat16))
    assert [s.dtype for s in layout.specs] == [torch.float32] * 5
    assert layout == replica_layout(Odd(256))  # a bf16 worker joins an fp32 coordinator


def coordinator_side(task) -> tuple[nn.Module, list[torch.Tensor]]:
    model = task.make_model().to("cpu", torch.float32)
    return model, [t.data for _, t in replica_tensors(model)]


def one_round(task, trainer: InnerTrainer, coordinator: list[torch.Tensor]) -> list[torch.Tensor]:
    """A worker trains from the coordinator's θ, sends a sparse frame, and both apply it."""
    layout = replica_layout(trainer.model)
    theta = [t.clone() for t in coordinator]
    deltas, _ = trainer.train_partition(theta, 0, 0)
    assert all(d.dtype == torch.float32 for d in deltas)
    frame = decode_frame(Compressor(layout, density=0.25, tile=8).compress(deltas, round=0, sender=0), layout)
    apply_round(theta, [frame], [1.0], "sum", -1.0)
    apply_round(coordinator, [frame], [1.0], "sum", -1.0)
    assert param_digest(theta) == param_digest(coordinator)
    return deltas


def test_a_round_moves_buffers_and_keeps_frozen_tensors_on_both_sides() -> None:
    task = task_for("odd_model")
    model, coordinator = coordinator_side(task)
    before = model.norm.running_mean.clone()
    trainer = InnerTrainer(task, INNER, rounds=2, device=CPU)
    deltas = one_round(task, trainer, coordinator)
    names = [n for n, _ in replica_tensors(trainer.model)]
    assert deltas[names.index("norm.running_mean")].abs().sum() > 0  # BatchNorm's statistics moved
    assert not torch.equal(model.norm.running_mean, before)  # the coordinator's model has them
    assert torch.equal(model.scale, torch.full((16,), 0.5))
    assert model.head.weight is model.embed.weight
    assert trainer.optimizer.param_groups[0]["params"] == list(p for p in trainer.model.parameters()
                                                               if p.requires_grad)


def test_bf16_parameters_train_behind_an_fp32_master_copy() -> None:
    task = task_for("odd_bf16")
    _, coordinator = coordinator_side(task)
    trainer = InnerTrainer(task, INNER, rounds=2, device=CPU)
    assert trainer.model.embed.weight.dtype == torch.bfloat16
    theta = [t.clone() for t in coordinator]
    deltas, _ = trainer.train_partition(theta, 0, 0)
    for t, d, p in zip(theta, deltas, trainer.params, strict=True):
        # Δ is measured from θ as the bf16 model held it: no rounding error of θ in it
        assert torch.equal(t.to(torch.bfloat16).float() - d, p.float())
    one_round(task, InnerTrainer(task, INNER, rounds=2, device=CPU), coordinator)


def test_bf16_autocast_on_the_cpu_keeps_deltas_fp32() -> None:
    task = build_task(TaskConfig(seq_len=16, batch_size=4, val_windows=4, corpus_bytes=40_000), 2)
    fp32 = InnerTrainer(task, INNER, rounds=2, device=CPU, precision="fp32")
    bf16 = InnerTrainer(task, INNER, rounds=2, device=CPU, precision="bf16")
    assert resolve_precision("auto", CPU) == "fp32" and bf16.precision == "bf16"
    theta = [p.detach().clone() for p in fp32.params]
    d32, loss32 = fp32.train_partition(theta, 1, 0)
    d16, loss16 = bf16.train_partition(theta, 1, 0)
    assert abs(loss16 - loss32) < 0.05 and all(d.dtype == torch.float32 for d in d16)
    assert all(p.dtype == torch.float32 for p in bf16.params)  # autocast leaves the weights fp32
    assert not all(torch.equal(a, b) for a, b in zip(d32, d16, strict=True))


def test_a_trainer_reports_and_resumes_its_data_positions() -> None:
    task = task_for("odd_model")
    trainer = InnerTrainer(task, INNER, rounds=4, device=CPU)
    theta = [p.detach().clone() for p in trainer.params]
    trainer.train_partition(theta, 1, 0)
    saved = trainer.data_state()
    assert saved == {1: {"partition": 1, "step": 3, "data": task.split_fingerprint}}
    resumed = InnerTrainer(task, INNER, rounds=4, device=CPU)
    resumed.load_data_state(saved)
    assert resumed.positions[1].step == 3
    resumed.train_partition(theta, 1, 2)  # a later round: its position comes from the round
    assert resumed.data_state()[1]["step"] == 9
