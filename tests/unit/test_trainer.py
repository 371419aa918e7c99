"""The worker's inner loop: warm-up + cosine schedule, Δ = θ_global − θ_local on CPU fp32,
AdamW state kept across rounds, and the loss going down on gpt-tiny."""

from __future__ import annotations

import pytest
import torch

from geoloco.config import InnerConfig, TaskConfig
from geoloco.tasks import build_task
from geoloco.worker.trainer import InnerTrainer, lr_at, resolve_device

TASK = TaskConfig(model="gpt-tiny", seq_len=32, batch_size=4, val_windows=8, corpus_bytes=200_000)


def test_lr_warms_up_linearly_then_decays_to_the_floor() -> None:
    inner = InnerConfig(lr=1e-3, warmup_steps=10, min_lr_ratio=0.1)
    assert lr_at(inner, 0, 100) == pytest.approx(1e-4)
    assert lr_at(inner, 9, 100) == pytest.approx(1e-3)
    assert lr_at(inner, 10, 100) == pytest.approx(1e-3)
    assert lr_at(inner, 55, 100) == pytest.approx(0.55e-3)  # cosine midpoint: (1 + 0.1) / 2
    assert lr_at(inner, 100, 100) == pytest.approx(1e-4)
    assert lr_at(inner, 500, 100) == pytest.approx(1e-4)
    values = [lr_at(inner, s, 100) for s in range(10, 101)]
    assert all(a >= b for a, b in zip(values, values[1:], strict=False))


def test_no_warmup_starts_at_the_peak() -> None:
    assert lr_at(InnerConfig(lr=2e-3, warmup_steps=0), 0, 50) == pytest.approx(2e-3)


def test_cuda_without_a_gpu_is_a_clear_error() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert resolve_device("auto").type == "cpu"
    with pytest.raises(RuntimeError, match="worker.device"):
        resolve_device("cuda")


@pytest.mark.slow
def test_delta_is_global_minus_local_and_adamw_state_persists() -> None:
    torch.manual_seed(0)
    task = build_task(TASK, 2, seed=1)
    inner = InnerConfig(steps=3, lr=1e-3, warmup_steps=2)
    trainer = InnerTrainer(task, inner, rounds=4, device=torch.device("cpu"))
    theta = [p.detach().clone() for p in trainer.params]
    deltas, loss = trainer.train_partition(theta, partition=1, round_index=0)
    assert loss > 0
    assert [d.shape for d in deltas] == [t.shape for t in theta]
    assert all(d.dtype == torch.float32 and d.device.type == "cpu" for d in deltas)
    for t, d, p in zip(theta, deltas, trainer.params, strict=True):
        torch.testing.assert_close(t - d, p.detach())
    assert any(d.abs().sum() > 0 for d in deltas)
    state = trainer.optimizer.state[trainer.params[0]]
    assert int(state["step"]) == 3
    trainer.train_partition(theta, partition=1, round_index=1)
    assert int(trainer.optimizer.state[trainer.params[0]]["step"]) == 6


@pytest.mark.slow
def test_same_inputs_give_bit_identical_deltas() -> None:
    task = build_task(TASK, 2, seed=1)
    inner = InnerConfig(steps=2, lr=1e-3, warmup_steps=0)
    a = InnerTrainer(task, inner, rounds=2, device=torch.device("cpu"))
    b = InnerTrainer(task, inner, rounds=2, device=torch.device("cpu"))
    theta = [p.detach().clone() for p in a.params]
    da, _ = a.train_partition(theta, 0, 1)
    db, _ = b.train_partition(theta, 0, 1)
    assert all(torch.equal(x, y) for x, y in zip(da, db, strict=True))


@pytest.mark.slow
def test_training_from_the_updated_parameters_lowers_the_loss() -> None:
    task = build_task(TASK, 1, seed=2)
    inner = InnerConfig(steps=10, lr=3e-3, warmup_steps=2)
    trainer = InnerTrainer(task, inner, rounds=4, device=torch.device("cpu"))
    theta = [p.detach().clone() for p in trainer.params]
    losses = []
    for r in range(4):
        deltas, loss = trainer.train_partition(theta, 0, r)
        losses.append(loss)
        theta = [t - d for t, d in zip(theta, deltas, strict=True)]  # outer SGD, lr 1
    assert losses[-1] < losses[0] - 0.3, losses


@pytest.mark.slow
def test_a_mid_phase_fold_moves_the_steps_taken_onto_the_new_start() -> None:
    """``fold=(k, new)``: before step k the model gains new − old and Δ counts from new.
    A fold to the same start changes nothing, bit for bit; a fold before the first step is
    training from the new start (up to the fp32 rounding of old + (new − old)); after a
    fold mid-phase, Δ is the new start minus the phase's end, and the last steps, taken
    from moved parameters, make another Δ than the unfolded phase's."""
    task = build_task(TASK, 2, seed=1)
    inner = InnerConfig(steps=4, lr=1e-3, warmup_steps=0)

    def trainer() -> InnerTrainer:
        torch.manual_seed(0)
        return InnerTrainer(task, inner, rounds=2, device=torch.device("cpu"))

    base = trainer()
    old = [p.detach().clone() for p in base.params]
    new = [t + 0.01 * torch.randn_like(t) for t in old]
    plain, _ = base.train_partition(old, 0, 0)
    same, _ = trainer().train_partition(old, 0, 0, fold=(2, lambda step: [t.clone() for t in old]))
    assert all(torch.equal(a, b) for a, b in zip(plain, same, strict=True))
    from_new, _ = trainer().train_partition(new, 0, 0)
    at_zero, _ = trainer().train_partition(old, 0, 0, fold=(0, lambda step: new))
    for a, b in zip(from_new, at_zero, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    folded = trainer()
    delta, _ = folded.train_partition(old, 0, 0, fold=(2, lambda step: new))
    for n, d, p in zip(new, delta, folded.params, strict=True):
        torch.testing.assert_close(n - d, p.detach())  # Δ counts from the new start
    assert not all(torch.allclose(a, b, atol=1e-6) for a, b in zip(delta, plain, strict=True))
    # outer.fold_step "arrival": a predicate, asked before each step from 1 on until it is
    # first true, folds there as the fixed step does, bit for bit
    asked, moved_at = [], []

    def arrived(step: int) -> bool:
        asked.append(step)
        return step == 2

    def start(step: int) -> list[torch.Tensor]:
        moved_at.append(step)
        return new

    by_arrival, _ = trainer().train_partition(old, 0, 0, fold=(arrived, start))
    assert (asked, moved_at) == ([1, 2], [2])
    assert all(torch.equal(a, b) for a, b in zip(delta, by_arrival, strict=True))
